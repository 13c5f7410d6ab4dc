package tdx

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/berth-k8s/berth/internal/pemcerts"
)

// Collateral is the signed material Intel publishes for verifying the quotes of one platform family: the PCK CRL
// of the CA that issued the PCK certificate, TCB info for the platform's FMSPC and the TDX quoting enclave's
// identity, each with the PEM certificate chain of its signer (signer first, root last) as Intel serves it.
// The bytes are kept as published, because the TCB info and QE identity signatures cover the exact JSON text.
type Collateral struct {
	// PCKCRL is the CRL of the PCK CA, DER or PEM.
	PCKCRL []byte `json:"pckCrl"`
	// PCKCRLIssuerChain is the PEM chain of the PCK CRL's issuer.
	PCKCRLIssuerChain []byte `json:"pckCrlIssuerChain"`
	// RootCACRL is the root CA's CRL, DER or PEM. Optional: without it, revocation of the PCK CA itself is not
	// checked.
	RootCACRL []byte `json:"rootCaCrl,omitempty"`
	// TCBInfo is the TCB info response body: {"tcbInfo":{...},"signature":"<hex>"}.
	TCBInfo []byte `json:"tcbInfo"`
	// TCBInfoIssuerChain is the PEM chain of the TCB signing certificate.
	TCBInfoIssuerChain []byte `json:"tcbInfoIssuerChain"`
	// QEIdentity is the QE identity response body: {"enclaveIdentity":{...},"signature":"<hex>"}.
	QEIdentity []byte `json:"qeIdentity"`
	// QEIdentityIssuerChain is the PEM chain of the QE identity's signer.
	QEIdentityIssuerChain []byte `json:"qeIdentityIssuerChain"`
}

// CollateralRequest names the collateral a quote needs.
type CollateralRequest struct {
	// CA is the PCK CA that issued the PCK certificate: PCKCAPlatform or PCKCAProcessor.
	CA string
	// FMSPC is the platform family from the PCK certificate, lower-case hex (12 digits).
	FMSPC string
}

// CollateralGetter provides collateral. Implementations may fetch it, read it from disk, or cache it
// (CachingGetter); verification itself never touches the network.
type CollateralGetter interface {
	GetCollateral(ctx context.Context, req CollateralRequest) (*Collateral, error)
}

// StaticCollateral serves one fixed set of collateral for every request, for pre-fetched or recorded collateral.
type StaticCollateral struct {
	Collateral *Collateral
}

// GetCollateral implements CollateralGetter.
func (s StaticCollateral) GetCollateral(_ context.Context, _ CollateralRequest) (*Collateral, error) {
	if s.Collateral == nil {
		return nil, errors.New("no static collateral configured")
	}
	return s.Collateral, nil
}

// tcbComponent is one SVN in a TCB level.
type tcbComponent struct {
	SVN int `json:"svn"`
}

type tcbLevel struct {
	TCB struct {
		SGXComponents []tcbComponent `json:"sgxtcbcomponents"`
		PCESVN        int            `json:"pcesvn"`
		TDXComponents []tcbComponent `json:"tdxtcbcomponents"`
		ISVSVN        int            `json:"isvsvn"`
	} `json:"tcb"`
	TCBDate     string   `json:"tcbDate"`
	TCBStatus   string   `json:"tcbStatus"`
	AdvisoryIDs []string `json:"advisoryIDs"`
}

type tdxModule struct {
	ID             string     `json:"id"`
	MRSIGNER       hexBytes   `json:"mrsigner"`
	Attributes     hexBytes   `json:"attributes"`
	AttributesMask hexBytes   `json:"attributesMask"`
	TCBLevels      []tcbLevel `json:"tcbLevels"`
}

// tcbInfo is the body of Intel's TCB info (version 3, id "TDX").
type tcbInfo struct {
	ID                  string      `json:"id"`
	Version             int         `json:"version"`
	IssueDate           time.Time   `json:"issueDate"`
	NextUpdate          time.Time   `json:"nextUpdate"`
	FMSPC               hexBytes    `json:"fmspc"`
	PCEID               hexBytes    `json:"pceId"`
	TDXModule           *tdxModule  `json:"tdxModule"`
	TDXModuleIdentities []tdxModule `json:"tdxModuleIdentities"`
	TCBLevels           []tcbLevel  `json:"tcbLevels"`
}

// qeIdentity is the body of Intel's enclave identity for the TDX quoting enclave (version 2, id "TD_QE").
type qeIdentity struct {
	ID             string     `json:"id"`
	Version        int        `json:"version"`
	IssueDate      time.Time  `json:"issueDate"`
	NextUpdate     time.Time  `json:"nextUpdate"`
	MiscSelect     hexBytes   `json:"miscselect"`
	MiscSelectMask hexBytes   `json:"miscselectMask"`
	Attributes     hexBytes   `json:"attributes"`
	AttributesMask hexBytes   `json:"attributesMask"`
	MRSIGNER       hexBytes   `json:"mrsigner"`
	ISVProdID      int        `json:"isvprodid"`
	TCBLevels      []tcbLevel `json:"tcbLevels"`
}

// hexBytes decodes a JSON hex string of either case.
type hexBytes []byte

func (h *hexBytes) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	v, err := hex.DecodeString(s)
	if err != nil {
		return err
	}
	*h = v
	return nil
}

