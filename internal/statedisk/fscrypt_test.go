package statedisk

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/prereq"
)

// testImageSize keeps the images the tests scan small; TestFscryptTimings uses the default size.
const testImageSize = 128 << 20

// requireFscrypt skips the test (fails it under CI=true) unless this machine can loop-mount an
// encrypted ext4 image.
func requireFscrypt(t testing.TB) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		missing = append(missing, "loop devices (/dev/loop-control)")
	}
	if _, err := os.Stat("/sys/fs/ext4/features/encryption"); err != nil {
		missing = append(missing, "ext4 encryption (/sys/fs/ext4/features/encryption)")
	}
	for _, prog := range []string{"mkfs.ext4", "mount", "umount", "losetup"} {
		if _, err := exec.LookPath(prog); err != nil {
			missing = append(missing, prog)
		}
	}
	if len(missing) == 0 {
		return
	}
	prereq.Missing(t, "the fscrypt state disk tests need %s", strings.Join(missing, ", "))
}

func randomKey(t testing.TB) []byte {
	t.Helper()
	k := make([]byte, KeySize)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

// newTestFscrypt returns a state disk on an image in a temporary directory. Cleanup closes it and
// then unmounts and detaches whatever is left, even when the test failed half-way.
func newTestFscrypt(t testing.TB, opts ...FscryptOption) *Fscrypt {
	t.Helper()
	requireFscrypt(t)
	dir := t.TempDir()
	image := filepath.Join(dir, "state.img")
	mountpoint := filepath.Join(dir, "mnt")
	log := zap.NewNop() // benchmarks: no log lines between the numbers
	if tt, ok := t.(*testing.T); ok {
		log = zaptest.NewLogger(tt)
	}
	d := NewFscrypt(image, mountpoint, Exec{}, log, append([]FscryptOption{WithImageSize(testImageSize)}, opts...)...)
	t.Cleanup(func() {
		ctx := context.Background()
		if err := d.Close(ctx); err != nil {
			t.Errorf("Close() in cleanup = %v", err)
		}
		for range 10 {
			if _, ok, _ := mountAt("/proc/self/mountinfo", mountpoint); !ok {
				break
			}
			_ = exec.Command("umount", "-l", mountpoint).Run()
		}
		for _, loop := range loopDevices(t, image) {
			_ = exec.Command("losetup", "-d", loop).Run()
		}
	})
	return d
}

// loopDevices returns the loop devices backed by image.
func loopDevices(t testing.TB, image string) []string {
	t.Helper()
	out, err := exec.Command("losetup", "--noheadings", "--output", "NAME", "--associated", image).Output()
	if err != nil {
		t.Fatalf("losetup -j %s: %v", image, err)
	}
	return strings.Fields(string(out))
}

// waitNoLoop waits until no loop device is backed by image (the kernel detaches an autoclear loop
// device when its last user goes, which may lag the unmount a little).
func waitNoLoop(t testing.TB, image string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 10*time.Second, true,
		func(context.Context) (bool, error) { return len(loopDevices(t, image)) == 0, nil })
	if err != nil {
		t.Fatalf("loop devices still attached to %s after Close: %v", image, loopDevices(t, image))
	}
}

func wantOpened(t testing.TB, d Disk, want bool) {
	t.Helper()
	got, err := d.Opened(context.Background())
	if err != nil {
		t.Fatalf("Opened() = %v", err)
	}
	if got != want {
		t.Fatalf("Opened() = %v, want %v", got, want)
	}
}

func readMarker(t testing.TB, d Disk, want string) {
	t.Helper()
	got, err := os.ReadFile(filepath.Join(d.Root(), "marker"))
	if err != nil {
		t.Fatalf("reading marker: %v", err)
	}
	if string(got) != want {
		t.Fatalf("marker = %q, want %q", got, want)
	}
}

