package vtpm

import (
	"context"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Claims reads the PCRs the Issuer quotes, without quoting: what its next document will carry unless
// a PCR is extended in between. Attested TLS volunteers them (atls.Claimer) so that a verifier can
// refuse this node before either side spends a quote.
func (i *Issuer) Claims(ctx context.Context) (attestation.Measurements, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	c, err := openTPM(ctx, i.open)
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	pcrs, err := readPCRs(c, i.pcrs)
	if err != nil {
		return nil, err
	}
	i.claimed = pcrs // the next quote starts from these (quote checks them against its digest)
	out := make(attestation.Measurements, len(pcrs))
	for k, v := range pcrs {
		out[k] = v
	}
	return out, nil
}