// signedBody is a PCS response whose signature covers the raw text of one member.
type signedBody struct {
	raw       []byte
	signature []byte
}

// splitSigned extracts the member named field and the hex signature from a PCS response body.
func splitSigned(body []byte, field string) (signedBody, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return signedBody{}, fmt.Errorf("decoding response: %w", err)
	}
	raw, ok := m[field]
	if !ok {
		return signedBody{}, fmt.Errorf("response has no %q member", field)
	}
	sigHex, ok := m["signature"]
	if !ok {
		return signedBody{}, errors.New("response has no signature")
	}
	var s string
	if err := json.Unmarshal(sigHex, &s); err != nil {
		return signedBody{}, fmt.Errorf("decoding signature: %w", err)
	}
	sig, err := hex.DecodeString(s)
	if err != nil {
		return signedBody{}, fmt.Errorf("decoding signature: %w", err)
	}
	return signedBody{raw: raw, signature: sig}, nil
}

// parseSignedJSON splits a PCS response body (splitSigned) and decodes the signed member into v.
func parseSignedJSON(body []byte, field string, v any) (signedBody, error) {
	sb, err := splitSigned(body, field)
	if err != nil {
		return signedBody{}, err
	}
	if err := json.Unmarshal(sb.raw, v); err != nil {
		return signedBody{}, err
	}
	return sb, nil
}

// parsedCollateral is Collateral decoded, before any signature is checked.
type parsedCollateral struct {
	pckCRL           *x509.RevocationList
	pckCRLChain      []*x509.Certificate
	rootCRL          *x509.RevocationList
	tcbInfoSigned    signedBody
	tcbInfo          tcbInfo
	tcbInfoChain     []*x509.Certificate
	qeIdentitySigned signedBody
	qeIdentity       qeIdentity
	qeIdentityChain  []*x509.Certificate
}

func parseCRL(b []byte) (*x509.RevocationList, error) {
	if block, _ := pem.Decode(b); block != nil {
		b = block.Bytes
	} else if s := strings.TrimSpace(string(b)); len(s) > 0 && isHex(s) {
		// Some caches store the CRL hex-encoded, as one PCS API version served it.
		if d, err := hex.DecodeString(s); err == nil {
			b = d
		}
	}
	return x509.ParseRevocationList(b)
}

func isHex(s string) bool {
	for _, c := range s {
		if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
			return false
		}
	}
	return len(s)%2 == 0
}

// parse decodes collateral. Errors here mean the collateral itself is unusable.
func (c *Collateral) parse() (*parsedCollateral, error) {
	if c == nil {
		return nil, errors.New("no collateral")
	}
	p := &parsedCollateral{}
	var err error
	if p.pckCRL, err = parseCRL(c.PCKCRL); err != nil {
		return nil, fmt.Errorf("parsing PCK CRL: %w", err)
	}
	if p.pckCRLChain, err = pemcerts.Parse(c.PCKCRLIssuerChain); err != nil {
		return nil, fmt.Errorf("parsing PCK CRL issuer chain: %w", err)
	}
	if len(c.RootCACRL) > 0 {
		if p.rootCRL, err = parseCRL(c.RootCACRL); err != nil {
			return nil, fmt.Errorf("parsing root CA CRL: %w", err)
		}
	}
	if p.tcbInfoSigned, err = parseSignedJSON(c.TCBInfo, "tcbInfo", &p.tcbInfo); err != nil {
		return nil, fmt.Errorf("parsing TCB info: %w", err)
	}
	if p.tcbInfoChain, err = pemcerts.Parse(c.TCBInfoIssuerChain); err != nil {
		return nil, fmt.Errorf("parsing TCB info issuer chain: %w", err)
	}
	if p.qeIdentitySigned, err = parseSignedJSON(c.QEIdentity, "enclaveIdentity", &p.qeIdentity); err != nil {
		return nil, fmt.Errorf("parsing QE identity: %w", err)
	}
	if p.qeIdentityChain, err = pemcerts.Parse(c.QEIdentityIssuerChain); err != nil {
		return nil, fmt.Errorf("parsing QE identity issuer chain: %w", err)
	}
	return p, nil
}

// digest identifies the collateral's content: SHA-256 over every field, each length-prefixed.
func (c *Collateral) digest() [32]byte {
	h := sha256.New()
	for _, f := range [][]byte{c.PCKCRL, c.PCKCRLIssuerChain, c.RootCACRL, c.TCBInfo, c.TCBInfoIssuerChain, c.QEIdentity, c.QEIdentityIssuerChain} {
		var l [8]byte
		binary.BigEndian.PutUint64(l[:], uint64(len(f)))
		h.Write(l[:])
		h.Write(f)
	}
	var out [32]byte
	h.Sum(out[:0])
	return out
}

// nextUpdate is the earliest time at which a part of the collateral is due to be replaced.
func (p *parsedCollateral) nextUpdate() time.Time {
	t := p.tcbInfo.NextUpdate
	for _, u := range []time.Time{p.qeIdentity.NextUpdate, p.pckCRL.NextUpdate} {
		if !u.IsZero() && u.Before(t) {
			t = u
		}
	}
	if p.rootCRL != nil && !p.rootCRL.NextUpdate.IsZero() && p.rootCRL.NextUpdate.Before(t) {
		t = p.rootCRL.NextUpdate
	}
	return t
}
