package tdx

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/sha256"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"sync"
	"time"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/pemcerts"
)

// Named failures specific to TDX. Each wraps the nearest shared sentinel of package attestation, so callers that
// only know the shared ones still branch correctly.
var (
	// ErrRevoked: a certificate on the quote's PCK chain is listed in a CRL.
	ErrRevoked = fmt.Errorf("tdx certificate revoked: %w", attestation.ErrUntrustedRoot)
	// ErrCollateral: the collateral does not apply to the quote's platform, is of an unsupported kind, or has
	// expired at verification time.
	ErrCollateral = fmt.Errorf("tdx collateral unusable: %w", attestation.ErrUntrustedRoot)
	// ErrTCBStatus: the platform's TCB level, TDX module or quoting enclave is not one the verifier accepts.
	ErrTCBStatus = fmt.Errorf("tdx platform TCB not accepted: %w", attestation.ErrUntrustedRoot)
	// ErrDebugTD: the TD runs with the DEBUG attribute, so the host can read and change its memory; its
	// measurements prove nothing about what it runs.
	ErrDebugTD = fmt.Errorf("tdx TD is debuggable: %w", attestation.ErrMeasurementMismatch)
	// ErrCollateralUnavailable: no collateral could be had for the quote's platform (the PCS is unreachable and
	// nothing is cached, or the offline bundle or directory has none for it), so the quote cannot be trusted.
	ErrCollateralUnavailable = fmt.Errorf("tdx collateral unavailable: %w", attestation.ErrUntrustedRoot)
)

// intelQEVendorID is the QE vendor ID in the header of quotes from Intel's quoting enclave.
var intelQEVendorID = [16]byte{0x93, 0x9a, 0x72, 0x33, 0xf7, 0x9c, 0x4c, 0xa9, 0x94, 0x0a, 0x0d, 0xb3, 0x95, 0x7f, 0x06, 0x07}

// tdAttributeDebug is bit 0 of TDATTRIBUTES.
const tdAttributeDebug = 0x01

// TCB status values as Intel publishes them.
const (
	TCBUpToDate                          = "UpToDate"
	TCBSWHardeningNeeded                 = "SWHardeningNeeded"
	TCBConfigurationNeeded               = "ConfigurationNeeded"
	TCBConfigurationAndSWHardeningNeeded = "ConfigurationAndSWHardeningNeeded"
	TCBOutOfDate                         = "OutOfDate"
	TCBOutOfDateConfigurationNeeded      = "OutOfDateConfigurationNeeded"
	TCBRevoked                           = "Revoked"
)

// VerifierConfig configures a Verifier.
type VerifierConfig struct {
	// Roots are the trusted root CAs, normally IntelSGXRootCA. Required.
	Roots *x509.CertPool
	// Collateral provides PCK CRL, TCB info and QE identity. Required.
	Collateral CollateralGetter
	// Now returns the verification time; nil means time.Now.
	Now func() time.Time
	// AcceptedTCBStatuses lists the TCB statuses (of the platform, the TDX module and the quoting enclave) that
	// pass; any accepted status other than UpToDate becomes a warning. Empty means only UpToDate.
	AcceptedTCBStatuses []string
	// AllowDebugTD accepts TDs with the DEBUG attribute. Only for development: the host controls such a TD.
	AllowDebugTD bool
}

// Verifier checks TDX quotes offline: structure, the PCK chain up to the configured roots, revocation, the QE
// report and quote signatures, and the platform's TCB level from injected collateral.
type Verifier struct {
	roots      *x509.CertPool
	collateral CollateralGetter
	now        func() time.Time
	accepted   []string
	allowDebug bool

	mu      sync.Mutex
	memo    map[[32]byte]*checkedCollateral
	pckMemo map[[32]byte]*checkedPCK
}

