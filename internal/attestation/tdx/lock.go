package tdx

import (
	"context"
	"fmt"
)

// DefaultLockRTMR is the RTMR Berth uses as the node lock register. Firmware and boot loader measure into RTMR0..2;
// RTMR3 is left to the guest OS. Its measurement index is DefaultLockRTMR+1.
const DefaultLockRTMR = 3

// lockDomain prefixes the cluster ID in the lock extend, so that the value cannot be confused with any other
// event extended into the same register.
const lockDomain = "berth node lock v1\x00"

// LockRegister is the hardware half of the node lock on TDX: taking the lock extends the cluster ID into an RTMR,
// and a non-zero RTMR means the node was bootstrapped since its last boot. An RTMR cannot be reset without
// rebooting the TD, so the lock cannot be rolled back. It implements nodelock's marker seam.
type LockRegister struct {
	open OpenFunc
	rtmr int
}

// NewLockRegister returns the lock register on RTMR rtmr (0..3, normally DefaultLockRTMR).
func NewLockRegister(open OpenFunc, rtmr int) (*LockRegister, error) {
	if err := checkRTMRIndex(rtmr); err != nil {
		return nil, fmt.Errorf("creating TDX lock register: %w", err)
	}
	return &LockRegister{open: open, rtmr: rtmr}, nil
}

// MarkBootstrapped extends the cluster ID into the lock RTMR. The extend is in the TDX module when this returns.
func (l *LockRegister) MarkBootstrapped(ctx context.Context, clusterID []byte) (err error) {
	dev, err := l.open()
	if err != nil {
		return fmt.Errorf("marking node bootstrapped: %w", err)
	}
	defer func() {
		if cerr := dev.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("closing TDX guest device: %w", cerr)
		}
	}()
	if err := dev.ExtendRTMR(ctx, l.rtmr, lockEvent(clusterID)); err != nil {
		return fmt.Errorf("marking node bootstrapped: %w", err)
	}
	return nil
}

// Bootstrapped reports whether the lock RTMR holds anything but zeros.
func (l *LockRegister) Bootstrapped(ctx context.Context) (ok bool, err error) {
	dev, err := l.open()
	if err != nil {
		return false, fmt.Errorf("reading lock register: %w", err)
	}
	defer func() {
		if cerr := dev.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("closing TDX guest device: %w", cerr)
		}
	}()
	m, err := dev.Measurements(ctx)
	if err != nil {
		return false, fmt.Errorf("reading lock register: %w", err)
	}
	return !isZero(m[l.rtmr+1][:]), nil
}

func lockEvent(clusterID []byte) []byte {
	return append([]byte(lockDomain), clusterID...)
}

// ExpectedLockRTMR is the value a lock RTMR that started at zero holds after MarkBootstrapped(clusterID):
// SHA-384(48 zero bytes || SHA-384(event)). Verifiers use it to require that a peer is bootstrapped into their
// cluster.
func ExpectedLockRTMR(clusterID []byte) []byte {
	out := extendedValue([MeasurementSize]byte{}, lockEvent(clusterID))
	return out[:]
}
