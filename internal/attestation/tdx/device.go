package tdx

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/afero"
)

// Device is one TD guest's attestation interface.
type Device interface {
	// Quote returns a TDX quote whose REPORTDATA is reportData.
	Quote(ctx context.Context, reportData [ReportDataSize]byte) ([]byte, error)
	// ExtendRTMR extends RTMR[index] (0..3) with SHA-384(data).
	ExtendRTMR(ctx context.Context, index int, data []byte) error
	// Measurements returns MRTD and RTMR0..3, in that order.
	Measurements(ctx context.Context) ([5][MeasurementSize]byte, error)
	// Close releases the device.
	Close() error
}

// OpenFunc opens the TD guest's attestation device. The issuer and the lock register open it per use.
type OpenFunc func() (Device, error)

// ErrNoDevice: neither a configfs-tsm report directory nor a legacy TDX guest device exists on this machine.
var ErrNoDevice = errors.New("no TDX guest attestation interface found")

// Well-known locations of the TD guest interfaces.
const (
	// LegacyGuestDevice is the pre-upstream guest device with the quote and RTMR-extend ioctls.
	LegacyGuestDevice = "/dev/tdx-guest"
	// TSMReportDir is the configfs-tsm report directory of mainline kernels (6.7 and later).
	TSMReportDir = "/sys/kernel/config/tsm/report"
	// MeasurementsDir exposes MRTD and RTMR0..3 on mainline kernels from 6.16 on; writing a 48-byte digest to an
	// RTMR file extends that RTMR.
	MeasurementsDir = "/sys/class/misc/tdx_guest/measurements"
)

// rtmrIndexError checks an RTMR index.
func checkRTMRIndex(index int) error {
	if index < 0 || index > 3 {
		return fmt.Errorf("RTMR index %d out of range 0..3", index)
	}
	return nil
}

// OpenAuto returns an OpenFunc that prefers configfs-tsm (mainline kernels) and falls back to the legacy device.
// The choice is made at each open, on the real filesystem.
func OpenAuto() OpenFunc {
	return OpenAutoUnder("/")
}

// OpenAutoUnder is OpenAuto with the guest interfaces looked up under root instead of "/":
// root/sys/kernel/config/tsm/report, root/sys/class/misc/tdx_guest/measurements and root/dev/tdx-guest. A
// container that has the host's configfs mounted elsewhere than /sys/kernel/config uses it (the joinservice's pod
// mounts it outside /sys, where container runtimes' default AppArmor profile denies writes; see
// internal/berthsystem), and so do tests that serve a software TD's configfs-tsm under a temporary root.
func OpenAutoUnder(root string) OpenFunc {
	tsmDir := filepath.Join(root, TSMReportDir)
	mrDir := filepath.Join(root, MeasurementsDir)
	legacy := filepath.Join(root, LegacyGuestDevice)
	return func() (Device, error) {
		fs := afero.NewOsFs()
		if ok, _ := afero.DirExists(fs, tsmDir); ok {
			return OpenTSM(fs, tsmDir, mrDir)()
		}
		if _, err := os.Stat(legacy); err == nil {
			return OpenLegacy(legacy)()
		}
		return nil, fmt.Errorf("looking under %s for %s and %s: %w", root, TSMReportDir, LegacyGuestDevice, ErrNoDevice)
	}
}
