package vtpm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
)

// DefaultLockPCR is the PCR the lock register uses unless configured otherwise. Nothing in a
// measured boot extends it, so it is zero until the node is bootstrapped.
const DefaultLockPCR = 15

// ErrLockTaken means the lock register was already extended since the last TPM reset.
var ErrLockTaken = errors.New("lock register already taken")

// LockRegister is the hardware half of the node lock: taking it extends the cluster ID into a PCR,
// which only a TPM reset (a reboot) returns to zero. It implements nodelock's marker seam.
type LockRegister struct {
	open OpenFunc
	pcr  uint
}

// NewLockRegister returns the lock register on pcr (use DefaultLockPCR) of the TPM behind open.
func NewLockRegister(open OpenFunc, pcr uint) *LockRegister {
	return &LockRegister{open: open, pcr: pcr}
}

// MarkBootstrapped extends clusterID into the lock PCR with TPM2_PCR_Event, which hashes it into every
// active bank. The extend is done in the TPM when it returns. It refuses a register that is already
// taken, so a second extend can never move the value away from the one a verifier expects.
func (l *LockRegister) MarkBootstrapped(ctx context.Context, clusterID []byte) error {
	if len(clusterID) == 0 || len(clusterID) > 1024 {
		return fmt.Errorf("marking lock register: cluster ID has %d bytes", len(clusterID))
	}
	c, err := openTPM(ctx, l.open)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	val, err := l.read(c)
	if err != nil {
		return err
	}
	if !isZero(val) {
		return fmt.Errorf("marking PCR %d: %w", l.pcr, ErrLockTaken)
	}
	if _, err := (tpm2.PCREvent{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(l.pcr), Auth: tpm2.PasswordAuth(nil)},
		EventData: tpm2.TPM2BEvent{Buffer: clusterID},
	}).Execute(c); err != nil {
		return fmt.Errorf("extending PCR %d: %w", l.pcr, err)
	}
	return nil
}

// Bootstrapped reports whether the lock PCR's SHA-256 value is non-zero.
func (l *LockRegister) Bootstrapped(ctx context.Context) (bool, error) {
	c, err := openTPM(ctx, l.open)
	if err != nil {
		return false, err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	val, err := l.read(c)
	if err != nil {
		return false, err
	}
	return !isZero(val), nil
}

func (l *LockRegister) read(c *conn) ([]byte, error) {
	vals, err := readPCRs(c, []uint{l.pcr})
	if err != nil {
		return nil, fmt.Errorf("reading lock register: %w", err)
	}
	return vals[uint32(l.pcr)], nil
}

// ExpectedLockValue is the SHA-256 value the lock PCR holds after MarkBootstrapped(clusterID) on a
// freshly reset TPM: SHA256(zeros || SHA256(clusterID)). Verifiers put it in a policy.
func ExpectedLockValue(clusterID []byte) []byte {
	inner := sha256.Sum256(clusterID)
	outer := sha256.Sum256(append(make([]byte, sha256.Size), inner[:]...))
	return outer[:]
}

func isZero(b []byte) bool { return len(b) > 0 && bytes.Equal(b, make([]byte, len(b))) }