// NewVerifier returns a Verifier for cfg.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	if cfg.Roots == nil {
		return nil, errors.New("creating TDX verifier: no trusted roots configured")
	}
	if cfg.Collateral == nil {
		return nil, errors.New("creating TDX verifier: no collateral getter configured")
	}
	v := &Verifier{roots: cfg.Roots, collateral: cfg.Collateral, now: cfg.Now, accepted: cfg.AcceptedTCBStatuses, allowDebug: cfg.AllowDebugTD, memo: map[[32]byte]*checkedCollateral{}, pckMemo: map[[32]byte]*checkedPCK{}}
	if v.now == nil {
		v.now = time.Now
	}
	if len(v.accepted) == 0 {
		v.accepted = []string{TCBUpToDate}
	}
	return v, nil
}

// VerifiedQuote is a quote that passed verification, with what the collateral said about its platform.
type VerifiedQuote struct {
	*Quote
	// TCBStatus is the status of the platform's TCB level; QEStatus that of the quoting enclave.
	TCBStatus string
	QEStatus  string
	// AdvisoryIDs are the Intel security advisories listed for the platform's TCB level.
	AdvisoryIDs []string
	// Warnings name accepted statuses other than UpToDate.
	Warnings []string
}

// VerifyQuote parses and verifies a raw quote. It does not look at report data or measurements; callers check
// those against their own expectations.
func (v *Verifier) VerifyQuote(ctx context.Context, raw []byte) (*VerifiedQuote, error) {
	q, err := ParseQuote(raw)
	if err != nil {
		return nil, fmt.Errorf("parsing TDX quote: %w: %w", err, attestation.ErrMalformed)
	}
	return v.verifyParsed(ctx, q)
}

func (v *Verifier) verifyParsed(ctx context.Context, q *Quote) (*VerifiedQuote, error) {
	now := v.now()
	if q.Header.QEVendorID != intelQEVendorID {
		return nil, fmt.Errorf("checking quote header: QE vendor ID %x is not Intel's: %w", q.Header.QEVendorID, attestation.ErrUntrustedRoot)
	}

	// 1. PCK certificate chain up to a trusted root.
	pc, err := v.checkPCKChain(q.PCKChainPEM, now)
	if err != nil {
		return nil, err
	}
	pckChain, ext, ca := pc.chain, pc.ext, pc.ca

	// 2. Collateral for this platform.
	raw, err := v.collateral.GetCollateral(ctx, CollateralRequest{CA: ca, FMSPC: hex.EncodeToString(ext.FMSPC[:])})
	if err != nil {
		if errors.Is(err, ErrCollateralUnavailable) {
			return nil, fmt.Errorf("getting TDX collateral: %w", err)
		}
		return nil, fmt.Errorf("getting TDX collateral: %w: %w", ErrCollateralUnavailable, err)
	}
	col, err := v.checkCollateral(raw, now)
	if err != nil {
		return nil, err
	}
	if err := verifyCollateral(col, pckChain, now); err != nil {
		return nil, err
	}

	// 3. QE report, signed by the PCK key, must bind the attestation key.
	if !verifyRawECDSA(pc.key, q.RawQEReport, q.QEReportSignature[:]) {
		return nil, fmt.Errorf("verifying QE report signature: %w", attestation.ErrBadSignature)
	}
	binding := sha256.New()
	binding.Write(q.AttestationKey[:])
	binding.Write(q.QEAuthData)
	if !bytes.Equal(q.QEReport.ReportData[:32], binding.Sum(nil)) || !isZero(q.QEReport.ReportData[32:]) {
		return nil, fmt.Errorf("checking QE report data: attestation key not endorsed by the QE: %w", attestation.ErrBadSignature)
	}

	// 4. The quote itself, signed by the attestation key.
	attKey, err := ecdsa.ParseUncompressedPublicKey(elliptic.P256(), append([]byte{4}, q.AttestationKey[:]...))
	if err != nil {
		return nil, fmt.Errorf("reading attestation key: %w: %w", err, attestation.ErrBadSignature)
	}
	if !verifyRawECDSA(attKey, q.SignedBytes, q.Signature[:]) {
		return nil, fmt.Errorf("verifying quote signature: %w", attestation.ErrBadSignature)
	}

	// 5. Quoting enclave identity and TCB.
	qeStatus, err := checkQEIdentity(&col.qeIdentity, &q.QEReport)
	if err != nil {
		return nil, err
	}
	// 6. Platform TCB and TDX module.
	level, moduleStatus, err := checkTCB(&col.tcbInfo, ext, &q.Body)
	if err != nil {
		return nil, err
	}

	// 7. A debuggable TD is under the host's control.
	if q.Body.TDAttributes[0]&tdAttributeDebug != 0 && !v.allowDebug {
		return nil, fmt.Errorf("checking TD attributes %x: %w", q.Body.TDAttributes, ErrDebugTD)
	}

	out := &VerifiedQuote{Quote: q, TCBStatus: level.TCBStatus, QEStatus: qeStatus, AdvisoryIDs: level.AdvisoryIDs}
	for _, s := range []struct{ what, status string }{
		{"platform TCB", level.TCBStatus}, {"TDX module TCB", moduleStatus}, {"quoting enclave TCB", qeStatus},
	} {
		if !slices.Contains(v.accepted, s.status) {
			return nil, fmt.Errorf("checking %s: status %q: %w", s.what, s.status, ErrTCBStatus)
		}
		if s.status != TCBUpToDate {
			out.Warnings = append(out.Warnings, fmt.Sprintf("tdx: %s status is %s (advisories: %v)", s.what, s.status, level.AdvisoryIDs))
		}
	}
	return out, nil
}

