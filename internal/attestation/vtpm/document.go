package vtpm

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Variant is the name of this attestation variant in documents and policy files.
const Variant = "tpm"

// MaxDocumentSize bounds an attestation document; larger input is rejected before decoding.
const MaxDocumentSize = 64 << 10

// Document is the attestation document of the TPM variant. Byte fields hold TPM wire structures
// (TPMT_PUBLIC, TPMS_ATTEST, TPMT_SIGNATURE, TPMS_CREATION_DATA) or DER.
type Document struct {
	// Variant is always "tpm".
	Variant string `json:"variant"`
	// UserData is what the attester was asked to bind (aTLS: a hash of its TLS public key).
	UserData []byte `json:"userData"`
	// EKCert is the DER endorsement key certificate read from the TPM's NV storage.
	EKCert []byte `json:"ekCert"`
	// EKPublic is the EK's public area.
	EKPublic []byte `json:"ekPublic"`
	// AKPublic is the attestation key's public area.
	AKPublic []byte `json:"akPublic"`
	// AKCreationData records the AK's creation, including the name of its parent (the EK).
	AKCreationData []byte `json:"akCreationData"`
	// AKCertifyInfo and AKCertifySignature are TPM2_CertifyCreation's output for the AK.
	AKCertifyInfo      []byte `json:"akCertifyInfo"`
	AKCertifySignature []byte `json:"akCertifySignature"`
	// AKCert is an X.509 certificate for the AK from a CA that knows it lives with the EK (akcert.go);
	// optional: without it a validator activates the AK.
	AKCert []byte `json:"akCert,omitempty"`
	// Quote and QuoteSignature are TPM2_Quote's output over the SHA-256 bank.
	Quote          []byte `json:"quote"`
	QuoteSignature []byte `json:"quoteSignature"`
	// PCRs are the quoted SHA-256 PCR values by index.
	PCRs map[uint32][]byte `json:"pcrs"`
	// EventLog is the firmware's TCG event log, when the machine has one; the validator replays it
	// against the quoted PCRs.
	EventLog []byte `json:"eventLog,omitempty"`
	// Batch holds the bindings of every call a shared quote covers (batch.go); empty when the quote
	// binds this document's user data and nonce alone.
	Batch [][]byte `json:"batch,omitempty"`
}

// ParseDocument decodes a document and checks its shape. It never trusts its content.
func ParseDocument(data []byte) (*Document, error) {
	if len(data) == 0 || len(data) > MaxDocumentSize {
		return nil, fmt.Errorf("%w: %d bytes", attestation.ErrMalformed, len(data))
	}
	doc, err := decodeDocument(data)
	if err != nil {
		return nil, err
	}
	if doc.Variant != Variant {
		return nil, fmt.Errorf("%w: %q", attestation.ErrUnknownVariant, doc.Variant)
	}
	for name, f := range map[string][]byte{
		"akPublic": doc.AKPublic, "quote": doc.Quote, "quoteSignature": doc.QuoteSignature,
	} {
		if len(f) == 0 {
			return nil, fmt.Errorf("%w: %s is empty", attestation.ErrMalformed, name)
		}
	}
	if len(doc.Batch) > MaxBatch || len(doc.Batch) == 1 {
		return nil, fmt.Errorf("%w: batch of %d", attestation.ErrMalformed, len(doc.Batch))
	}
	for _, leaf := range doc.Batch {
		if len(leaf) != sha256.Size {
			return nil, fmt.Errorf("%w: batch entry of %d bytes", attestation.ErrMalformed, len(leaf))
		}
	}
	for idx, v := range doc.PCRs {
		if idx > 23 || len(v) != sha256.Size {
			return nil, fmt.Errorf("%w: PCR %d has %d bytes", attestation.ErrMalformed, idx, len(v))
		}
	}
	return &doc, nil
}

// QualifyingData returns the qualifying data (TPMS_ATTEST extraData) a quote over nonce for userData
// must carry to pass Validator.Validate. Software attesters in tests use it; the Issuer passes the
// same value to TPM2_Quote.
func QualifyingData(userData, nonce []byte) []byte { return extraData(userData, nonce) }

// extraData is what the quote's qualifying data must be: it binds the verifier's nonce and the user
// data. Both are length-prefixed so no two (userData, nonce) pairs hash alike.
func extraData(userData, nonce []byte) []byte {
	h := sha256.New()
	h.Write([]byte("berth tpm quote v1\x00"))
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(userData)))
	h.Write(n[:])
	h.Write(userData)
	binary.BigEndian.PutUint32(n[:], uint32(len(nonce)))
	h.Write(n[:])
	h.Write(nonce)
	return h.Sum(nil)
}