func TestFscryptRoundTrip(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	k1, k2, k3 := randomKey(t), randomKey(t), randomKey(t)

	h, err := d.Format(ctx, k1)
	if err != nil {
		t.Fatalf("Format() = %v", err)
	}
	if len(h.UUID) != 36 || h.UUID != strings.ToLower(h.UUID) || h.ClusterID != nil || h.Binding != nil || h.Sealed != nil {
		t.Fatalf("Format() header = %+v", h)
	}
	wantOpened(t, d, true)
	if d.Root() != filepath.Join(d.mountpoint, DataDir) {
		t.Fatalf("Root() = %s", d.Root())
	}
	if err := os.WriteFile(filepath.Join(d.Root(), "marker"), []byte("round trip"), 0o600); err != nil {
		t.Fatal(err)
	}

	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	wantOpened(t, d, false)
	waitNoLoop(t, d.image)
	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() of a closed disk = %v", err)
	}
	if got, err := d.Header(ctx); err != nil || got.UUID != h.UUID {
		t.Fatalf("Header() while closed = %+v, %v; want UUID %s", got, err, h.UUID)
	}
	wantOpened(t, d, false) // Header mounts for the read and unmounts again

	if err := d.Open(ctx, k1); err != nil {
		t.Fatalf("Open() = %v", err)
	}
	wantOpened(t, d, true)
	readMarker(t, d, "round trip")
	if err := d.Open(ctx, k1); err != nil {
		t.Fatalf("Open() of an open disk = %v", err)
	}

	// Re-key while open, then check that only the new key opens it.
	if err := d.Rekey(ctx, k2, k3); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Rekey(wrong old key) = %v, want ErrWrongKey", err)
	}
	if err := d.Rekey(ctx, k1, k2); err != nil {
		t.Fatalf("Rekey() = %v", err)
	}
	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if err := d.Open(ctx, k1); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(key before rekey) = %v, want ErrWrongKey", err)
	}
	wantOpened(t, d, false)
	if err := d.Open(ctx, k2); err != nil {
		t.Fatalf("Open(new key) = %v", err)
	}
	readMarker(t, d, "round trip")
	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}

	// Re-key and header updates while closed mount only for the write.
	if err := d.Rekey(ctx, k2, k3); err != nil {
		t.Fatalf("Rekey() while closed = %v", err)
	}
	if err := d.SetBinding(ctx, []byte("cluster-id"), []byte("binding-mac")); err != nil {
		t.Fatalf("SetBinding() = %v", err)
	}
	if err := d.SetSealed(ctx, []byte("sealed-blob")); err != nil {
		t.Fatalf("SetSealed() = %v", err)
	}
	wantOpened(t, d, false)
	got, err := d.Header(ctx)
	if err != nil {
		t.Fatalf("Header() = %v", err)
	}
	if want := (Header{UUID: h.UUID, ClusterID: []byte("cluster-id"), Binding: []byte("binding-mac"), Sealed: []byte("sealed-blob")}); !headersEqual(got, want) {
		t.Fatalf("Header() = %+v, want %+v", got, want)
	}
	if err := d.Open(ctx, k3); err != nil {
		t.Fatalf("Open(k3) = %v", err)
	}
	readMarker(t, d, "round trip")
	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	waitNoLoop(t, d.image)
}

func headersEqual(a, b Header) bool {
	return a.UUID == b.UUID && bytes.Equal(a.ClusterID, b.ClusterID) && bytes.Equal(a.Binding, b.Binding) && bytes.Equal(a.Sealed, b.Sealed)
}

