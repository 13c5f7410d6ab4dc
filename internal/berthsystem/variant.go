package berthsystem

import (
	"errors"
	"fmt"
	"path"

	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// The attestation variants a control plane's joinservice attests with (its BERTH_ATTESTATION). These are
// the bootstrapper's and the joinservice's --attestation values; the variant packages define the same names.
const (
	VariantTPM          = "tpm"
	VariantTDX          = "tdx"
	VariantInsecureNone = "insecure-none"
)

// Named errors of the attestation settings Objects derives from Config.JoinServiceEnv and the policy.
var (
	// ErrMixedVariants: the control plane attests with one variant and the cluster's attestation policy names
	// another. A Berth cluster has one variant: the joinservice checks joining nodes against the one policy,
	// and a joining node checks the joinservice against its own policy of its own variant, so a cluster of
	// TPM and TDX machines could never join a node. init refuses it rather than build such a cluster.
	ErrMixedVariants = errors.New("the control plane's attestation variant differs from the attestation policy's; a cluster of mixed variants is not supported")
	// ErrUnknownVariant: BERTH_ATTESTATION names no variant the joinservice has.
	ErrUnknownVariant = errors.New("unknown attestation variant")
	// ErrTDXGuestWithoutTDX: Config.TDXGuest is set for a control plane that does not attest with TDX.
	ErrTDXGuestWithoutTDX = errors.New("a TD guest interface is configured for a control plane that does not attest with tdx")
	// ErrCollateralDirNotAbsolute: the policy's tdx.collateralDir is relative. The joinservice reads the
	// policy from the join ConfigMap, where there is no policy file to resolve it against.
	ErrCollateralDirNotAbsolute = errors.New("the attestation policy's tdx.collateralDir must be an absolute path on the control planes")
)

// tdxCollateralVolume names the volume that carries the policy's tdx.collateralDir.
const tdxCollateralVolume = "tdx-collateral"

// attestationSettings is what the joinservice DaemonSet needs for the control plane's attestation variant.
type attestationSettings struct {
	// variant is the control plane's BERTH_ATTESTATION; empty when the caller set none.
	variant string
	// collateralDir is the policy's tdx.collateralDir, mounted read-only at the same path.
	collateralDir string
}

// policyHead is the part of an attestation policy that decides what the joinservice's pod needs. The policy's
// own parser (internal/attestation/policy) checks the rest where the policy is read.
type policyHead struct {
	Variant string `json:"variant"`
	TDX     *struct {
		CollateralDir string `json:"collateralDir"`
	} `json:"tdx"`
}

// attestationFor decides the attestation settings of the joinservice from the control plane's variant
// (cfg.JoinServiceEnv[BERTH_ATTESTATION]) and the cluster's attestation policy. An empty variant leaves the
// DaemonSet as the caller configured it (a test harness without attestation).
func attestationFor(cfg Config, attestationPolicy []byte) (attestationSettings, error) {
	s := attestationSettings{variant: cfg.JoinServiceEnv[joinconfig.EnvAttestation]}
	switch s.variant {
	case "", VariantTPM, VariantTDX, VariantInsecureNone:
	default:
		return s, fmt.Errorf("%s %q: want %s, %s or %s: %w", joinconfig.EnvAttestation, s.variant, VariantTPM, VariantTDX, VariantInsecureNone, ErrUnknownVariant)
	}
	if cfg.TDXGuest != "" && s.variant != VariantTDX {
		return s, fmt.Errorf("TD guest interface %q with %s=%q: %w", cfg.TDXGuest, joinconfig.EnvAttestation, s.variant, ErrTDXGuestWithoutTDX)
	}
	if s.variant == "" || s.variant == VariantInsecureNone || len(attestationPolicy) == 0 {
		return s, nil
	}
	var head policyHead
	if err := yaml.Unmarshal(attestationPolicy, &head); err != nil {
		return s, fmt.Errorf("reading the attestation policy's variant: %w", err)
	}
	if head.Variant != s.variant {
		return s, fmt.Errorf("the control plane attests with %q, the attestation policy names %q: %w", s.variant, head.Variant, ErrMixedVariants)
	}
	if s.variant == VariantTDX && head.TDX != nil && head.TDX.CollateralDir != "" {
		if !path.IsAbs(head.TDX.CollateralDir) {
			return s, fmt.Errorf("tdx.collateralDir %q: %w", head.TDX.CollateralDir, ErrCollateralDirNotAbsolute)
		}
		s.collateralDir = path.Clean(head.TDX.CollateralDir)
	}
	return s, nil
}
