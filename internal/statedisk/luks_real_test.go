//go:build luks

package statedisk

// The LUKS2 backend against real cryptsetup, dm-crypt and dm-integrity on a loop device. It needs
// a kernel with device-mapper (the OS image under QEMU, not the mini cluster's hosts), so it is
// behind the build tag "luks"; scripts/test-luks.sh runs it. Once built, it never skips: a missing
// prerequisite fails it.

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

func requireLUKS(t *testing.T) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	for _, prog := range []string{"cryptsetup", "losetup", "mkfs.ext4", "mount", "umount"} {
		if _, err := exec.LookPath(prog); err != nil {
			missing = append(missing, prog)
		}
	}
	if _, err := os.Stat("/dev/mapper/control"); err != nil {
		missing = append(missing, "device-mapper (/dev/mapper/control)")
	}
	if len(missing) > 0 {
		t.Fatalf("the real LUKS2 test needs %s", strings.Join(missing, ", "))
	}
}

// newTestLUKS returns a LUKS state disk on a fresh loop device. Cleanup closes it and detaches
// the loop device even when the test failed half-way.
func newTestLUKS(t *testing.T) (*LUKS, string) {
	t.Helper()
	requireLUKS(t)
	dir := t.TempDir()
	backing := filepath.Join(dir, "state.img")
	if err := os.WriteFile(backing, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(backing, 96<<20); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", backing).Output()
	if err != nil {
		t.Fatalf("losetup: %v", err)
	}
	loop := strings.TrimSpace(string(out))
	name := "berth-test-" + filepath.Base(loop)
	l := NewLUKS(loop, name, filepath.Join(dir, "mnt"), Exec{}, zaptest.NewLogger(t))
	t.Cleanup(func() {
		if err := l.Close(context.Background()); err != nil {
			t.Errorf("Close() in cleanup = %v", err)
			_ = exec.Command("umount", "-l", l.mountpoint).Run()
			_ = exec.Command("cryptsetup", "close", name).Run()
		}
		if err := exec.Command("losetup", "-d", loop).Run(); err != nil {
			t.Errorf("losetup -d %s: %v", loop, err)
		}
	})
	return l, backing
}

func TestLUKSReal(t *testing.T) {
	ctx := context.Background()
	l, backing := newTestLUKS(t)
	k1, k2, k3 := randomKey(t), randomKey(t), randomKey(t)
	timed := func(name string, fn func() error) error {
		start := time.Now()
		err := fn()
		t.Logf("%-22s %v", name, time.Since(start).Round(100*time.Microsecond))
		return err
	}

	if _, err := l.Header(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() of a blank device = %v, want ErrNotFormatted", err)
	}
	var h Header
	if err := timed("Format (96 MiB)", func() (err error) { h, err = l.Format(ctx, k1); return err }); err != nil {
		t.Fatalf("Format() = %v", err)
	}
	wantOpened(t, l, true)
	marker := "berth-luks-marker-" + h.UUID
	if err := os.WriteFile(filepath.Join(l.Root(), "marker"), []byte(marker), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	wantOpened(t, l, false)
	if got, err := l.Header(ctx); err != nil || got.UUID != h.UUID {
		t.Fatalf("Header() = %+v, %v; want UUID %s", got, err, h.UUID)
	}
	if out, err := exec.Command("cryptsetup", "luksUUID", l.device).Output(); err != nil || strings.TrimSpace(string(out)) != h.UUID {
		t.Fatalf("cryptsetup luksUUID = %q, %v; want %s", out, err, h.UUID)
	}
	raw, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if !containsAnyEncoding(raw, []byte(h.UUID)) {
		t.Fatal("the UUID (in the LUKS header) is not found in the backing file: the scan is broken")
	}
	for name, secret := range map[string][]byte{"marker": []byte(marker), "key": k1} {
		if containsAnyEncoding(raw, secret) {
			t.Errorf("%s found in the backing file", name)
		}
	}

	if err := l.Open(ctx, k2); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(wrong key) = %v, want ErrWrongKey", err)
	}
	wantOpened(t, l, false)
	if err := timed("Open", func() error { return l.Open(ctx, k1) }); err != nil {
		t.Fatalf("Open() = %v", err)
	}
	readMarker(t, l, marker)
	if err := l.Rekey(ctx, k3, k2); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Rekey(wrong old key) = %v, want ErrWrongKey", err)
	}
	if err := timed("Rekey", func() error { return l.Rekey(ctx, k1, k2) }); err != nil {
		t.Fatalf("Rekey() = %v", err)
	}
	if err := l.SetBinding(ctx, []byte("cluster"), []byte("binding")); err != nil {
		t.Fatalf("SetBinding() = %v", err)
	}
	if err := l.SetSealed(ctx, []byte("sealed")); err != nil {
		t.Fatalf("SetSealed() = %v", err)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if err := l.Open(ctx, k1); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(key before rekey) = %v, want ErrWrongKey", err)
	}
	if err := l.Open(ctx, k2); err != nil {
		t.Fatalf("Open(new key) = %v", err)
	}
	readMarker(t, l, marker)
	got, err := l.Header(ctx)
	if want := (Header{UUID: h.UUID, ClusterID: []byte("cluster"), Binding: []byte("binding"), Sealed: []byte("sealed")}); err != nil || !headersEqual(got, want) {
		t.Fatalf("Header() = %+v, %v; want %+v", got, err, want)
	}

	// Format again, while open: a new UUID, the old data and key gone.
	h2, err := l.Format(ctx, k3)
	if err != nil {
		t.Fatalf("Format() again = %v", err)
	}
	if h2.UUID == h.UUID {
		t.Fatal("Format() again kept the UUID")
	}
	if _, err := os.Stat(filepath.Join(l.Root(), "marker")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("old marker after Format: %v", err)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Open(ctx, k2); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(old key) after Format = %v, want ErrWrongKey", err)
	}
}