// checkedPCK is a PCK certificate chain verified up to the roots, valid for verification times in
// [notBefore, notAfter].
type checkedPCK struct {
	chain               []*x509.Certificate
	key                 *ecdsa.PublicKey
	ext                 *pckExtensions
	ca                  string
	notBefore, notAfter time.Time
}

// maxCheckedPCK bounds the memo of verified PCK chains: one per platform this verifier sees.
const maxCheckedPCK = 256

// checkPCKChain parses and verifies a quote's PCK chain, from the memo when the same chain was verified before
// for a window that includes now. Only chains that verified are remembered.
func (v *Verifier) checkPCKChain(chainPEM []byte, now time.Time) (*checkedPCK, error) {
	key := sha256.Sum256(chainPEM)
	v.mu.Lock()
	c, ok := v.pckMemo[key]
	v.mu.Unlock()
	if ok && !now.Before(c.notBefore) && !now.After(c.notAfter) {
		return c, nil
	}

	certs, err := pemcerts.Parse(chainPEM)
	if err != nil {
		return nil, fmt.Errorf("parsing PCK certificate chain: %w: %w", err, attestation.ErrMalformed)
	}
	chain, err := verifyChain(certs, v.roots, now)
	if err != nil {
		return nil, fmt.Errorf("verifying PCK certificate chain: %w", err)
	}
	pck := chain[0]
	ext, err := parsePCKExtensions(pck)
	if err != nil {
		return nil, fmt.Errorf("reading PCK certificate: %w: %w", err, attestation.ErrMalformed)
	}
	c = &checkedPCK{chain: chain, ext: ext, notAfter: chain[0].NotAfter}
	switch pck.Issuer.CommonName {
	case pckPlatformCACN:
		c.ca = PCKCAPlatform
	case pckProcessorCACN:
		c.ca = PCKCAProcessor
	default:
		return nil, fmt.Errorf("reading PCK certificate: unknown issuer %q: %w", pck.Issuer.CommonName, attestation.ErrUntrustedRoot)
	}
	pubKey, isECDSA := pck.PublicKey.(*ecdsa.PublicKey)
	if !isECDSA || pubKey.Curve != elliptic.P256() {
		return nil, fmt.Errorf("reading PCK certificate: key is not ECDSA P-256: %w", attestation.ErrMalformed)
	}
	c.key = pubKey
	for _, cert := range chain {
		if cert.NotBefore.After(c.notBefore) {
			c.notBefore = cert.NotBefore
		}
		if cert.NotAfter.Before(c.notAfter) {
			c.notAfter = cert.NotAfter
		}
	}

	v.mu.Lock()
	if len(v.pckMemo) >= maxCheckedPCK {
		clear(v.pckMemo)
	}
	v.pckMemo[key] = c
	v.mu.Unlock()
	return c, nil
}

