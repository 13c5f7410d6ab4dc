//go:build berth_noqpl

package tdx

import "fmt"

// OpenLegacy is unavailable in builds without go-tdx-qpl (build tag berth_noqpl).
func OpenLegacy(path string) OpenFunc {
	return func() (Device, error) {
		return nil, fmt.Errorf("opening %s: legacy TDX guest device support not built in (berth_noqpl): %w", path, ErrNoDevice)
	}
}
