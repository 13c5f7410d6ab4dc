package statedisk

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"

	"go.uber.org/zap"
)

const (
	// luksTokenID is the LUKS2 token slot that holds the header.
	luksTokenID = "0"
	// LUKSTokenType is the type of the LUKS2 token that holds the header.
	LUKSTokenType = "berth-state"
	// cryptsetupWrongKey is cryptsetup's exit status for "no key available with this passphrase".
	cryptsetupWrongKey = 2
)

// luksPBKDF are cryptsetup's key-derivation options for a keyslot. A slot key is 32 random bytes:
// key stretching would cost seconds (and Argon2's memory) and add nothing.
var luksPBKDF = []string{"--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"}

// LUKS is a state disk on a block device formatted as LUKS2 with dm-integrity (hmac-sha256), ext4
// on the mapper device. Its methods are safe for concurrent use.
type LUKS struct {
	device, name, mountpoint string
	run                      Runner
	log                      *zap.Logger
	mountinfo                string

	mu sync.Mutex
}

// NewLUKS returns the state disk on device, opened as /dev/mapper/mapperName and mounted at
// mountpoint.
func NewLUKS(device, mapperName, mountpoint string, run Runner, log *zap.Logger) *LUKS {
	if log == nil {
		log = zap.NewNop()
	}
	return &LUKS{
		device:     device,
		name:       mapperName,
		mountpoint: mountpoint,
		run:        run,
		log:        log,
		mountinfo:  "/proc/self/mountinfo",
	}
}

// luksToken is the LUKS2 token that holds the header. cryptsetup requires "type" and
// "keyslots"; the rest is ours.
type luksToken struct {
	Type      string   `json:"type"`
	Keyslots  []string `json:"keyslots"`
	Version   string   `json:"berth_version"`
	UUID      string   `json:"uuid"`
	ClusterID []byte   `json:"cluster_id,omitempty"`
	Binding   []byte   `json:"binding,omitempty"`
	Sealed    []byte   `json:"sealed,omitempty"`
	MAC       []byte   `json:"mac,omitempty"`
}

func (l *LUKS) mapperPath() string { return "/dev/mapper/" + l.name }

// Root implements Disk: the mount point.
func (l *LUKS) Root() string { return l.mountpoint }

// Header implements Disk.
func (l *LUKS) Header(ctx context.Context) (Header, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, err := l.readToken(ctx)
	if err != nil {
		return Header{}, err
	}
	return Header{UUID: t.UUID, ClusterID: t.ClusterID, Binding: t.Binding, Sealed: t.Sealed, MAC: t.MAC}, nil
}