// checkedCollateral is collateral whose signatures and signing chains were verified. The result holds for every
// verification time in [notBefore, notAfter], the window in which all signing certificates are valid; the
// collateral's own issue and update times are checked per quote.
type checkedCollateral struct {
	*parsedCollateral
	crlIssuer           *x509.Certificate
	root                *x509.Certificate
	notBefore, notAfter time.Time
}

// maxCheckedCollateral bounds the memo of verified collateral; a verifier sees one entry per platform family.
const maxCheckedCollateral = 32

// checkCollateral returns raw parsed and verified, from the memo when the same bytes were verified before for a
// window that includes now. Signature checks are most of a validation's cost, and collateral changes rarely.
func (v *Verifier) checkCollateral(raw *Collateral, now time.Time) (*checkedCollateral, error) {
	key := raw.digest()
	v.mu.Lock()
	c, ok := v.memo[key]
	v.mu.Unlock()
	if ok && !now.Before(c.notBefore) && !now.After(c.notAfter) {
		return c, nil
	}
	col, err := raw.parse()
	if err != nil {
		return nil, fmt.Errorf("parsing TDX collateral: %w: %w", err, ErrCollateral)
	}
	c, err = checkCollateralSignatures(col, v.roots, now)
	if err != nil {
		return nil, err
	}
	v.mu.Lock()
	if len(v.memo) >= maxCheckedCollateral {
		clear(v.memo)
	}
	v.memo[key] = c
	v.mu.Unlock()
	return c, nil
}

// checkCollateralSignatures verifies the PCK CRL, root CA CRL, TCB info and QE identity signatures and their
// signing chains up to roots at time now.
func checkCollateralSignatures(col *parsedCollateral, roots *x509.CertPool, now time.Time) (*checkedCollateral, error) {
	c := &checkedCollateral{parsedCollateral: col, notAfter: time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)}
	window := func(chain []*x509.Certificate) {
		for _, cert := range chain {
			if cert.NotBefore.After(c.notBefore) {
				c.notBefore = cert.NotBefore
			}
			if cert.NotAfter.Before(c.notAfter) {
				c.notAfter = cert.NotAfter
			}
		}
	}

	// PCK CRL, signed by the first certificate of its issuer chain.
	crlChain, err := verifyChain(col.pckCRLChain, roots, now)
	if err != nil {
		return nil, fmt.Errorf("verifying PCK CRL issuer chain: %w", err)
	}
	window(crlChain)
	c.crlIssuer, c.root = crlChain[0], crlChain[len(crlChain)-1]
	if !bytes.Equal(col.pckCRL.RawIssuer, c.crlIssuer.RawSubject) {
		return nil, fmt.Errorf("checking PCK CRL: issued by another CA than %q: %w", c.crlIssuer.Subject.CommonName, ErrCollateral)
	}
	if err := col.pckCRL.CheckSignatureFrom(c.crlIssuer); err != nil {
		return nil, fmt.Errorf("verifying PCK CRL signature: %w", attestation.ErrBadSignature)
	}

	// Root CA CRL, when provided, signed by the root.
	if col.rootCRL != nil {
		if err := col.rootCRL.CheckSignatureFrom(c.root); err != nil {
			return nil, fmt.Errorf("verifying root CA CRL signature: %w", attestation.ErrBadSignature)
		}
	}

	// TCB info.
	chain, err := verifySignedBody("TCB info", col.tcbInfoSigned, col.tcbInfoChain, roots, now)
	if err != nil {
		return nil, err
	}
	window(chain)
	if ti := &col.tcbInfo; ti.ID != "TDX" || ti.Version < 3 {
		return nil, fmt.Errorf("checking TCB info: id %q version %d, want TDX version 3: %w", ti.ID, ti.Version, ErrCollateral)
	}

	// QE identity.
	if chain, err = verifySignedBody("QE identity", col.qeIdentitySigned, col.qeIdentityChain, roots, now); err != nil {
		return nil, err
	}
	window(chain)
	if qi := &col.qeIdentity; qi.ID != "TD_QE" || qi.Version != 2 {
		return nil, fmt.Errorf("checking QE identity: id %q version %d, want TD_QE version 2: %w", qi.ID, qi.Version, ErrCollateral)
	}
	return c, nil
}

