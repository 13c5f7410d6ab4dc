package vtpm

import (
	"bytes"
	"context"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
)

// StateDiskOpenEvent is the event BootPhase.MarkStateDiskOpen extends into its PCR: the node's boot
// stage has opened the state disk, and workloads (the kubelet, init, join) may start.
const StateDiskOpenEvent = "berth: state disk open"

// ErrPhaseUnexpected means the boot phase PCR holds neither zero nor the value of the state disk
// phase: something else was measured into it in this boot.
var ErrPhaseUnexpected = errors.New("boot phase PCR holds an unexpected value")

// BootPhase marks boot phases in a PCR that nothing else in a measured boot extends. A Sealer that
// lists the PCR among its phase PCRs unseals only before the phase is marked; a verifier tells a
// quote taken before the state disk was opened (zero) from one taken after
// (ExpectedPhaseValue(StateDiskOpenEvent)).
type BootPhase struct {
	open OpenFunc
	pcr  uint
}

// NewBootPhase returns the boot phase register on pcr of the TPM behind open.
func NewBootPhase(open OpenFunc, pcr uint) *BootPhase {
	return &BootPhase{open: open, pcr: pcr}
}

// MarkStateDiskOpen extends StateDiskOpenEvent into the phase PCR with TPM2_PCR_Event. It does
// nothing when the PCR already holds that phase (the daemon restarted within the boot) and fails
// with ErrPhaseUnexpected when it holds anything else but zero.
func (p *BootPhase) MarkStateDiskOpen(ctx context.Context) error {
	c, err := openTPM(ctx, p.open)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	vals, err := readPCRs(c, []uint{p.pcr})
	if err != nil {
		return fmt.Errorf("reading boot phase PCR %d: %w", p.pcr, err)
	}
	switch val := vals[uint32(p.pcr)]; {
	case bytes.Equal(val, ExpectedPhaseValue(StateDiskOpenEvent)):
		return nil
	case !isZero(val):
		return fmt.Errorf("marking the state disk phase in PCR %d: %w", p.pcr, ErrPhaseUnexpected)
	}
	if _, err := (tpm2.PCREvent{
		PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(p.pcr), Auth: tpm2.PasswordAuth(nil)},
		EventData: tpm2.TPM2BEvent{Buffer: []byte(StateDiskOpenEvent)},
	}).Execute(c); err != nil {
		return fmt.Errorf("extending boot phase PCR %d: %w", p.pcr, err)
	}
	return nil
}

// ExpectedPhaseValue is the SHA-256 value of a phase PCR after event was marked on a freshly reset
// TPM: SHA256(zeros || SHA256(event)), as for the lock register.
func ExpectedPhaseValue(event string) []byte { return ExpectedLockValue([]byte(event)) }
