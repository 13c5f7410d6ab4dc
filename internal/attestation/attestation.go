// Package attestation holds what every attestation variant shares: the result of a validation and the
// named errors a validation fails with. Variants live in subpackages (vtpm, tdx); attested TLS in
// internal/atls consumes them through its own Issuer and Validator interfaces.
package attestation

import "errors"

// Measurements maps a measurement index (a TPM PCR, or for TDX 0 = MRTD and 1..4 = RTMR0..3) to its value.
type Measurements map[uint32][]byte

// Result is what a successful validation proves about the attesting peer.
type Result struct {
	// Variant names the attestation variant that produced the document.
	Variant string
	// UserData is the data the document binds (attested TLS puts a hash of the TLS public key here).
	UserData []byte
	// Measurements are the attested measurement values.
	Measurements Measurements
	// Warnings are policy deviations that were configured as warn instead of enforce.
	Warnings []string
	// Identity is a stable digest of the attesting machine's hardware identity, the same on every
	// boot (TPM: SHA-256 of the endorsement key's public area). Empty when the variant has none
	// (TDX quotes carry no per-machine identity).
	Identity []byte
}

// Named validation failures. Callers branch on them with errors.Is; error text adds the details.
var (
	ErrMeasurementMismatch = errors.New("measurement mismatch")
	ErrNonceMismatch       = errors.New("nonce mismatch")
	ErrKeyBinding          = errors.New("attestation not bound to this TLS key")
	ErrUntrustedRoot       = errors.New("attestation key not rooted in a trusted CA")
	ErrMalformed           = errors.New("malformed attestation document")
	ErrUnknownVariant      = errors.New("unknown attestation variant")
	ErrBadSignature        = errors.New("bad attestation signature")
)
