package server

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
)

// NewHandshakeValidator returns the validator the joinservice's TLS handshake uses: every check of
// the policy's variant (signatures, key binding, nonce, trust roots) but none of its measurement
// expectations. Measurements are judged by PolicyCheck in the handler instead, so that a node
// running the wrong image gets a gRPC rejection naming what deviated rather than a bare TLS alert.
//
// The full policy is checked first (with its expectations, e.g. PCR indices a TPM has), so that a
// policy the variant would refuse is refused here too.
func NewHandshakeValidator(p *policy.Policy, log *zap.Logger) (choose.Validator, error) {
	if _, err := choose.NewValidator(p, log); err != nil {
		return nil, err
	}
	cryptoOnly := *p
	cryptoOnly.Expectations = nil
	return choose.NewValidator(&cryptoOnly, log)
}

// PolicyCheck judges the measurements the peer proved in its handshake against p.
func PolicyCheck(p *policy.Policy) AttestationCheck {
	return func(ctx context.Context) ([]string, error) {
		ev, ok := atls.PeerEvidence(ctx)
		if !ok {
			return nil, ErrNoEvidence
		}
		if ev.Variant != p.Variant {
			return nil, fmt.Errorf("variant %q, the policy wants %q", ev.Variant, p.Variant)
		}
		return p.Evaluate(ev.Result.Measurements)
	}
}
