// Package tdxtest is a software TD for tests: a Platform with its own root CA, PCK chain, quoting key and
// collateral, whose Device produces quotes that package tdx verifies exactly as it verifies Intel's. It lets tests
// run the full issue → validate path and produce correctly signed quotes that differ from what a validator
// expects (another nonce, another MRTD, a revoked PCK certificate, an outdated TCB). Never use it outside tests.
package tdxtest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/berth-k8s/berth/internal/attestation/tdx"
)

// RootCRLURL is the CRL distribution point of a Platform's root CA, where its root CA CRL (the collateral's
// RootCACRL) is published. Nothing serves it; verifiers that fetch by URL get the CRL injected.
const RootCRLURL = "https://tdxtest.invalid/IntelSGXRootCA.der"

// PCKCRLURL is the CRL distribution point of a Platform's PCK certificate (the collateral's PCKCRL).
const PCKCRLURL = "https://tdxtest.invalid/pckcrl?ca=platform"

// Options shape a Platform. The zero value gives an up-to-date platform whose collateral is valid around Now.
type Options struct {
	// Now centres every validity window; zero means time.Now().
	Now time.Time
	// MRTD is the TD's build-time measurement.
	MRTD [tdx.MeasurementSize]byte
	// TCBStatus is the status TCB info gives the platform's TCB level; empty means UpToDate.
	TCBStatus string
	// RevokePCK lists the PCK certificate in the PCK CRL.
	RevokePCK bool
	// RevokePCKCA lists the PCK CA in the root CA CRL.
	RevokePCKCA bool
	// Debug sets the TD's DEBUG attribute.
	Debug bool
}

// Platform is a software TD and the Intel-like PKI that vouches for it.
type Platform struct {
	opts Options

	rootKey, pckCAKey, pckKey, tcbKey, attKey *ecdsa.PrivateKey
	root, pckCA, pck, tcbSigner               *x509.Certificate
	collateral                                *tdx.Collateral

	// td is the TD that Open and Quote act on.
	td *TD
}

// TD is one trust domain on a Platform: RTMRs of its own, the platform's MRTD, attributes, PKI and quoting key.
// Several TDs on one platform share one set of collateral and trust roots, the way the machines of one platform
// family share Intel's.
type TD struct {
	p *Platform

	mu   sync.Mutex
	rtmr [4][tdx.MeasurementSize]byte
}

// NewTD returns a fresh TD on the platform, its RTMRs all zero.
func (p *Platform) NewTD() *TD {
	return &TD{p: p}
}

// Fixed platform facts the PCK certificate, TCB info and quotes agree on.
var (
	fmspc       = []byte{0x00, 0x80, 0x6f, 0x05, 0x00, 0x00}
	pceID       = []byte{0x00, 0x00}
	cpuSVN      = [16]byte{5, 5, 13, 2, 3, 1, 0, 3}
	pceSVN      = 11
	teeTCBSVN   = [16]byte{3, 0, 5}
	qeMRSIGNER  = [32]byte{0xdc, 0x9e, 0x2a, 0x7c}
	qeISVProdID = 2
	qeISVSVN    = 4
	// xfam enables x87, SSE, AVX and AVX-512 state, as a TD's usually does (x87 and SSE are required).
	xfam = uint64(0xe7)
	// intelQEVendorID marks quotes from Intel's quoting enclave.
	intelQEVendorID = []byte{0x93, 0x9a, 0x72, 0x33, 0xf7, 0x9c, 0x4c, 0xa9, 0x94, 0x0a, 0x0d, 0xb3, 0x95, 0x7f, 0x06, 0x07}
)

