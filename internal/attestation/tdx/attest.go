package tdx

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
)

// VariantName names this attestation variant.
const VariantName = "tdx"

// Issuer produces TDX attestation documents.
type Issuer struct {
	open OpenFunc
	log  *zap.Logger
}

// NewIssuer returns an Issuer that opens the guest device with open for every document.
func NewIssuer(open OpenFunc, log *zap.Logger) *Issuer {
	if log == nil {
		log = zap.NewNop()
	}
	return &Issuer{open: open, log: log}
}

// Variant returns "tdx".
func (i *Issuer) Variant() string { return VariantName }

// Issue returns a document whose quote's REPORTDATA is ReportData(userData, nonce).
func (i *Issuer) Issue(ctx context.Context, userData, nonce []byte) (doc []byte, err error) {
	if len(userData) > MaxUserDataSize || len(nonce) > MaxNonceSize {
		return nil, fmt.Errorf("issuing TDX attestation: user data (%d bytes) or nonce (%d bytes) too long", len(userData), len(nonce))
	}
	dev, err := i.open()
	if err != nil {
		return nil, fmt.Errorf("issuing TDX attestation: %w", err)
	}
	defer func() {
		if cerr := dev.Close(); cerr != nil {
			i.log.Warn("closing TDX guest device failed", zap.Error(cerr))
		}
	}()
	reportData := ReportData(userData, nonce)
	start := time.Now()
	quote, err := dev.Quote(ctx, reportData)
	if err != nil {
		return nil, fmt.Errorf("issuing TDX attestation: %w", err)
	}
	// Quote generation is its own phase of a handshake: through configfs-tsm it waits for the host's quoting
	// service, and the kernel polls for the answer, so it can take from milliseconds to a second.
	i.log.Debug("TDX quote generated", zap.Duration("quoteDuration", time.Since(start)), zap.Int("quoteBytes", len(quote)))
	// Catch a device that answers with another report's quote here rather than at the verifier.
	q, err := ParseQuote(quote)
	if err != nil {
		return nil, fmt.Errorf("checking the device's quote: %w", err)
	}
	if q.Body.ReportData != reportData {
		return nil, errors.New("checking the device's quote: it carries other report data than requested")
	}
	d := Document{UserData: slices.Clone(userData), Quote: quote}
	out, err := d.Marshal()
	if err != nil {
		return nil, fmt.Errorf("issuing TDX attestation: %w", err)
	}
	return out, nil
}

// MeasurementPolicy checks attested measurements (0 = MRTD, 1..4 = RTMR0..3). It returns warnings for deviations
// configured as warn-only and an error wrapping attestation.ErrMeasurementMismatch for enforced ones. The policy
// package's (*Policy).Evaluate has this shape.
type MeasurementPolicy func(actual attestation.Measurements) (warnings []string, err error)

// ExpectMeasurements returns a MeasurementPolicy that enforces exact values for the given indices.
func ExpectMeasurements(expected map[uint32][]byte) MeasurementPolicy {
	indices := make([]uint32, 0, len(expected))
	for idx := range expected {
		indices = append(indices, idx)
	}
	slices.Sort(indices)
	return func(actual attestation.Measurements) ([]string, error) {
		var errs []error
		for _, idx := range indices {
			want, got := expected[idx], actual[idx]
			if !bytes.Equal(want, got) {
				errs = append(errs, fmt.Errorf("index %d: expected %s, actual %s: %w", idx, hexOrNone(want), hexOrNone(got), attestation.ErrMeasurementMismatch))
			}
		}
		return nil, errors.Join(errs...)
	}
}

func hexOrNone(b []byte) string {
	if b == nil {
		return "(none)"
	}
	return hex.EncodeToString(b)
}

// Validator checks TDX attestation documents.
type Validator struct {
	verifier *Verifier
	policy   MeasurementPolicy
	log      *zap.Logger
}

// NewValidator returns a Validator that verifies quotes with verifier and measurements with policy. A nil
// policy is refused: a validator that accepts any measurement must be built on purpose with a policy that says
// so.
func NewValidator(verifier *Verifier, policy MeasurementPolicy, log *zap.Logger) (*Validator, error) {
	if verifier == nil || policy == nil {
		return nil, errors.New("creating TDX validator: verifier and measurement policy are required")
	}
	if log == nil {
		log = zap.NewNop()
	}
	return &Validator{verifier: verifier, policy: policy, log: log}, nil
}

// Variant returns "tdx".
func (v *Validator) Variant() string { return VariantName }

// Validate verifies doc: its structure (ErrMalformed), the quote's signatures and chain to the trusted roots
// (ErrBadSignature, ErrUntrustedRoot and the TDX sentinels that wrap it), the collateral, that REPORTDATA binds
// nonce and the document's user data (ErrNonceMismatch), and the measurements (ErrMeasurementMismatch).
func (v *Validator) Validate(ctx context.Context, doc, nonce []byte) (attestation.Result, error) {
	d, err := ParseDocument(doc)
	if err != nil {
		return attestation.Result{}, fmt.Errorf("decoding TDX attestation document: %w: %w", err, attestation.ErrMalformed)
	}
	vq, err := v.verifier.VerifyQuote(ctx, d.Quote)
	if err != nil {
		v.log.Info("TDX quote rejected", zap.Error(err))
		return attestation.Result{}, fmt.Errorf("validating TDX attestation: %w", err)
	}
	want := ReportData(d.UserData, nonce)
	if subtle.ConstantTimeCompare(want[:], vq.Body.ReportData[:]) != 1 {
		return attestation.Result{}, fmt.Errorf("validating TDX attestation: report data does not bind this nonce and the document's user data: %w", attestation.ErrNonceMismatch)
	}
	m := vq.Measurements()
	measurements := attestation.Measurements{}
	for i := range m {
		measurements[uint32(i)] = slices.Clone(m[i][:])
	}
	warnings, err := v.policy(measurements)
	if err != nil {
		return attestation.Result{}, fmt.Errorf("validating TDX measurements: %w", err)
	}
	for _, w := range warnings {
		v.log.Warn("TDX measurement warning", zap.String("warning", w))
	}
	return attestation.Result{
		Variant:      VariantName,
		UserData:     slices.Clone(d.UserData),
		Measurements: measurements,
		Warnings:     append(slices.Clone(vq.Warnings), warnings...),
	}, nil
}
