package statedisk

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

const (
	// DefaultImageSize is the size Format gives an image file that does not exist or is empty
	// (sparse: it takes disk space only as it fills).
	DefaultImageSize = 2 << 30
	// HeaderFile is the name of the fscrypt backend's header file at the file system's root.
	HeaderFile = "berth-state-header.json"
	// DataDir is the fscrypt-encrypted directory at the file system's root that Root returns.
	DataDir = "data"
	// fsLabel is the ext4 label (and LUKS label) of a state disk.
	fsLabel = "berth-state"
	// volumeKeySize is the size of an fscrypt master key (AES-256-XTS takes all 64 bytes).
	volumeKeySize = 64
	// fsBlockSize must equal the page size for ext4 encryption.
	fsBlockSize = 4096
)

// Fscrypt is a state disk in an ext4 image file, loop-mounted, with an fscrypt v2 encrypted
// directory as its plaintext tree. Its methods are safe for concurrent use.
type Fscrypt struct {
	image, mountpoint string
	size              int64
	run               Runner
	log               *zap.Logger
	mountinfo         string
	freeTimeout       time.Duration

	mu sync.Mutex
}

// FscryptOption configures NewFscrypt.
type FscryptOption func(*Fscrypt)

// WithImageSize sets the size Format gives a missing or empty image file (default
// DefaultImageSize). An existing non-empty image keeps its size.
func WithImageSize(bytes int64) FscryptOption {
	return func(f *Fscrypt) { f.size = bytes }
}

// NewFscrypt returns the state disk in the ext4 image file image, mounted at mountpoint.
func NewFscrypt(image, mountpoint string, run Runner, log *zap.Logger, opts ...FscryptOption) *Fscrypt {
	f := &Fscrypt{
		image:       image,
		mountpoint:  mountpoint,
		size:        DefaultImageSize,
		run:         run,
		log:         log,
		mountinfo:   "/proc/self/mountinfo",
		freeTimeout: imageFreeTimeout,
	}
	if f.log == nil {
		f.log = zap.NewNop()
	}
	for _, opt := range opts {
		opt(f)
	}
	return f
}

// fscryptHeader is the JSON header file at the file system's root.
type fscryptHeader struct {
	Version   string  `json:"version"`
	UUID      string  `json:"uuid"`
	ClusterID []byte  `json:"clusterID,omitempty"`
	Binding   []byte  `json:"binding,omitempty"`
	Sealed    []byte  `json:"sealed,omitempty"`
	MAC       []byte  `json:"mac,omitempty"`
	Keyslot   keyslot `json:"keyslot"`
}

func (h fscryptHeader) public() Header {
	return Header{UUID: h.UUID, ClusterID: h.ClusterID, Binding: h.Binding, Sealed: h.Sealed, MAC: h.MAC}
}

// Root implements Disk: the encrypted directory DataDir under the mount point.
func (f *Fscrypt) Root() string { return filepath.Join(f.mountpoint, DataDir) }

// Header implements Disk. It mounts the image for the read if it is not mounted.
func (f *Fscrypt) Header(ctx context.Context) (Header, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var h fscryptHeader
	err := f.withMount(ctx, func() error {
		var err error
		h, err = f.readHeader()
		return err
	})
	if err != nil {
		return Header{}, err
	}
	return h.public(), nil
}