// verifyCollateral checks verified collateral against one quote's PCK chain and the time: the CRLs are the ones
// for this chain and current and list none of its certificates, and TCB info and QE identity are current.
func verifyCollateral(c *checkedCollateral, pckChain []*x509.Certificate, now time.Time) error {
	pck := pckChain[0]
	if !bytes.Equal(c.crlIssuer.RawSubject, pck.RawIssuer) {
		return fmt.Errorf("checking PCK CRL: issued by %q, PCK certificate by %q: %w", c.crlIssuer.Subject.CommonName, pck.Issuer.CommonName, ErrCollateral)
	}
	if err := checkCRLTime(c.pckCRL, now); err != nil {
		return fmt.Errorf("checking PCK CRL: %w", err)
	}
	if revoked(c.pckCRL, pck) {
		return fmt.Errorf("checking PCK certificate serial %s: %w", pck.SerialNumber, ErrRevoked)
	}

	if c.rootCRL != nil {
		if root := pckChain[len(pckChain)-1]; !bytes.Equal(root.Raw, c.root.Raw) {
			return fmt.Errorf("checking root CA CRL: it is for %q, the PCK chain ends in %q: %w", c.root.Subject.CommonName, root.Subject.CommonName, ErrCollateral)
		}
		if err := checkCRLTime(c.rootCRL, now); err != nil {
			return fmt.Errorf("checking root CA CRL: %w", err)
		}
		for _, ca := range pckChain[min(1, len(pckChain)-1) : len(pckChain)-1] {
			if revoked(c.rootCRL, ca) {
				return fmt.Errorf("checking CA %q: %w", ca.Subject.CommonName, ErrRevoked)
			}
		}
	}

	if err := checkValidity("TCB info", c.tcbInfo.IssueDate, c.tcbInfo.NextUpdate, now); err != nil {
		return err
	}
	return checkValidity("QE identity", c.qeIdentity.IssueDate, c.qeIdentity.NextUpdate, now)
}

// verifyChain verifies certs[0] up to one of roots, using certs[1:] as intermediates, at time now.
func verifyChain(certs []*x509.Certificate, roots *x509.CertPool, now time.Time) ([]*x509.Certificate, error) {
	if len(certs) == 0 {
		return nil, fmt.Errorf("empty certificate chain: %w", attestation.ErrMalformed)
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	chains, err := certs[0].Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: inter,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, attestation.ErrUntrustedRoot)
	}
	return chains[0], nil
}

// verifySignedBody checks a PCS response signature: ECDSA P-256 over the raw member text, by the first
// certificate of chain, which must chain to roots. It returns the verified chain.
func verifySignedBody(what string, body signedBody, chain []*x509.Certificate, roots *x509.CertPool, now time.Time) ([]*x509.Certificate, error) {
	verified, err := verifyChain(chain, roots, now)
	if err != nil {
		return nil, fmt.Errorf("verifying %s issuer chain: %w", what, err)
	}
	key, ok := verified[0].PublicKey.(*ecdsa.PublicKey)
	if !ok || !verifyRawECDSA(key, body.raw, body.signature) {
		return nil, fmt.Errorf("verifying %s signature: %w", what, attestation.ErrBadSignature)
	}
	return verified, nil
}