// Format implements Disk: luksFormat (which also wipes the integrity tags, so it takes as long as
// writing the device once), the header token, open, mkfs.ext4, mount.
func (l *LUKS) Format(ctx context.Context, key []byte) (Header, error) {
	if err := checkKey(key); err != nil {
		return Header{}, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.closeLocked(ctx); err != nil {
		return Header{}, err
	}
	uuid, err := newUUID()
	if err != nil {
		return Header{}, err
	}
	args := []string{
		"luksFormat", "--batch-mode", "--type", "luks2",
		"--cipher", "aes-xts-plain64", "--integrity", "hmac-sha256", "--sector-size", "4096",
	}
	args = append(args, luksPBKDF...)
	args = append(args, "--uuid", uuid, "--label", fsLabel, "--key-file", "-", l.device)
	if err := l.run.Run(ctx, Cmd{Name: "cryptsetup", Args: args, Stdin: key}); err != nil {
		return Header{}, fmt.Errorf("formatting %s: %w", l.device, err)
	}
	t := luksToken{Type: LUKSTokenType, Keyslots: []string{}, Version: headerVersion, UUID: uuid}
	if err := l.writeToken(ctx, t, false); err != nil {
		return Header{}, err
	}
	if err := l.activate(ctx, key); err != nil {
		return Header{}, err
	}
	if err := l.run.Run(ctx, Cmd{Name: "mkfs.ext4", Args: []string{"-q", "-F", "-L", fsLabel, l.mapperPath()}}); err != nil {
		l.closeAfterFailure(ctx)
		return Header{}, fmt.Errorf("creating file system on %s: %w", l.mapperPath(), err)
	}
	if err := l.mount(ctx); err != nil {
		l.closeAfterFailure(ctx)
		return Header{}, err
	}
	l.log.Info("state disk formatted", zap.String("uuid", uuid), zap.String("device", l.device))
	return Header{UUID: uuid}, nil
}

// Open implements Disk. If the mapper device is already active, the key is still checked
// (cryptsetup --test-passphrase) before the disk is mounted.
func (l *LUKS) Open(ctx context.Context, key []byte) error {
	if err := checkKey(key); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.readToken(ctx); err != nil {
		return err
	}
	active, err := l.active(ctx)
	if err != nil {
		return err
	}
	if active {
		err = l.luksKeyCheck(ctx, Cmd{Name: "cryptsetup", Args: []string{
			"open", "--test-passphrase", "--type", "luks2", "--key-file", "-", l.device,
		}, Stdin: key})
	} else {
		err = l.activate(ctx, key)
	}
	if err != nil {
		return err
	}
	mounted, err := l.mounted()
	if err != nil {
		return err
	}
	if !mounted {
		if err := l.mount(ctx); err != nil {
			if !active {
				l.closeAfterFailure(ctx)
			}
			return err
		}
	}
	l.log.Info("state disk opened", zap.String("device", l.device))
	return nil
}

// Rekey implements Disk with luksChangeKey: the old key through /dev/fd/3, the new one on standard
// input, both pipes. The volume key and the data stay as they are.
func (l *LUKS) Rekey(ctx context.Context, oldKey, newKey []byte) error {
	if err := checkKey(oldKey); err != nil {
		return err
	}
	if err := checkKey(newKey); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	args := []string{"luksChangeKey", "--batch-mode", "--type", "luks2"}
	args = append(args, luksPBKDF...)
	args = append(args, "--key-file", "/dev/fd/3", l.device, "-")
	if err := l.luksKeyCheck(ctx, Cmd{Name: "cryptsetup", Args: args, Stdin: newKey, Files: [][]byte{oldKey}}); err != nil {
		return err
	}
	l.log.Info("state disk re-keyed", zap.String("device", l.device))
	return nil
}

// SetBinding implements Disk (token import --token-replace: one header write).
func (l *LUKS) SetBinding(ctx context.Context, clusterID, binding []byte) error {
	return l.updateToken(ctx, func(t *luksToken) {
		t.ClusterID = bytes.Clone(clusterID)
		t.Binding = bytes.Clone(binding)
	})
}

// SetSealed implements Disk.
func (l *LUKS) SetSealed(ctx context.Context, blob []byte) error {
	return l.updateToken(ctx, func(t *luksToken) { t.Sealed = bytes.Clone(blob) })
}

// SetMAC implements Disk.
func (l *LUKS) SetMAC(ctx context.Context, mac []byte) error {
	return l.updateToken(ctx, func(t *luksToken) { t.MAC = bytes.Clone(mac) })
}

func (l *LUKS) updateToken(ctx context.Context, update func(*luksToken)) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, err := l.readToken(ctx)
	if err != nil {
		return err
	}
	update(&t)
	return l.writeToken(ctx, t, true)
}

// Opened implements Disk: the mapper device is active and mounted at the mount point.
func (l *LUKS) Opened(ctx context.Context) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	active, err := l.active(ctx)
	if err != nil || !active {
		return false, err
	}
	return l.mounted()
}

// Close implements Disk: unmount, then luksClose (which wipes the volume key from the kernel).
// Unmount the bind mounts of the disk's directories first: luksClose fails while they hold the
// mapper device.
func (l *LUKS) Close(ctx context.Context) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closeLocked(ctx)
}

func (l *LUKS) closeLocked(ctx context.Context) error {
	mounted, err := l.mounted()
	if err != nil {
		return err
	}
	if mounted {
		if err := l.run.Run(ctx, Cmd{Name: "umount", Args: []string{l.mountpoint}}); err != nil {
			return fmt.Errorf("unmounting %s: %w", l.mountpoint, err)
		}
	}
	active, err := l.active(ctx)
	if err != nil || !active {
		return err
	}
	if err := l.run.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"close", l.name}}); err != nil {
		return fmt.Errorf("closing %s: %w", l.mapperPath(), err)
	}
	l.log.Info("state disk closed", zap.String("device", l.device))
	return nil
}

func (l *LUKS) closeAfterFailure(ctx context.Context) {
	if err := l.closeLocked(ctx); err != nil {
		l.log.Error("closing state disk after a failure", zap.Error(err))
	}
}