// Format implements Disk. An image file is emptied first (truncated to zero and back to its
// size), so nothing of the old disk, not even its ciphertext or old keyslot, is left in it.
func (f *Fscrypt) Format(ctx context.Context, key []byte) (Header, error) {
	if err := checkKey(key); err != nil {
		return Header{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.closeLocked(ctx); err != nil {
		return Header{}, err
	}
	if err := f.waitImageFree(ctx); err != nil {
		return Header{}, err
	}
	if err := f.prepareImage(); err != nil {
		return Header{}, err
	}
	uuid, err := newUUID()
	if err != nil {
		return Header{}, err
	}
	if err := f.run.Run(ctx, Cmd{Name: "mkfs.ext4", Args: []string{
		"-q", "-F", "-O", "encrypt", "-b", fmt.Sprint(fsBlockSize), "-U", uuid, "-L", fsLabel, f.image,
	}}); err != nil {
		return Header{}, fmt.Errorf("formatting %s: %w", f.image, err)
	}
	if err := f.mount(ctx); err != nil {
		return Header{}, err
	}
	h, err := f.initialize(uuid, key)
	if err != nil {
		if cerr := f.closeLocked(ctx); cerr != nil {
			f.log.Error("closing state disk after failed format", zap.Error(cerr))
		}
		return Header{}, err
	}
	f.log.Info("state disk formatted", zap.String("uuid", uuid), zap.String("image", f.image))
	return h.public(), nil
}

const (
	// imageFreePoll and imageFreeTimeout bound the wait for the kernel to detach the loop device
	// of an unmounted image (autoclear runs asynchronously on recent kernels).
	imageFreePoll    = 10 * time.Millisecond
	imageFreeTimeout = 5 * time.Second
)

// waitImageFree waits until no loop device is backed by the image. One that stays means the file
// system is still mounted elsewhere (a bind mount of a directory of the disk): formatting under
// it would corrupt a live file system, so that is an error.
func (f *Fscrypt) waitImageFree(ctx context.Context) error {
	image, err := filepath.Abs(f.image)
	if err != nil {
		return fmt.Errorf("resolving %s: %w", f.image, err)
	}
	if real, err := filepath.EvalSymlinks(image); err == nil {
		image = real
	}
	free := func(context.Context) (bool, error) {
		files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
		if err != nil {
			return false, err
		}
		for _, file := range files {
			backing, err := os.ReadFile(file)
			if err == nil && strings.TrimSuffix(strings.TrimSpace(string(backing)), " (deleted)") == image {
				return false, nil
			}
		}
		return true, nil
	}
	if err := wait.PollUntilContextTimeout(ctx, imageFreePoll, f.freeTimeout, true, free); err != nil {
		return fmt.Errorf("waiting for %s to be unused (is the state disk still mounted elsewhere?): %w", f.image, err)
	}
	return nil
}

// prepareImage creates the image file or empties an existing one, keeping a non-zero size.
func (f *Fscrypt) prepareImage() error {
	st, err := os.Stat(f.image)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(filepath.Dir(f.image), 0o700); err != nil {
			return fmt.Errorf("creating directory of %s: %w", f.image, err)
		}
	case err != nil:
		return fmt.Errorf("checking %s: %w", f.image, err)
	case !st.Mode().IsRegular():
		return nil // a block device: mkfs.ext4 discards it
	}
	size := f.size
	if st != nil && st.Size() > 0 {
		size = st.Size()
	}
	file, err := os.OpenFile(f.image, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("creating %s: %w", f.image, err)
	}
	defer file.Close()
	if err := file.Truncate(0); err != nil {
		return fmt.Errorf("emptying %s: %w", f.image, err)
	}
	if err := file.Truncate(size); err != nil {
		return fmt.Errorf("sizing %s: %w", f.image, err)
	}
	if err := file.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", f.image, err)
	}
	return nil
}

// initialize sets up a freshly made and mounted file system: a random volume key, the encrypted
// data directory, and the header with the keyslot.
func (f *Fscrypt) initialize(uuid string, key []byte) (fscryptHeader, error) {
	volumeKey := make([]byte, volumeKeySize)
	defer clear(volumeKey)
	if _, err := rand.Read(volumeKey); err != nil {
		return fscryptHeader{}, fmt.Errorf("generating volume key: %w", err)
	}
	id, err := addKey(f.mountpoint, volumeKey)
	if err != nil {
		return fscryptHeader{}, err
	}
	if err := os.Mkdir(f.Root(), 0o755); err != nil {
		return fscryptHeader{}, fmt.Errorf("creating %s: %w", f.Root(), err)
	}
	if err := setPolicy(f.Root(), id); err != nil {
		return fscryptHeader{}, err
	}
	slot, err := wrapKey(key, volumeKey, uuid)
	if err != nil {
		return fscryptHeader{}, err
	}
	h := fscryptHeader{Version: headerVersion, UUID: uuid, Keyslot: slot}
	// The header is written last: a format cut short leaves no header, so the disk reads as not
	// formatted and is formatted again.
	if err := f.writeHeader(h); err != nil {
		return fscryptHeader{}, err
	}
	return h, nil
}

// Open implements Disk.
func (f *Fscrypt) Open(ctx context.Context, key []byte) error {
	if err := checkKey(key); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	wasMounted, err := f.mounted()
	if err != nil {
		return err
	}
	if !wasMounted {
		formatted, err := f.isExt4()
		if err != nil {
			return err
		}
		if !formatted {
			return ErrNotFormatted
		}
		if err := f.mount(ctx); err != nil {
			return err
		}
	}
	if err := f.unlock(key); err != nil {
		if !wasMounted {
			if uerr := f.unmount(ctx); uerr != nil {
				f.log.Error("unmounting state disk after failed open", zap.Error(uerr))
			}
		}
		return err
	}
	f.log.Info("state disk opened", zap.String("image", f.image))
	return nil
}