// TestFscryptWrongKey: a wrong key changes nothing, whether the disk was closed or open.
func TestFscryptWrongKey(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	key, wrong := randomKey(t), randomKey(t)
	h, err := d.Format(ctx, key)
	if err != nil {
		t.Fatalf("Format() = %v", err)
	}
	if err := os.WriteFile(filepath.Join(d.Root(), "marker"), []byte("still here"), 0o600); err != nil {
		t.Fatal(err)
	}

	// Open: the disk stays open, the data readable.
	if err := d.Open(ctx, wrong); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(wrong key) on an open disk = %v, want ErrWrongKey", err)
	}
	wantOpened(t, d, true)
	readMarker(t, d, "still here")

	// Closed: it stays closed and unmounted, the header as it was.
	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if err := d.Open(ctx, wrong); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(wrong key) = %v, want ErrWrongKey", err)
	}
	wantOpened(t, d, false)
	if _, ok, _ := mountAt("/proc/self/mountinfo", d.mountpoint); ok {
		t.Fatal("mount point still mounted after Open with a wrong key")
	}
	waitNoLoop(t, d.image)
	if err := d.Rekey(ctx, wrong, randomKey(t)); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Rekey(wrong key) = %v, want ErrWrongKey", err)
	}
	if err := d.Open(ctx, []byte("short")); err == nil || errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(5-byte key) = %v, want a key length error", err)
	}
	if got, err := d.Header(ctx); err != nil || !headersEqual(got, h) {
		t.Fatalf("Header() = %+v, %v; want %+v", got, err, h)
	}
	if err := d.Open(ctx, key); err != nil {
		t.Fatalf("Open(right key) after wrong keys = %v", err)
	}
	readMarker(t, d, "still here")
}