func checkValidity(what string, issued, next time.Time, now time.Time) error {
	if now.Before(issued) {
		return fmt.Errorf("checking %s: issued %s, after verification time %s: %w", what, issued.Format(time.RFC3339), now.Format(time.RFC3339), ErrCollateral)
	}
	if now.After(next) {
		return fmt.Errorf("checking %s: expired at %s, verification time %s: %w", what, next.Format(time.RFC3339), now.Format(time.RFC3339), ErrCollateral)
	}
	return nil
}

func checkCRLTime(crl *x509.RevocationList, now time.Time) error {
	next := crl.NextUpdate
	if next.IsZero() {
		next = now
	}
	return checkValidity("CRL", crl.ThisUpdate, next, now)
}

func revoked(crl *x509.RevocationList, cert *x509.Certificate) bool {
	for _, e := range crl.RevokedCertificateEntries {
		if e.SerialNumber != nil && e.SerialNumber.Cmp(cert.SerialNumber) == 0 {
			return true
		}
	}
	return false
}

// verifyRawECDSA checks a 64-byte r||s ECDSA signature over SHA-256(msg).
func verifyRawECDSA(key *ecdsa.PublicKey, msg, sig []byte) bool {
	if len(sig) != 64 {
		return false
	}
	digest := sha256.Sum256(msg)
	r := new(big.Int).SetBytes(sig[:32])
	s := new(big.Int).SetBytes(sig[32:])
	return ecdsa.Verify(key, digest[:], r, s)
}

func isZero(b []byte) bool {
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}

// maskedEqual reports whether value&mask == want, byte by byte; all three must have the same length.
func maskedEqual(value, mask, want []byte) bool {
	if len(value) != len(mask) || len(mask) != len(want) {
		return false
	}
	for i := range value {
		if value[i]&mask[i] != want[i] {
			return false
		}
	}
	return true
}

// checkQEIdentity matches the QE report against Intel's QE identity and returns the QE's TCB status.
func checkQEIdentity(id *qeIdentity, r *EnclaveReport) (string, error) {
	if len(id.MiscSelect) != 4 || len(id.MiscSelectMask) != 4 {
		return "", fmt.Errorf("checking QE identity: miscselect is not 4 bytes: %w", ErrCollateral)
	}
	misc := binary.BigEndian.Uint32(id.MiscSelect)
	miscMask := binary.BigEndian.Uint32(id.MiscSelectMask)
	switch {
	case r.MiscSelect&miscMask != misc:
		return "", fmt.Errorf("checking QE identity: MISCSELECT %#x does not match: %w", r.MiscSelect, ErrTCBStatus)
	case !maskedEqual(r.Attributes[:], id.AttributesMask, id.Attributes):
		return "", fmt.Errorf("checking QE identity: attributes %x do not match: %w", r.Attributes, ErrTCBStatus)
	case !bytes.Equal(r.MRSIGNER[:], id.MRSIGNER):
		return "", fmt.Errorf("checking QE identity: MRSIGNER %x, want %x: %w", r.MRSIGNER, []byte(id.MRSIGNER), ErrTCBStatus)
	case int(r.ISVProdID) != id.ISVProdID:
		return "", fmt.Errorf("checking QE identity: ISVPRODID %d, want %d: %w", r.ISVProdID, id.ISVProdID, ErrTCBStatus)
	}
	for _, l := range id.TCBLevels {
		if l.TCB.ISVSVN <= int(r.ISVSVN) {
			return l.TCBStatus, nil
		}
	}
	return "", fmt.Errorf("checking QE identity: no TCB level for ISVSVN %d: %w", r.ISVSVN, ErrTCBStatus)
}