// unlock unwraps the volume key of the mounted file system with key and adds it to the kernel.
func (f *Fscrypt) unlock(key []byte) error {
	h, err := f.readHeader()
	if err != nil {
		return err
	}
	volumeKey, err := unwrapKey(key, h.Keyslot, h.UUID)
	if err != nil {
		return err
	}
	defer clear(volumeKey)
	want, err := policyKey(f.Root())
	if err != nil {
		return err
	}
	id, err := addKey(f.mountpoint, volumeKey)
	if err != nil {
		return err
	}
	if id != want {
		if _, err := removeKey(f.mountpoint, id); err != nil {
			f.log.Error("removing mismatched fscrypt key", zap.Error(err))
		}
		return fmt.Errorf("unlocking state disk: the keyslot's key is not the key of %s", DataDir)
	}
	return nil
}

// Rekey implements Disk: the keyslot is re-wrapped under newKey and the header replaced
// atomically; the volume key and so all data stay as they are, like luksChangeKey. Whoever kept
// the volume key (root on the running node) can still read the data: a re-key is not a re-encrypt.
func (f *Fscrypt) Rekey(ctx context.Context, oldKey, newKey []byte) error {
	if err := checkKey(oldKey); err != nil {
		return err
	}
	if err := checkKey(newKey); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.withMount(ctx, func() error {
		h, err := f.readHeader()
		if err != nil {
			return err
		}
		volumeKey, err := unwrapKey(oldKey, h.Keyslot, h.UUID)
		if err != nil {
			return err
		}
		defer clear(volumeKey)
		if h.Keyslot, err = wrapKey(newKey, volumeKey, h.UUID); err != nil {
			return err
		}
		if err := f.writeHeader(h); err != nil {
			return err
		}
		f.log.Info("state disk re-keyed", zap.String("uuid", h.UUID))
		return nil
	})
}

// SetBinding implements Disk.
func (f *Fscrypt) SetBinding(ctx context.Context, clusterID, binding []byte) error {
	return f.updateHeader(ctx, func(h *fscryptHeader) {
		h.ClusterID = bytes.Clone(clusterID)
		h.Binding = bytes.Clone(binding)
	})
}

// SetSealed implements Disk.
func (f *Fscrypt) SetSealed(ctx context.Context, blob []byte) error {
	return f.updateHeader(ctx, func(h *fscryptHeader) { h.Sealed = bytes.Clone(blob) })
}

// SetMAC implements Disk.
func (f *Fscrypt) SetMAC(ctx context.Context, mac []byte) error {
	return f.updateHeader(ctx, func(h *fscryptHeader) { h.MAC = bytes.Clone(mac) })
}

func (f *Fscrypt) updateHeader(ctx context.Context, update func(*fscryptHeader)) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.withMount(ctx, func() error {
		h, err := f.readHeader()
		if err != nil {
			return err
		}
		update(&h)
		return f.writeHeader(h)
	})
}

// Opened implements Disk: the image is mounted at the mount point and its key is present.
func (f *Fscrypt) Opened(context.Context) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	mounted, err := f.mounted()
	if err != nil || !mounted {
		return false, err
	}
	id, err := policyKey(f.Root())
	if err != nil {
		return false, err
	}
	return keyPresent(f.mountpoint, id)
}

// Close implements Disk: the key is removed from the kernel, then the image is unmounted (which
// also detaches the loop device). Closing a closed disk does nothing. Unmount the bind mounts of
// the disk's directories first: while they exist the file system stays mounted through them and
// the kernel forgets the key only once their files are closed.
func (f *Fscrypt) Close(ctx context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.closeLocked(ctx)
}

func (f *Fscrypt) closeLocked(ctx context.Context) error {
	mounted, err := f.mounted()
	if err != nil || !mounted {
		return err
	}
	id, err := policyKey(f.Root())
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// a format cut short before the data directory existed: no key to remove
	case err != nil:
		f.log.Warn("cannot read the state disk's key identifier", zap.Error(err))
	default:
		busy, err := removeKey(f.mountpoint, id)
		if err != nil {
			return fmt.Errorf("closing state disk: %w", err)
		}
		if busy {
			f.log.Warn("state disk files still open while removing its key")
		}
	}
	if err := f.unmount(ctx); err != nil {
		return err
	}
	f.log.Info("state disk closed", zap.String("image", f.image))
	return nil
}