// New creates a Platform with fresh keys.
func New(opts Options) (*Platform, error) {
	if opts.Now.IsZero() {
		opts.Now = time.Now()
	}
	if opts.TCBStatus == "" {
		opts.TCBStatus = tdx.TCBUpToDate
	}
	p := &Platform{opts: opts}
	p.td = p.NewTD()
	keys := []**ecdsa.PrivateKey{&p.rootKey, &p.pckCAKey, &p.pckKey, &p.tcbKey, &p.attKey}
	for _, k := range keys {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("generating key: %w", err)
		}
		*k = key
	}
	var err error
	// The certificates carry the common names of Intel's, which verifiers such as go-tdx-guest's check.
	if p.root, err = p.issue(1, "Intel SGX Root CA", true, nil, nil, &p.rootKey.PublicKey, p.rootKey); err != nil {
		return nil, err
	}
	if p.pckCA, err = p.issue(2, "Intel SGX PCK Platform CA", true, nil, p.root, &p.pckCAKey.PublicKey, p.rootKey); err != nil {
		return nil, err
	}
	ext, err := sgxExtension()
	if err != nil {
		return nil, err
	}
	if p.pck, err = p.issue(3, "Intel SGX PCK Certificate", false, ext, p.pckCA, &p.pckKey.PublicKey, p.pckCAKey); err != nil {
		return nil, err
	}
	if p.tcbSigner, err = p.issue(4, "Intel SGX TCB Signing", false, nil, p.root, &p.tcbKey.PublicKey, p.rootKey); err != nil {
		return nil, err
	}
	if p.collateral, err = p.buildCollateral(); err != nil {
		return nil, err
	}
	return p, nil
}

// Roots returns a pool holding the platform's root CA.
func (p *Platform) Roots() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AddCert(p.root)
	return pool
}

// RootPEM returns the platform's root CA certificate in PEM, for a policy's trustRoots.
func (p *Platform) RootPEM() []byte {
	return pemChain(p.root)
}

// Collateral returns collateral matching the platform.
func (p *Platform) Collateral() *tdx.Collateral {
	c := *p.collateral
	return &c
}

// CollateralRequest names the platform's collateral: its PCK CA and FMSPC.
func (p *Platform) CollateralRequest() tdx.CollateralRequest {
	return tdx.CollateralRequest{CA: tdx.PCKCAPlatform, FMSPC: hex.EncodeToString(fmspc)}
}

// Bundle returns the platform's collateral as a collateral bundle (tdx.ParseCollateralBundle).
func (p *Platform) Bundle() ([]byte, error) {
	return tdx.MarshalCollateralBundle(map[tdx.CollateralRequest]*tdx.Collateral{p.CollateralRequest(): p.Collateral()})
}

// Open implements tdx.OpenFunc for the platform's own TD.
func (p *Platform) Open() (tdx.Device, error) {
	return p.td.Open()
}

// Open implements tdx.OpenFunc.
func (td *TD) Open() (tdx.Device, error) {
	return &device{td: td}, nil
}

func (p *Platform) issue(serial int64, cn string, isCA bool, sgxExt []byte, parent *x509.Certificate, pub *ecdsa.PublicKey, signer *ecdsa.PrivateKey) (*x509.Certificate, error) {
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial),
		Subject:               pkix.Name{CommonName: cn, Organization: []string{"Berth test"}},
		NotBefore:             p.opts.Now.Add(-24 * time.Hour),
		NotAfter:              p.opts.Now.Add(365 * 24 * time.Hour),
		BasicConstraintsValid: true,
		IsCA:                  isCA,
		KeyUsage:              x509.KeyUsageDigitalSignature,
	}
	if isCA {
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	}
	if sgxExt != nil {
		// A PCK certificate has the extensions of Intel's, in number too: key usage, basic constraints, the
		// key identifiers, the CRL distribution point and the SGX extension.
		tmpl.ExtraExtensions = []pkix.Extension{{Id: asn1.ObjectIdentifier{1, 2, 840, 113741, 1, 13, 1}, Value: sgxExt}}
		tmpl.SubjectKeyId = big.NewInt(serial).Bytes()
		tmpl.CRLDistributionPoints = []string{PCKCRLURL}
	}
	if parent == nil {
		parent = tmpl
		tmpl.CRLDistributionPoints = []string{RootCRLURL}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
	if err != nil {
		return nil, fmt.Errorf("creating certificate %q: %w", cn, err)
	}
	return x509.ParseCertificate(der)
}

type sgxEntry struct {
	ID    asn1.ObjectIdentifier
	Value asn1.RawValue
}

func entry(oid asn1.ObjectIdentifier, value any) (sgxEntry, error) {
	der, err := asn1.Marshal(value)
	if err != nil {
		return sgxEntry{}, err
	}
	return sgxEntry{ID: oid, Value: asn1.RawValue{FullBytes: der}}, nil
}

