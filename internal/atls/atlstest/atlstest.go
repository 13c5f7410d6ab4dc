// Package atlstest has a fake attestation variant for tests of code that uses attested TLS: its
// documents are plain JSON of user data and nonce, so they prove nothing. Never use it outside tests.
package atlstest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Variant is the fake variant's name.
const Variant = "fake-insecure"

type fakeDoc struct {
	UserData []byte `json:"userData"`
	Nonce    []byte `json:"nonce"`
}

// Issuer issues fake documents.
type Issuer struct{}

// Variant returns the fake variant's name.
func (Issuer) Variant() string { return Variant }

// Issue returns a JSON document of userData and nonce.
func (Issuer) Issue(_ context.Context, userData, nonce []byte) ([]byte, error) {
	return json.Marshal(fakeDoc{UserData: userData, Nonce: nonce})
}

// Validator validates fake documents: it checks the nonce and returns the user data.
type Validator struct {
	// Measurements are reported in every result.
	Measurements attestation.Measurements
}

// Variant returns the fake variant's name.
func (Validator) Variant() string { return Variant }

// Validate decodes doc and checks its nonce.
func (v Validator) Validate(_ context.Context, doc, nonce []byte) (attestation.Result, error) {
	var d fakeDoc
	if err := json.Unmarshal(doc, &d); err != nil {
		return attestation.Result{}, fmt.Errorf("%w: %w", attestation.ErrMalformed, err)
	}
	if !bytes.Equal(d.Nonce, nonce) {
		return attestation.Result{}, attestation.ErrNonceMismatch
	}
	return attestation.Result{Variant: Variant, UserData: d.UserData, Measurements: v.Measurements}, nil
}