// withMount runs fn with the image mounted, mounting it for fn alone if it was not mounted.
func (f *Fscrypt) withMount(ctx context.Context, fn func() error) error {
	mounted, err := f.mounted()
	if err != nil {
		return err
	}
	if mounted {
		return fn()
	}
	formatted, err := f.isExt4()
	if err != nil {
		return err
	}
	if !formatted {
		return ErrNotFormatted
	}
	if err := f.mount(ctx); err != nil {
		return err
	}
	ferr := fn()
	if err := f.unmount(ctx); err != nil {
		return errors.Join(ferr, err)
	}
	return ferr
}

// isExt4 reports whether the image holds an ext4 super block (magic 0xEF53 at byte 1024+0x38).
func (f *Fscrypt) isExt4() (bool, error) {
	file, err := os.Open(f.image)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("opening %s: %w", f.image, err)
	}
	defer file.Close()
	var magic [2]byte
	if _, err := file.ReadAt(magic[:], 1024+0x38); err != nil {
		if errors.Is(err, io.EOF) {
			return false, nil
		}
		return false, fmt.Errorf("reading %s: %w", f.image, err)
	}
	return binary.LittleEndian.Uint16(magic[:]) == 0xEF53, nil
}

func (f *Fscrypt) mount(ctx context.Context) error {
	if err := os.MkdirAll(f.mountpoint, 0o700); err != nil {
		return fmt.Errorf("creating %s: %w", f.mountpoint, err)
	}
	// -o loop sets up a loop device with autoclear: it goes away with the last unmount.
	if err := f.run.Run(ctx, Cmd{Name: "mount", Args: []string{"-t", "ext4", "-o", "loop", f.image, f.mountpoint}}); err != nil {
		return fmt.Errorf("mounting %s: %w", f.image, err)
	}
	return nil
}

func (f *Fscrypt) unmount(ctx context.Context) error {
	if err := f.run.Run(ctx, Cmd{Name: "umount", Args: []string{f.mountpoint}}); err != nil {
		return fmt.Errorf("unmounting %s: %w", f.mountpoint, err)
	}
	return nil
}

// mounted reports whether the image is mounted at the mount point. Another file system there is
// an error: the disk cannot be mounted over it safely.
func (f *Fscrypt) mounted() (bool, error) {
	entry, ok, err := mountAt(f.mountinfo, f.mountpoint)
	if err != nil || !ok {
		return false, err
	}
	backing, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", entry.Major, entry.Minor))
	if err != nil {
		return false, fmt.Errorf("checking mount at %s: %s is mounted there, not the state disk", f.mountpoint, entry.Source)
	}
	image, err := filepath.Abs(f.image)
	if err != nil {
		return false, fmt.Errorf("resolving %s: %w", f.image, err)
	}
	if real, err := filepath.EvalSymlinks(image); err == nil {
		image = real
	}
	if strings.TrimSuffix(strings.TrimSpace(string(backing)), " (deleted)") != image {
		return false, fmt.Errorf("checking mount at %s: %s is mounted there, not the state disk", f.mountpoint, entry.Source)
	}
	return true, nil
}

func (f *Fscrypt) headerPath() string { return filepath.Join(f.mountpoint, HeaderFile) }

func (f *Fscrypt) readHeader() (fscryptHeader, error) {
	data, err := os.ReadFile(f.headerPath())
	if errors.Is(err, fs.ErrNotExist) {
		return fscryptHeader{}, ErrNotFormatted
	}
	if err != nil {
		return fscryptHeader{}, fmt.Errorf("reading state disk header: %w", err)
	}
	var h fscryptHeader
	if err := json.Unmarshal(data, &h); err != nil {
		return fscryptHeader{}, fmt.Errorf("reading state disk header: %w", err)
	}
	if h.Version != headerVersion {
		return fscryptHeader{}, fmt.Errorf("reading state disk header: version %q, want %q", h.Version, headerVersion)
	}
	return h, nil
}

// writeHeader replaces the header file atomically (temporary file, fsync, rename, fsync of the
// directory).
func (f *Fscrypt) writeHeader(h fscryptHeader) error {
	data, err := json.MarshalIndent(h, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding state disk header: %w", err)
	}
	if err := atomicfile.Write(afero.NewOsFs(), f.headerPath(), append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("writing state disk header: %w", err)
	}
	dir, err := os.Open(f.mountpoint)
	if err != nil {
		return fmt.Errorf("syncing state disk header: %w", err)
	}
	defer dir.Close()
	if err := dir.Sync(); err != nil {
		return fmt.Errorf("syncing state disk header: %w", err)
	}
	return nil
}