// checkTCB matches the platform against TCB info: the FMSPC and PCE-ID of the PCK certificate, the TDX module
// identity, and the first TCB level the platform's SVNs reach. It returns that level and the TDX module's own TCB
// status (UpToDate when the TCB info does not list module TCB levels).
func checkTCB(ti *tcbInfo, ext *pckExtensions, body *TDQuoteBody) (*tcbLevel, string, error) {
	if !bytes.Equal(ti.FMSPC, ext.FMSPC[:]) || !bytes.Equal(ti.PCEID, ext.PCEID[:]) {
		return nil, "", fmt.Errorf("checking TCB info: it is for FMSPC %x PCE-ID %x, the platform is %x %x: %w",
			[]byte(ti.FMSPC), []byte(ti.PCEID), ext.FMSPC, ext.PCEID, ErrCollateral)
	}

	// TDX module: with a module major version (TEE_TCB_SVN[1]) above 0, newer TCB info lists module identities
	// with their own TCB levels and the first two TEE TCB SVN bytes are the module's, not compared below.
	tdxFrom := 0
	module := ti.TDXModule
	if body.TEETCBSVN[1] > 0 && len(ti.TDXModuleIdentities) > 0 {
		id := fmt.Sprintf("TDX_%02X", body.TEETCBSVN[1])
		module = nil
		for i := range ti.TDXModuleIdentities {
			if ti.TDXModuleIdentities[i].ID == id {
				module = &ti.TDXModuleIdentities[i]
			}
		}
		if module == nil {
			return nil, "", fmt.Errorf("checking TDX module: no identity %s in TCB info: %w", id, ErrTCBStatus)
		}
		tdxFrom = 2
	}
	if module == nil {
		return nil, "", fmt.Errorf("checking TDX module: TCB info has no TDX module identity: %w", ErrCollateral)
	}
	if !bytes.Equal(body.MRSIGNERSEAM[:], module.MRSIGNER) {
		return nil, "", fmt.Errorf("checking TDX module: MRSIGNERSEAM %x, want %x: %w", body.MRSIGNERSEAM, []byte(module.MRSIGNER), ErrTCBStatus)
	}
	if !maskedEqual(body.SEAMAttributes[:], module.AttributesMask, module.Attributes) {
		return nil, "", fmt.Errorf("checking TDX module: SEAM attributes %x do not match: %w", body.SEAMAttributes, ErrTCBStatus)
	}
	moduleStatus := TCBUpToDate
	if tdxFrom == 2 {
		moduleStatus = ""
		for _, l := range module.TCBLevels {
			if l.TCB.ISVSVN <= int(body.TEETCBSVN[0]) {
				moduleStatus = l.TCBStatus
				break
			}
		}
		if moduleStatus == "" {
			return nil, "", fmt.Errorf("checking TDX module %s: no TCB level for SVN %d: %w", module.ID, body.TEETCBSVN[0], ErrTCBStatus)
		}
	}

	for i := range ti.TCBLevels {
		l := &ti.TCBLevels[i]
		if len(l.TCB.SGXComponents) != 16 || len(l.TCB.TDXComponents) != 16 {
			return nil, "", fmt.Errorf("checking TCB info: level with %d SGX and %d TDX components: %w", len(l.TCB.SGXComponents), len(l.TCB.TDXComponents), ErrCollateral)
		}
		if svnsReach(ext.CPUSVNComponents[:], l.TCB.SGXComponents, 0) && int(ext.PCESVN) >= l.TCB.PCESVN &&
			svnsReach(body.TEETCBSVN[:], l.TCB.TDXComponents, tdxFrom) {
			return l, moduleStatus, nil
		}
	}
	return nil, "", fmt.Errorf("checking TCB info: the platform reaches no listed TCB level: %w", ErrTCBStatus)
}

// svnsReach reports whether have[i] >= level[i].SVN for every i from start on.
func svnsReach(have []byte, level []tcbComponent, start int) bool {
	for i := start; i < len(have); i++ {
		if int(have[i]) < level[i].SVN {
			return false
		}
	}
	return true
}
