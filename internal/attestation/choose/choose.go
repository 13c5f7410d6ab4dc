// Package choose builds the validator a policy file asks for: it maps the policy's variant to the
// variant package (vtpm, tdx) and hands it the policy's expectations and trust roots.
package choose

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

// Validator is what atls.Validator asks of a validator.
type Validator interface {
	Variant() string
	Validate(ctx context.Context, doc, nonce []byte) (attestation.Result, error)
}

// NewValidator returns the validator for p's variant. TDX verification runs offline on the
// collateral in p.TDX.CollateralDir and trusts Intel's SGX root unless p lists trust roots.
func NewValidator(p *policy.Policy, log *zap.Logger) (Validator, error) {
	switch p.Variant {
	case vtpm.Variant:
		v, err := vtpm.NewValidator(p, log)
		if err != nil {
			return nil, err
		}
		return v, nil
	case tdx.VariantName:
		opts := policy.TDXOptions{}
		if p.TDX != nil {
			opts = *p.TDX
		}
		roots := tdx.IntelSGXRootCA()
		if len(p.TrustRoots) > 0 {
			roots = p.CertPool()
		}
		verifier, err := tdx.NewVerifier(tdx.VerifierConfig{
			Roots:               roots,
			Collateral:          tdx.NewCachingGetter(tdx.CachingGetterConfig{Dir: opts.CollateralDir, Log: log}),
			AcceptedTCBStatuses: opts.AcceptedTCBStatuses,
			AllowDebugTD:        opts.AllowDebugTD,
		})
		if err != nil {
			return nil, fmt.Errorf("creating TDX validator: %w", err)
		}
		v, err := tdx.NewValidator(verifier, p.Evaluate, log)
		if err != nil {
			return nil, err
		}
		return v, nil
	default:
		return nil, fmt.Errorf("%w: policy %s names %q", attestation.ErrUnknownVariant, p.Origin, p.Variant)
	}
}