// activate opens the LUKS device as the mapper device.
func (l *LUKS) activate(ctx context.Context, key []byte) error {
	return l.luksKeyCheck(ctx, Cmd{Name: "cryptsetup", Args: []string{
		"open", "--type", "luks2", "--key-file", "-", l.device, l.name,
	}, Stdin: key})
}

// luksKeyCheck runs a cryptsetup command that takes a key and maps its "no key available" exit
// status to ErrWrongKey.
func (l *LUKS) luksKeyCheck(ctx context.Context, cmd Cmd) error {
	err := l.run.Run(ctx, cmd)
	switch {
	case err == nil:
		return nil
	case exitCode(err) == cryptsetupWrongKey:
		return ErrWrongKey
	default:
		return fmt.Errorf("running cryptsetup %s on %s: %w", cmd.Args[0], l.device, err)
	}
}

// active reports whether the mapper device exists (cryptsetup status exits 0 only then).
func (l *LUKS) active(ctx context.Context) (bool, error) {
	err := l.run.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"status", l.name}, Stdout: &bytes.Buffer{}})
	if err == nil {
		return true, nil
	}
	if exitCode(err) > 0 {
		return false, nil
	}
	return false, fmt.Errorf("checking %s: %w", l.mapperPath(), err)
}

// mounted reports whether the mapper device is mounted at the mount point. Another file system
// there is an error.
func (l *LUKS) mounted() (bool, error) {
	entry, ok, err := mountAt(l.mountinfo, l.mountpoint)
	if err != nil || !ok {
		return false, err
	}
	if entry.Source != l.mapperPath() {
		if name, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/dm/name", entry.Major, entry.Minor)); err != nil || string(bytes.TrimSpace(name)) != l.name {
			return false, fmt.Errorf("checking mount at %s: %s is mounted there, not the state disk", l.mountpoint, entry.Source)
		}
	}
	return true, nil
}

func (l *LUKS) mount(ctx context.Context) error {
	if err := os.MkdirAll(l.mountpoint, 0o700); err != nil {
		return fmt.Errorf("creating %s: %w", l.mountpoint, err)
	}
	if err := l.run.Run(ctx, Cmd{Name: "mount", Args: []string{"-t", "ext4", l.mapperPath(), l.mountpoint}}); err != nil {
		return fmt.Errorf("mounting %s: %w", l.mapperPath(), err)
	}
	return nil
}

// readToken returns the header token; ErrNotFormatted if the device is not LUKS2 or has no token
// (a format cut short).
func (l *LUKS) readToken(ctx context.Context) (luksToken, error) {
	// Only exit status 1 means "not LUKS2"; 4 and 5 are device errors, which must never make a
	// bound disk look blank (Format would wipe it).
	err := l.run.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"isLuks", "--type", "luks2", l.device}})
	if exitCode(err) == 1 {
		return luksToken{}, ErrNotFormatted
	}
	if err != nil {
		return luksToken{}, fmt.Errorf("checking %s: %w", l.device, err)
	}
	var out bytes.Buffer
	err = l.run.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"token", "export", "--token-id", luksTokenID, l.device}, Stdout: &out})
	if exitCode(err) == 1 {
		return luksToken{}, ErrNotFormatted
	}
	if err != nil {
		return luksToken{}, fmt.Errorf("reading state disk header: %w", err)
	}
	var t luksToken
	if err := json.Unmarshal(out.Bytes(), &t); err != nil {
		return luksToken{}, fmt.Errorf("reading state disk header: %w", err)
	}
	if t.Type != LUKSTokenType || t.Version != headerVersion {
		return luksToken{}, fmt.Errorf("reading state disk header: token %s is %q version %q, want %q version %q",
			luksTokenID, t.Type, t.Version, LUKSTokenType, headerVersion)
	}
	return t, nil
}

// writeToken imports the header token (replacing the old one in one header write if replace).
func (l *LUKS) writeToken(ctx context.Context, t luksToken, replace bool) error {
	data, err := json.Marshal(t)
	if err != nil {
		return fmt.Errorf("encoding state disk header: %w", err)
	}
	args := []string{"token", "import", "--token-id", luksTokenID, "--json-file", "-"}
	if replace {
		args = append(args, "--token-replace")
	}
	if err := l.run.Run(ctx, Cmd{Name: "cryptsetup", Args: append(args, l.device), Stdin: data}); err != nil {
		return fmt.Errorf("writing state disk header: %w", err)
	}
	return nil
}