// TestFscryptCiphertext: what is written through Root() is in the image only encrypted, and no key
// is in the image or the header in any encoding. The control (a marker in the unencrypted root
// of the file system) shows that the scan finds what is there.
func TestFscryptCiphertext(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	key := randomKey(t)
	if _, err := d.Format(ctx, key); err != nil {
		t.Fatalf("Format() = %v", err)
	}
	marker := "berth-statedisk-marker-" + hex.EncodeToString(randomKey(t)[:8])
	control := "berth-statedisk-control-" + hex.EncodeToString(randomKey(t)[:8])
	secretName := "berth-secret-name-" + hex.EncodeToString(randomKey(t)[:8])
	if err := os.MkdirAll(filepath.Join(d.Root(), "etcd", "member"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.Root(), "etcd", "member", secretName), []byte(strings.Repeat(marker+"\n", 100)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.mountpoint, "control"), []byte(control), 0o600); err != nil {
		t.Fatal(err)
	}
	// Through the mount, the marker is there.
	got, err := os.ReadFile(filepath.Join(d.Root(), "etcd", "member", secretName))
	if err != nil || !strings.Contains(string(got), marker) {
		t.Fatalf("reading the marker through the mount = %v (%d bytes)", err, len(got))
	}
	header, err := os.ReadFile(d.headerPath())
	if err != nil {
		t.Fatal(err)
	}
	h, err := d.readHeader()
	if err != nil {
		t.Fatal(err)
	}
	volumeKey, err := unwrapKey(key, h.Keyslot, h.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	raw, err := os.ReadFile(d.image)
	if err != nil {
		t.Fatal(err)
	}

	if !containsAnyEncoding(raw, []byte(control)) {
		t.Fatal("control marker in the unencrypted root not found in the image: the scan is broken")
	}
	for name, secret := range map[string][]byte{
		"marker":     []byte(marker),
		"file name":  []byte(secretName),
		"slot key":   key,
		"volume key": volumeKey,
	} {
		if containsAnyEncoding(raw, secret) {
			t.Errorf("%s found in the raw image", name)
		}
	}
	for name, secret := range map[string][]byte{"slot key": key, "volume key": volumeKey} {
		if containsAnyEncoding(header, secret) {
			t.Errorf("%s found in the header file", name)
		}
	}
	if !bytes.Contains(header, []byte(h.UUID)) {
		t.Error("the header file does not hold the UUID: the header scan is broken")
	}
}

// TestContainsAnyEncoding shows the scanner finds each encoding at any alignment.
func TestContainsAnyEncoding(t *testing.T) {
	secret := []byte("0123456789abcdef-secret")
	for prefix := range 3 {
		pad := bytes.Repeat([]byte{'x'}, prefix)
		for name, enc := range map[string][]byte{
			"raw":    secret,
			"hex":    []byte(hex.EncodeToString(secret)),
			"HEX":    []byte(strings.ToUpper(hex.EncodeToString(secret))),
			"base64": []byte(base64.StdEncoding.EncodeToString(append(pad, secret...))),
			"url":    []byte(base64.RawURLEncoding.EncodeToString(append(pad, secret...))),
		} {
			if !containsAnyEncoding(append([]byte("junk"), enc...), secret) {
				t.Errorf("%s (prefix %d) not found", name, prefix)
			}
		}
	}
	if containsAnyEncoding([]byte("nothing to see"), secret) {
		t.Error("found a secret that is not there")
	}
}

// containsAnyEncoding reports whether data holds secret raw, in hex (either case) or in base64
// (standard or URL alphabet) at any of the three alignments.
func containsAnyEncoding(data, secret []byte) bool {
	needles := [][]byte{secret, []byte(hex.EncodeToString(secret)), []byte(strings.ToUpper(hex.EncodeToString(secret)))}
	for prefix := range 3 {
		padded := append(make([]byte, prefix), secret...)
		for _, enc := range []*base64.Encoding{base64.RawStdEncoding, base64.RawURLEncoding} {
			s := enc.EncodeToString(padded)
			// Drop the characters that depend on the bytes before and after the secret.
			start := (prefix*8 + 5) / 6
			end := len(padded) * 8 / 6
			needles = append(needles, []byte(s[start:end]))
		}
	}
	for _, n := range needles {
		if bytes.Contains(data, n) {
			return true
		}
	}
	return false
}

// TestFscryptFormatWipes: formatting a disk again gives it a new UUID, and nothing of the old one
// is left: its data is gone and its key no longer opens it.
func TestFscryptFormatWipes(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	oldKey, newKey := randomKey(t), randomKey(t)
	old, err := d.Format(ctx, oldKey)
	if err != nil {
		t.Fatalf("Format() = %v", err)
	}
	if err := d.SetBinding(ctx, []byte("cluster"), []byte("binding")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.Root(), "marker"), []byte("old disk"), 0o600); err != nil {
		t.Fatal(err)
	}
	h, err := d.Format(ctx, newKey) // while open
	if err != nil {
		t.Fatalf("Format() again = %v", err)
	}
	if h.UUID == old.UUID || h.ClusterID != nil || h.Binding != nil {
		t.Fatalf("Format() again = %+v, old %+v", h, old)
	}
	if _, err := os.Stat(filepath.Join(d.Root(), "marker")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("old marker after Format: %v", err)
	}
	if st, err := os.Stat(d.image); err != nil || st.Size() != testImageSize {
		t.Fatalf("image after Format: %v, %v; want size %d kept", st, err, testImageSize)
	}
	if err := d.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := d.Open(ctx, oldKey); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(old key) after Format = %v, want ErrWrongKey", err)
	}
	if err := d.Open(ctx, newKey); err != nil {
		t.Fatalf("Open(new key) = %v", err)
	}
}

func TestFscryptNotFormatted(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	key := randomKey(t)
	if _, err := d.Header(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() without an image = %v, want ErrNotFormatted", err)
	}
	if err := os.WriteFile(d.image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.Open(ctx, key); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Open() on an empty image = %v, want ErrNotFormatted", err)
	}
	if err := os.Truncate(d.image, 16<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Header(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() on a blank image = %v, want ErrNotFormatted", err)
	}
	// An ext4 file system without the header (a format cut short) is not formatted either.
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-O", "encrypt", d.image).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	if _, err := d.Header(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() without a header file = %v, want ErrNotFormatted", err)
	}
	if err := d.Open(ctx, key); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Open() without a header file = %v, want ErrNotFormatted", err)
	}
	wantOpened(t, d, false)
	if _, err := d.Format(ctx, key); err != nil {
		t.Fatalf("Format() = %v", err)
	}
	if st, err := os.Stat(d.image); err != nil || st.Size() != 16<<20 {
		t.Fatalf("image after Format: %v, %v; want its size kept", st, err)
	}
}

