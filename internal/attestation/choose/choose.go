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

// NewValidator returns the validator for p's variant. TDX verification trusts Intel's SGX root
// unless p lists trust roots, and takes its collateral from one source (see collateralSource).
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
		collateral, err := collateralSource(opts, log)
		if err != nil {
			return nil, fmt.Errorf("creating TDX validator: %w", err)
		}
		verifier, err := tdx.NewVerifier(tdx.VerifierConfig{
			Roots:               roots,
			Collateral:          collateral,
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

// collateralSource returns where a TDX verifier gets its collateral:
//
//   - the policy's collateral bundle, when it has one: nothing is ever fetched, and a platform the bundle
//     does not cover fails with tdx.ErrCollateralUnavailable;
//   - else the policy's collateral directory (pre-fetched, tdx.StoreCollateral): nothing is fetched either;
//   - else a PCS (the policy's pcsURL, default Intel's) behind a tdx.CachingGetter that keeps what it
//     fetched in memory, serves it while it is current and, when the PCS fails, while it lasts; with
//     nothing cached, an unreachable PCS fails the quote with tdx.ErrCollateralUnavailable.
func collateralSource(opts policy.TDXOptions, log *zap.Logger) (tdx.CollateralGetter, error) {
	switch {
	case opts.Bundle != nil:
		b, err := tdx.ParseCollateralBundle(opts.Bundle)
		if err != nil {
			return nil, err
		}
		log.Info("TDX collateral from the policy's bundle", zap.Time("nextUpdate", b.NextUpdate()))
		return b, nil
	case opts.CollateralDir != "":
		return tdx.NewCachingGetter(tdx.CachingGetterConfig{Dir: opts.CollateralDir, Log: log}), nil
	default:
		return tdx.NewCachingGetter(tdx.CachingGetterConfig{Upstream: &tdx.PCSGetter{BaseURL: opts.PCSURL}, Log: log}), nil
	}
}
