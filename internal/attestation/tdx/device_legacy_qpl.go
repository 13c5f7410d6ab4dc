//go:build berth_qpl

package tdx

import (
	"os"

	qpltdx "github.com/edgelesssys/go-tdx-qpl/tdx"
)

// go-tdx-qpl is licensed AGPL-3.0, so it is linked only into a build that opts in with the tag berth_qpl;
// without it the legacy backend is absent (device_legacy_noqpl.go). configfs-tsm and verification do not
// depend on it.

// qplOps calls go-tdx-qpl's ioctl wrappers (quote through the QGS envelope ioctl, RTMR extend with SHA-384 of
// the data, measurements from a TD report with zero report data).
var qplOps = legacyOps{
	quote:   func(dev fdDevice, reportData []byte) ([]byte, error) { return qpltdx.GenerateQuote(dev, reportData) },
	extend:  func(dev fdDevice, data []byte, index uint8) error { return qpltdx.ExtendRTMR(dev, data, index) },
	measure: func(dev fdDevice) ([5][48]byte, error) { return qpltdx.ReadMeasurements(dev) },
}

// OpenLegacy returns an OpenFunc for the legacy guest device at path (normally LegacyGuestDevice).
func OpenLegacy(path string) OpenFunc {
	return openLegacyWith(func() (fdDevice, error) { return os.OpenFile(path, os.O_RDWR, 0) }, qplOps)
}