// TestFscryptOccupiedMountpoint: another file system at the mount point is an error, never
// mounted over or taken for the state disk.
func TestFscryptOccupiedMountpoint(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	if err := os.MkdirAll(d.mountpoint, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d.mountpoint).CombinedOutput(); err != nil {
		t.Fatalf("mounting tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", d.mountpoint).Run() })
	if _, err := d.Opened(ctx); err == nil {
		t.Fatal("Opened() with a tmpfs at the mount point = nil error")
	}
	if _, err := d.Format(ctx, randomKey(t)); err == nil {
		t.Fatal("Format() with a tmpfs at the mount point = nil error")
	}
	if err := exec.Command("umount", d.mountpoint).Run(); err != nil {
		t.Fatal(err)
	}
}

// TestFscryptTimings prints how long the operations take on a default-size image (run with -v).
func TestFscryptTimings(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t, WithImageSize(DefaultImageSize))
	k1, k2 := randomKey(t), randomKey(t)
	timed := func(name string, fn func() error) {
		t.Helper()
		start := time.Now()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%-22s %v", name, time.Since(start).Round(100*time.Microsecond))
	}
	timed("Format (2 GiB image)", func() error { _, err := d.Format(ctx, k1); return err })
	timed("Close", func() error { return d.Close(ctx) })
	timed("Header (closed)", func() error { _, err := d.Header(ctx); return err })
	timed("Open", func() error { return d.Open(ctx, k1) })
	timed("Opened", func() error { _, err := d.Opened(ctx); return err })
	timed("Rekey (open)", func() error { return d.Rekey(ctx, k1, k2) })
	timed("Close", func() error { return d.Close(ctx) })
	timed("Rekey (closed)", func() error { return d.Rekey(ctx, k2, k1) })
	timed("Open with wrong key", func() error {
		if err := d.Open(ctx, k2); !errors.Is(err, ErrWrongKey) {
			return err
		}
		return nil
	})
}

// TestFscryptFormatRefusesLiveFileSystem: while a directory of the disk is still bind-mounted
// elsewhere, Format fails instead of formatting the image under a live file system.
func TestFscryptFormatRefusesLiveFileSystem(t *testing.T) {
	ctx := context.Background()
	d := newTestFscrypt(t)
	d.freeTimeout = 300 * time.Millisecond
	key := randomKey(t)
	if _, err := d.Format(ctx, key); err != nil {
		t.Fatalf("Format() = %v", err)
	}
	dir := filepath.Join(d.Root(), "kubelet")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "marker"), []byte("live"), 0o600); err != nil {
		t.Fatal(err)
	}
	bind := filepath.Join(t.TempDir(), "var-lib-kubelet")
	if err := os.Mkdir(bind, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "--bind", dir, bind).CombinedOutput(); err != nil {
		t.Fatalf("mount --bind: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", bind).Run() })
	if _, err := d.Format(ctx, randomKey(t)); err == nil {
		t.Fatal("Format() with a bind mount of the disk still in place = nil")
	}
	// Format closed the disk first: the key is gone, even for the bind mount.
	if _, err := os.ReadFile(filepath.Join(bind, "marker")); !errors.Is(err, unix.ENOKEY) {
		t.Fatalf("reading through the bind mount after Close = %v, want ENOKEY", err)
	}
	if out, err := exec.Command("umount", bind).CombinedOutput(); err != nil {
		t.Fatalf("umount %s: %v: %s", bind, err, out)
	}
	if err := d.Open(ctx, key); err != nil {
		t.Fatalf("Open() after the refused Format = %v", err)
	}
	if got, err := os.ReadFile(filepath.Join(dir, "marker")); err != nil || string(got) != "live" {
		t.Fatalf("marker after the refused Format = %q, %v", got, err)
	}
}