// sgxExtension encodes the SGX extension of the PCK certificate: PPID, TCB, PCE-ID, FMSPC, SGX type.
func sgxExtension() ([]byte, error) {
	base := asn1.ObjectIdentifier{1, 2, 840, 113741, 1, 13, 1}
	sub := func(n ...int) asn1.ObjectIdentifier { return append(append(asn1.ObjectIdentifier{}, base...), n...) }
	var tcb []sgxEntry
	for i := 0; i < 16; i++ {
		e, err := entry(sub(2, i+1), int(cpuSVN[i]))
		if err != nil {
			return nil, err
		}
		tcb = append(tcb, e)
	}
	e, err := entry(sub(2, 17), pceSVN)
	if err != nil {
		return nil, err
	}
	tcb = append(tcb, e)
	if e, err = entry(sub(2, 18), cpuSVN[:]); err != nil {
		return nil, err
	}
	tcb = append(tcb, e)
	var all []sgxEntry
	for _, item := range []struct {
		oid asn1.ObjectIdentifier
		v   any
	}{
		{sub(1), make([]byte, 16)},
		{sub(2), tcb},
		{sub(3), pceID},
		{sub(4), fmspc},
		{sub(5), asn1.Enumerated(0)},
	} {
		e, err := entry(item.oid, item.v)
		if err != nil {
			return nil, fmt.Errorf("encoding SGX extension: %w", err)
		}
		all = append(all, e)
	}
	return asn1.Marshal(all)
}

