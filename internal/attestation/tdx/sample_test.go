package tdx

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"testing"
	"time"

	"github.com/edgelesssys/go-tdx-qpl/blobs"

	"github.com/berth-k8s/berth/internal/attestation"
)

// The sample quote and collateral come from go-tdx-qpl's blobs package, loaded through the Go module: a quote
// recorded on an Intel TDX development platform, the PCK CRL, TCB info and QE identity Intel served for it, and
// their signing certificates. sampleNow is a time at which all of it is valid.
var sampleNow = blobs.PCSIssueDate

func sampleCollateral() *Collateral {
	withRoot := func(pemCert []byte) []byte {
		return append(append([]byte{}, pemCert...), IntelSGXRootCAPEM...)
	}
	return &Collateral{
		PCKCRL:                blobs.PCKCRLDER(),
		PCKCRLIssuerChain:     withRoot(blobs.CRLSigningCertPEM),
		TCBInfo:               blobs.TCBInfoJSON,
		TCBInfoIssuerChain:    withRoot(blobs.TCBSigningCertPEM),
		QEIdentity:            blobs.QEIdentityJSON,
		QEIdentityIssuerChain: withRoot(blobs.TCBSigningCertPEM),
	}
}

func sampleVerifier(t testing.TB, roots *x509.CertPool, now time.Time, col *Collateral) *Verifier {
	t.Helper()
	v, err := NewVerifier(VerifierConfig{Roots: roots, Collateral: StaticCollateral{Collateral: col}, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatalf("NewVerifier() = %v", err)
	}
	return v
}

// foreignRoot is a self-signed CA that signed nothing in the sample.
func foreignRoot(t *testing.T) *x509.CertPool {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "Intel SGX Root CA"},
		NotBefore: sampleNow.Add(-time.Hour), NotAfter: sampleNow.Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return pool
}

// Offsets into the sample quote.
const (
	offMRTD       = quoteHeaderSize + 136
	offReportData = quoteHeaderSize + 520
	offSignature  = signedQuoteSize + sigDataLenSize
	offAttKey     = offSignature + ecdsaSigSize
	offQEReport   = offAttKey + ecdsaPubKeySize + 6
	offQESig      = offQEReport + enclaveReportSize
)

func flip(b []byte, off int) []byte {
	out := append([]byte{}, b...)
	out[off] ^= 0x01
	return out
}

func TestVerifyQuoteSample(t *testing.T) {
	quote := blobs.TDXQuote()
	tamperedTCBInfo := sampleCollateral()
	tamperedTCBInfo.TCBInfo = []byte(replaceOnce(t, string(blobs.TCBInfoJSON), `"pcesvn":5`, `"pcesvn":4`))
	tamperedQEIdentity := sampleCollateral()
	tamperedQEIdentity.QEIdentity = []byte(replaceOnce(t, string(blobs.QEIdentityJSON), `"isvprodid":2`, `"isvprodid":3`))
	wrongCRLIssuer := sampleCollateral()
	wrongCRLIssuer.PCKCRLIssuerChain = wrongCRLIssuer.TCBInfoIssuerChain

	testCases := map[string]struct {
		quote      []byte
		roots      *x509.CertPool
		now        time.Time
		collateral *Collateral
		accepted   []string
		wantErr    error
	}{
		"valid":                      {quote: quote},
		"changed report data":        {quote: flip(quote, offReportData), wantErr: attestation.ErrBadSignature},
		"changed MRTD":               {quote: flip(quote, offMRTD), wantErr: attestation.ErrBadSignature},
		"changed RTMR3":              {quote: flip(quote, offReportData-1), wantErr: attestation.ErrBadSignature},
		"broken quote signature":     {quote: flip(quote, offSignature+5), wantErr: attestation.ErrBadSignature},
		"swapped attestation key":    {quote: flip(quote, offAttKey+63), wantErr: attestation.ErrBadSignature},
		"broken QE report signature": {quote: flip(quote, offQESig+1), wantErr: attestation.ErrBadSignature},
		"changed QE report":          {quote: flip(quote, offQEReport+300), wantErr: attestation.ErrBadSignature},
		"truncated":                  {quote: quote[:len(quote)-100], wantErr: attestation.ErrMalformed},
		"header only":                {quote: quote[:quoteHeaderSize], wantErr: attestation.ErrMalformed},
		"garbage":                    {quote: []byte("this is not a quote at all"), wantErr: attestation.ErrMalformed},
		"empty":                      {quote: nil, wantErr: attestation.ErrMalformed},
		"wrong version":              {quote: flip(quote, 0), wantErr: attestation.ErrMalformed},
		"other QE vendor":            {quote: flip(quote, 12), wantErr: attestation.ErrUntrustedRoot},
		"untrusted root":             {quote: quote, roots: foreignRoot(t), wantErr: attestation.ErrUntrustedRoot},
		"collateral expired":         {quote: quote, now: time.Date(2023, 3, 20, 0, 0, 0, 0, time.UTC), wantErr: ErrCollateral},
		"before collateral issued":   {quote: quote, now: time.Date(2023, 2, 1, 0, 0, 0, 0, time.UTC), wantErr: ErrCollateral},
		"PCK chain expired":          {quote: quote, now: time.Date(2031, 1, 1, 0, 0, 0, 0, time.UTC), wantErr: attestation.ErrUntrustedRoot},
		"tampered TCB info":          {quote: quote, collateral: tamperedTCBInfo, wantErr: attestation.ErrBadSignature},
		"tampered QE identity":       {quote: quote, collateral: tamperedQEIdentity, wantErr: attestation.ErrBadSignature},
		"CRL from another issuer":    {quote: quote, collateral: wrongCRLIssuer, wantErr: ErrCollateral},
		"UpToDate not accepted":      {quote: quote, accepted: []string{TCBOutOfDate}, wantErr: ErrTCBStatus},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			roots, now, col := tc.roots, tc.now, tc.collateral
			if roots == nil {
				roots = IntelSGXRootCA()
			}
			if now.IsZero() {
				now = sampleNow
			}
			if col == nil {
				col = sampleCollateral()
			}
			v, err := NewVerifier(VerifierConfig{
				Roots: roots, Collateral: StaticCollateral{Collateral: col}, Now: func() time.Time { return now },
				AcceptedTCBStatuses: tc.accepted,
			})
			if err != nil {
				t.Fatal(err)
			}
			vq, err := v.VerifyQuote(context.Background(), tc.quote)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("VerifyQuote() = %v, want success", err)
				}
				if vq.TCBStatus != TCBUpToDate || vq.QEStatus != TCBUpToDate || len(vq.Warnings) != 0 {
					t.Errorf("VerifyQuote() statuses %q %q warnings %v, want UpToDate and none", vq.TCBStatus, vq.QEStatus, vq.Warnings)
				}
				return
			}
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("VerifyQuote() = %v, want %v", err, tc.wantErr)
			}
		})
	}
}

