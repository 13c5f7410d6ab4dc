//go:build !berth_qpl

package tdx

import "fmt"

// OpenLegacy is unavailable unless the build opts in to go-tdx-qpl (build tag berth_qpl).
func OpenLegacy(path string) OpenFunc {
	return func() (Device, error) {
		return nil, fmt.Errorf("opening %s: legacy TDX guest device support not built in (build tag berth_qpl): %w", path, ErrNoDevice)
	}
}
