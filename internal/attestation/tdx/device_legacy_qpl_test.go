//go:build berth_qpl

package tdx

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestLegacyDeviceRealIoctl runs go-tdx-qpl's real ioctls on a file that is not a TDX guest device: each must
// fail cleanly, not crash. This is as far as the legacy ABI can be exercised without TDX hardware.
func TestLegacyDeviceRealIoctl(t *testing.T) {
	name := filepath.Join(t.TempDir(), "not-a-tdx-guest")
	if err := os.WriteFile(name, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	dev, err := OpenLegacy(name)()
	if err != nil {
		t.Fatalf("OpenLegacy() = %v", err)
	}
	defer dev.Close()
	ctx := context.Background()
	if _, err := dev.Quote(ctx, [64]byte{}); !errors.Is(err, syscall.ENOTTY) {
		t.Errorf("Quote() on a regular file = %v, want ENOTTY", err)
	}
	if err := dev.ExtendRTMR(ctx, 3, []byte("x")); !errors.Is(err, syscall.ENOTTY) {
		t.Errorf("ExtendRTMR() on a regular file = %v, want ENOTTY", err)
	}
	if _, err := dev.Measurements(ctx); !errors.Is(err, syscall.ENOTTY) {
		t.Errorf("Measurements() on a regular file = %v, want ENOTTY", err)
	}
	if _, err := OpenLegacy(filepath.Join(t.TempDir(), "missing"))(); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("OpenLegacy(missing) = %v, want not exist", err)
	}
}