func pemChain(certs ...*x509.Certificate) []byte {
	var b []byte
	for _, c := range certs {
		b = append(b, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return b
}

func signRaw(key *ecdsa.PrivateKey, msg []byte) ([]byte, error) {
	digest := sha256.Sum256(msg)
	r, s, err := ecdsa.Sign(rand.Reader, key, digest[:])
	if err != nil {
		return nil, err
	}
	out := make([]byte, 64)
	r.FillBytes(out[:32])
	s.FillBytes(out[32:])
	return out, nil
}

// signedJSON renders {"<member>":<body>,"signature":"<hex>"} with the signature over body's exact bytes.
func (p *Platform) signedJSON(member string, v any) ([]byte, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	sig, err := signRaw(p.tcbKey, body)
	if err != nil {
		return nil, err
	}
	return []byte(fmt.Sprintf(`{"%s":%s,"signature":"%s"}`, member, body, hex.EncodeToString(sig))), nil
}

type svn struct {
	SVN int `json:"svn"`
}

func components(b [16]byte) []svn {
	out := make([]svn, 16)
	for i := range b {
		out[i] = svn{int(b[i])}
	}
	return out
}

func (p *Platform) buildCollateral() (*tdx.Collateral, error) {
	now := p.opts.Now.UTC().Truncate(time.Second)
	issued, next := now.Add(-time.Hour), now.Add(30*24*time.Hour)

	crl := func(number int64, revoked *x509.Certificate, issuer *x509.Certificate, key *ecdsa.PrivateKey) ([]byte, error) {
		tmpl := &x509.RevocationList{Number: big.NewInt(number), ThisUpdate: issued, NextUpdate: next}
		if revoked != nil {
			tmpl.RevokedCertificateEntries = []x509.RevocationListEntry{{SerialNumber: revoked.SerialNumber, RevocationTime: issued}}
		}
		return x509.CreateRevocationList(rand.Reader, tmpl, issuer, key)
	}
	var revokedPCK, revokedCA *x509.Certificate
	if p.opts.RevokePCK {
		revokedPCK = p.pck
	}
	if p.opts.RevokePCKCA {
		revokedCA = p.pckCA
	}
	pckCRL, err := crl(1, revokedPCK, p.pckCA, p.pckCAKey)
	if err != nil {
		return nil, fmt.Errorf("creating PCK CRL: %w", err)
	}
	rootCRL, err := crl(1, revokedCA, p.root, p.rootKey)
	if err != nil {
		return nil, fmt.Errorf("creating root CA CRL: %w", err)
	}

	zeroSigner := strings.Repeat("00", 48)
	tcbInfo := map[string]any{
		"id": "TDX", "version": 3, "issueDate": issued, "nextUpdate": next,
		"fmspc": hex.EncodeToString(fmspc), "pceId": hex.EncodeToString(pceID), "tcbType": 0, "tcbEvaluationDataNumber": 1,
		"tdxModule": map[string]string{"mrsigner": zeroSigner, "attributes": "0000000000000000", "attributesMask": "FFFFFFFFFFFFFFFF"},
		"tcbLevels": []map[string]any{{
			"tcb": map[string]any{
				"sgxtcbcomponents": components(cpuSVN), "pcesvn": pceSVN, "tdxtcbcomponents": components(teeTCBSVN),
			},
			"tcbDate": issued, "tcbStatus": p.opts.TCBStatus,
		}},
	}
	tcbBody, err := p.signedJSON("tcbInfo", tcbInfo)
	if err != nil {
		return nil, fmt.Errorf("creating TCB info: %w", err)
	}
	qeIdentity := map[string]any{
		"id": "TD_QE", "version": 2, "issueDate": issued, "nextUpdate": next,
		"miscselect": "00000000", "miscselectMask": "FFFFFFFF",
		"attributes": "11000000000000000000000000000000", "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000",
		"mrsigner": hex.EncodeToString(qeMRSIGNER[:]), "isvprodid": qeISVProdID,
		"tcbLevels": []map[string]any{{"tcb": map[string]int{"isvsvn": qeISVSVN}, "tcbDate": issued, "tcbStatus": tdx.TCBUpToDate}},
	}
	qeBody, err := p.signedJSON("enclaveIdentity", qeIdentity)
	if err != nil {
		return nil, fmt.Errorf("creating QE identity: %w", err)
	}
	signerChain := pemChain(p.tcbSigner, p.root)
	return &tdx.Collateral{
		PCKCRL:                pckCRL,
		PCKCRLIssuerChain:     pemChain(p.pckCA, p.root),
		RootCACRL:             rootCRL,
		TCBInfo:               tcbBody,
		TCBInfoIssuerChain:    signerChain,
		QEIdentity:            qeBody,
		QEIdentityIssuerChain: signerChain,
	}, nil
}

// Quote returns a quote of the platform's own TD over reportData, signed like a real one.
func (p *Platform) Quote(reportData [tdx.ReportDataSize]byte) ([]byte, error) {
	return p.td.Quote(reportData)
}

// Quote returns a quote over reportData with the TD's current measurements, signed like a real one.
func (td *TD) Quote(reportData [tdx.ReportDataSize]byte) ([]byte, error) {
	return td.p.quote(td.RTMRs(), reportData)
}

// RTMRs returns the TD's current RTMR0..3.
func (td *TD) RTMRs() [4][tdx.MeasurementSize]byte {
	td.mu.Lock()
	defer td.mu.Unlock()
	return td.rtmr
}

// quote builds and signs a quote with the platform's MRTD and the given RTMRs.
func (p *Platform) quote(rtmr [4][tdx.MeasurementSize]byte, reportData [tdx.ReportDataSize]byte) ([]byte, error) {
	q := make([]byte, 0, SignedQuoteSize)
	q = binary.LittleEndian.AppendUint16(q, 4)    // version
	q = binary.LittleEndian.AppendUint16(q, 2)    // ECDSA P-256 attestation key
	q = binary.LittleEndian.AppendUint32(q, 0x81) // TDX
	q = append(q, make([]byte, 4)...)             // reserved
	q = append(q, intelQEVendorID...)
	q = append(q, make([]byte, 20)...) // user data
	q = append(q, teeTCBSVN[:]...)
	q = append(q, make([]byte, 48+48+8)...) // MRSEAM, MRSIGNERSEAM, SEAM attributes
	tdAttributes := make([]byte, 8)
	if p.opts.Debug {
		tdAttributes[0] = 0x01
	}
	q = append(q, tdAttributes...)
	q = binary.LittleEndian.AppendUint64(q, xfam)
	q = append(q, p.opts.MRTD[:]...)
	q = append(q, make([]byte, 3*48)...) // MRCONFIGID, MROWNER, MROWNERCONFIG
	for i := range rtmr {
		q = append(q, rtmr[i][:]...)
	}
	q = append(q, reportData[:]...)

	qeReport := make([]byte, QEReportSize)
	qeReport[48] = 0x11 // attributes matching the QE identity
	copy(qeReport[128:160], qeMRSIGNER[:])
	binary.LittleEndian.PutUint16(qeReport[256:], uint16(qeISVProdID))
	binary.LittleEndian.PutUint16(qeReport[258:], uint16(qeISVSVN))
	return p.SignQuote(q, qeReport)
}

// Sizes of the parts of a quote SignQuote signs.
const (
	// SignedQuoteSize is the quote header and TD quote body, which the attestation key signs.
	SignedQuoteSize = 48 + 584
	// QEReportSize is the quoting enclave's report, which the PCK key signs.
	QEReportSize = 384
)

// SignQuote completes a quote from its header and TD quote body (SignedQuoteSize bytes, any content) and the
// quoting enclave's report (QEReportSize bytes, any content; its report data is set to bind the attestation key,
// as a QE does): the attestation key signs the body, the PCK key the QE report, and the platform's PCK chain is
// appended. Tests and fuzz targets use it to reach every check a verifier makes after the signatures.
func (p *Platform) SignQuote(signed, qeReport []byte) ([]byte, error) {
	if len(signed) != SignedQuoteSize || len(qeReport) != QEReportSize {
		return nil, fmt.Errorf("signing quote: %d signed bytes and a %d-byte QE report, want %d and %d",
			len(signed), len(qeReport), SignedQuoteSize, QEReportSize)
	}
	q := append(make([]byte, 0, 5000), signed...)
	sig, err := signRaw(p.attKey, q)
	if err != nil {
		return nil, fmt.Errorf("signing quote: %w", err)
	}
	attPub := make([]byte, 64)
	p.attKey.X.FillBytes(attPub[:32])
	p.attKey.Y.FillBytes(attPub[32:])
	authData := make([]byte, 32)
	for i := range authData {
		authData[i] = byte(i)
	}

	qeReport = append([]byte(nil), qeReport...)
	binding := sha256.Sum256(append(append([]byte{}, attPub...), authData...))
	copy(qeReport[320:], binding[:])
	clear(qeReport[352:])
	qeSig, err := signRaw(p.pckKey, qeReport)
	if err != nil {
		return nil, fmt.Errorf("signing QE report: %w", err)
	}
	chain := pemChain(p.pck, p.pckCA, p.root)

	var cert []byte
	cert = append(cert, qeReport...)
	cert = append(cert, qeSig...)
	cert = binary.LittleEndian.AppendUint16(cert, uint16(len(authData)))
	cert = append(cert, authData...)
	cert = binary.LittleEndian.AppendUint16(cert, 5)
	cert = binary.LittleEndian.AppendUint32(cert, uint32(len(chain)))
	cert = append(cert, chain...)

	var sigData []byte
	sigData = append(sigData, sig...)
	sigData = append(sigData, attPub...)
	sigData = binary.LittleEndian.AppendUint16(sigData, 6)
	sigData = binary.LittleEndian.AppendUint32(sigData, uint32(len(cert)))
	sigData = append(sigData, cert...)

	q = binary.LittleEndian.AppendUint32(q, uint32(len(sigData)))
	return append(q, sigData...), nil
}

// device is a TD's tdx.Device.
type device struct {
	td *TD
}

func (d *device) Quote(ctx context.Context, reportData [tdx.ReportDataSize]byte) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return d.td.Quote(reportData)
}

func (d *device) ExtendRTMR(_ context.Context, index int, data []byte) error {
	if index < 0 || index > 3 {
		return fmt.Errorf("RTMR index %d out of range", index)
	}
	event := sha512.Sum384(data)
	d.td.mu.Lock()
	defer d.td.mu.Unlock()
	d.td.rtmr[index] = sha512.Sum384(append(d.td.rtmr[index][:], event[:]...))
	return nil
}

func (d *device) Measurements(context.Context) ([5][tdx.MeasurementSize]byte, error) {
	rtmr := d.td.RTMRs()
	return [5][tdx.MeasurementSize]byte{d.td.p.opts.MRTD, rtmr[0], rtmr[1], rtmr[2], rtmr[3]}, nil
}

func (d *device) Close() error { return nil }
