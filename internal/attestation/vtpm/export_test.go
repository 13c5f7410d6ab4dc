package vtpm

import (
	"context"
	"time"
)

// SetClock makes v judge certificate validity at now() (tests of the identity cache's expiry).
func SetClock(v *Validator, now func() time.Time) { v.now = now }

// LimitIdentities lowers how many identities v remembers.
func LimitIdentities(v *Validator, n int) { v.maxIdentities = n }

// RememberedIdentities is how many identities v remembers.
func RememberedIdentities(v *Validator) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.identities)
}

// ReadPCRs reads pcrs from the TPM open opens, as an Issuer does.
func ReadPCRs(ctx context.Context, open OpenFunc, pcrs []uint) (map[uint32][]byte, error) {
	c, err := openTPM(ctx, open)
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Close() }()
	return readPCRs(c, pcrs)
}

// DecodePCRRead decodes a TPM2_PCR_Read response as readPCRs does.
func DecodePCRRead(rsp []byte) ([]uint, [][]byte, error) { return decodePCRRead(rsp) }
