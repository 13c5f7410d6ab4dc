package tdx

import (
	"context"
	"crypto/sha512"
	"fmt"
)

// fdDevice is an open guest device file: go-tdx-qpl issues its ioctls on Fd.
type fdDevice interface {
	Fd() uintptr
	Close() error
}

// legacyOps are the go-tdx-qpl calls the legacy backend makes; tests replace them.
type legacyOps struct {
	quote   func(dev fdDevice, reportData []byte) ([]byte, error)
	extend  func(dev fdDevice, data []byte, index uint8) error
	measure func(dev fdDevice) ([5][48]byte, error)
}

// legacyDevice drives the pre-upstream /dev/tdx-guest ioctl ABI through go-tdx-qpl.
type legacyDevice struct {
	dev fdDevice
	ops legacyOps
}

func openLegacyWith(open func() (fdDevice, error), ops legacyOps) OpenFunc {
	return func() (Device, error) {
		dev, err := open()
		if err != nil {
			return nil, fmt.Errorf("opening TDX guest device: %w", err)
		}
		return &legacyDevice{dev: dev, ops: ops}, nil
	}
}

// Quote implements Device. The ioctl cannot be cancelled; ctx is checked before it starts.
func (d *legacyDevice) Quote(ctx context.Context, reportData [ReportDataSize]byte) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("generating TDX quote: %w", err)
	}
	q, err := d.ops.quote(d.dev, reportData[:])
	if err != nil {
		return nil, fmt.Errorf("generating TDX quote: %w", err)
	}
	if len(q) == 0 {
		return nil, fmt.Errorf("generating TDX quote: the quote generation service returned no quote")
	}
	return q, nil
}

// ExtendRTMR implements Device.
func (d *legacyDevice) ExtendRTMR(ctx context.Context, index int, data []byte) error {
	if err := checkRTMRIndex(index); err != nil {
		return fmt.Errorf("extending RTMR: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("extending RTMR: %w", err)
	}
	// go-tdx-qpl's extend ioctl carries no register index: the out-of-tree driver picks the RTMR. Read the
	// registers around the extend and fail unless the requested one took exactly this event.
	before, err := d.ops.measure(d.dev)
	if err != nil {
		return fmt.Errorf("extending RTMR %d: reading measurements: %w", index, err)
	}
	if err := d.ops.extend(d.dev, data, uint8(index)); err != nil {
		return fmt.Errorf("extending RTMR %d: %w", index, err)
	}
	after, err := d.ops.measure(d.dev)
	if err != nil {
		return fmt.Errorf("extending RTMR %d: reading measurements: %w", index, err)
	}
	if want := extendedValue(before[index+1], data); after[index+1] != want {
		return fmt.Errorf("extending RTMR %d: the driver extended another register", index)
	}
	return nil
}

// extendedValue is SHA-384(old || SHA-384(data)), the value of a register holding old after an extend with data.
func extendedValue(old [MeasurementSize]byte, data []byte) [MeasurementSize]byte {
	event := sha512.Sum384(data)
	return sha512.Sum384(append(old[:], event[:]...))
}

// Measurements implements Device.
func (d *legacyDevice) Measurements(ctx context.Context) ([5][MeasurementSize]byte, error) {
	if err := ctx.Err(); err != nil {
		return [5][MeasurementSize]byte{}, fmt.Errorf("reading TDX measurements: %w", err)
	}
	m, err := d.ops.measure(d.dev)
	if err != nil {
		return [5][MeasurementSize]byte{}, fmt.Errorf("reading TDX measurements: %w", err)
	}
	return m, nil
}

// Close implements Device.
func (d *legacyDevice) Close() error {
	return d.dev.Close()
}
