// Package evidencefile owns the evidence file: what `berth verify --save-evidence` records of a
// node's attested TLS handshake and `berth policy check` judges offline (atls.VerifyRecorded). It
// holds the peer's attested certificate and the nonce the peer was asked to attest, which is all a
// verdict needs, as JSON:
//
//	{"version": 1, "endpoint": "198.51.100.10:9000", "capturedAt": "...",
//	 "nonce": "<base64>", "certificate": "<base64 DER>"}
package evidencefile

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Version is the format version Write writes and Read accepts.
const Version = 1

// MaxSize bounds an evidence file.
const MaxSize = 1 << 20

// Evidence is one recorded handshake.
type Evidence struct {
	Version int `json:"version"`
	// Endpoint is the node the evidence was recorded from.
	Endpoint string `json:"endpoint"`
	// CapturedAt is when it was recorded.
	CapturedAt time.Time `json:"capturedAt"`
	// Nonce is the nonce the node was asked to attest.
	Nonce []byte `json:"nonce"`
	// Certificate is the node's attested certificate, DER.
	Certificate []byte `json:"certificate"`
}

// Write records the evidence of endpoint (its attested certificate, the nonce it attested) at
// path, mode 0600, captured at the time given.
func Write(path, endpoint string, certificate, nonce []byte, capturedAt time.Time) error {
	data, err := json.MarshalIndent(Evidence{
		Version: Version, Endpoint: endpoint, CapturedAt: capturedAt, Nonce: nonce, Certificate: certificate,
	}, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding evidence: %w", err)
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("writing evidence: %w", err)
	}
	return nil
}

// Read reads the evidence file at path. A file that is not evidence of this version, or lacks the
// certificate or the nonce, fails with attestation.ErrMalformed.
func Read(path string) (*Evidence, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening evidence: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading evidence: %w", err)
	}
	if len(data) > MaxSize {
		return nil, fmt.Errorf("reading evidence: %s is larger than %d bytes", path, MaxSize)
	}
	var ev Evidence
	if err := json.Unmarshal(data, &ev); err != nil {
		return nil, fmt.Errorf("decoding evidence %s: %w: %w", path, err, attestation.ErrMalformed)
	}
	if ev.Version != Version || len(ev.Certificate) == 0 || len(ev.Nonce) == 0 {
		return nil, fmt.Errorf("decoding evidence %s: version %d, %d certificate bytes, %d nonce bytes: %w",
			path, ev.Version, len(ev.Certificate), len(ev.Nonce), attestation.ErrMalformed)
	}
	return &ev, nil
}