func replaceOnce(t *testing.T, s, old, new string) string {
	t.Helper()
	for i := 0; i+len(old) <= len(s); i++ {
		if s[i:i+len(old)] == old {
			return s[:i] + new + s[i+len(old):]
		}
	}
	t.Fatalf("%q not found", old)
	return ""
}

func TestSampleQuoteFields(t *testing.T) {
	q, err := ParseQuote(blobs.TDXQuote())
	if err != nil {
		t.Fatalf("ParseQuote() = %v", err)
	}
	if got, want := string(q.Body.ReportData[:28]), "Hello from Edgeless Systems!"; got != want {
		t.Errorf("report data = %q, want %q", got, want)
	}
	if q.QEReport.ISVProdID != 2 || q.QEReport.ISVSVN != 4 {
		t.Errorf("QE report ISVPRODID %d ISVSVN %d, want 2 and 4", q.QEReport.ISVProdID, q.QEReport.ISVSVN)
	}
	m := q.Measurements()
	if m[0] != q.Body.MRTD || m[4] != q.Body.RTMR[3] {
		t.Error("Measurements() does not map 0 to MRTD and 4 to RTMR3")
	}
}

// The sample quote is correctly signed but binds Edgeless Systems' greeting, not Berth's report data: a validator
// must reject it as not bound to its nonce.
func TestValidateSampleQuoteNotBound(t *testing.T) {
	doc, err := (&Document{UserData: []byte("key hash"), Quote: blobs.TDXQuote()}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	val, err := NewValidator(sampleVerifier(t, IntelSGXRootCA(), sampleNow, sampleCollateral()), ExpectMeasurements(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := val.Validate(context.Background(), doc, []byte("nonce")); !errors.Is(err, attestation.ErrNonceMismatch) {
		t.Fatalf("Validate() = %v, want %v", err, attestation.ErrNonceMismatch)
	}
}

// A verifier remembers verified collateral, but only for times in which its signing certificates are valid.
func TestVerifierCollateralMemo(t *testing.T) {
	now := sampleNow
	v, err := NewVerifier(VerifierConfig{Roots: IntelSGXRootCA(), Collateral: StaticCollateral{Collateral: sampleCollateral()}, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, tc := range []struct {
		now     time.Time
		wantErr error
	}{
		{sampleNow, nil},
		{sampleNow, nil},
		{time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC), attestation.ErrUntrustedRoot}, // TCB signing certificate expired
		{time.Date(2023, 3, 1, 0, 0, 0, 0, time.UTC), nil},
		{time.Date(2023, 3, 16, 0, 0, 0, 0, time.UTC), ErrCollateral}, // PCK CRL past nextUpdate, memo still valid
	} {
		now = tc.now
		_, err := v.VerifyQuote(ctx, blobs.TDXQuote())
		if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
			t.Errorf("VerifyQuote() at %s = %v, want %v", now.Format(time.DateOnly), err, tc.wantErr)
		}
	}
	if n := len(v.memo); n != 1 {
		t.Errorf("memo holds %d entries, want 1", n)
	}
}
