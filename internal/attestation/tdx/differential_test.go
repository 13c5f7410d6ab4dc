package tdx_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/edgelesssys/go-tdx-qpl/blobs"
	"github.com/google/go-tdx-guest/abi"
	"github.com/google/go-tdx-guest/pcs"
	guesttest "github.com/google/go-tdx-guest/testing"
	"github.com/google/go-tdx-guest/testing/testdata"
	"github.com/google/go-tdx-guest/validate"
	"github.com/google/go-tdx-guest/verify"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
)

// The differential test runs Berth's verifier and go-tdx-guest's (its verify package, then its validate
// package's fixed-bit checks of TD attributes and XFAM, which is where go-tdx-guest refuses a debuggable TD) on
// the same quotes and collateral, and requires the same verdict, accept or refuse, on every case.
//
// The cases are three sources and every tampered variant Berth's own tests make of them:
//   - go-tdx-qpl's recorded quote and collateral (blobs). No root CA CRL was current at the time that
//     collateral was, and go-tdx-guest checks revocation only with both CRLs, so this source runs without
//     revocation on go-tdx-guest's side and the CRL cases run on the other two;
//   - go-tdx-guest's recorded quote and the PCS responses it ships, root CA CRL included;
//   - the software TD (tdxtest) in each of its shapes: TCB statuses, a revoked PCK certificate and PCK CA,
//     a debuggable TD, validity times around its collateral's.
//
// Berth's verifier is configured as the joinservice configures it by default (only UpToDate accepted, no
// debuggable TDs); go-tdx-guest's default is the same.

// diffCase is one quote with its collateral and trust anchors, judged by both verifiers.
type diffCase struct {
	name string
	// field names what the case changed, for the report of a disagreement.
	field      string
	quote      []byte
	col        *tdx.Collateral
	roots      *x509.CertPool
	now        time.Time
	revocation bool
	// tdAttributes are the TD attributes go-tdx-guest's validate package expects, its way of refusing a
	// debuggable TD (its fixed bits allow DEBUG): the source's own TD's, which are not debuggable.
	tdAttributes []byte
	// accept: both verifiers must accept the case, so that a test refusing everything cannot pass.
	accept bool
}

// source is a quote with collateral valid at now.
type source struct {
	name         string
	quote        []byte
	col          *tdx.Collateral
	roots        *x509.CertPool
	now          time.Time
	revocation   bool
	tdAttributes []byte
	accept       bool
}

func (s source) derive(name, field string, change func(c *diffCase)) diffCase {
	col := *s.col
	c := diffCase{name: s.name + ": " + name, field: field, quote: bytes.Clone(s.quote), col: &col, roots: s.roots, now: s.now,
		revocation: s.revocation, tdAttributes: s.tdAttributes}
	if change != nil {
		change(&c)
	}
	return c
}

// guestTrailer is the text go-tdx-guest appended to its sample quote.
const guestTrailer = "\nextra bytes(only for testing purpose)\n"

// Offsets into a quote (version 4, ECDSA P-256), as Intel's quote format lays it out.
const (
	diffHeaderSize   = 48
	diffOffMRTD      = diffHeaderSize + 136
	diffOffTDAttr    = diffHeaderSize + 120
	diffOffRTMR3     = diffHeaderSize + 472
	diffOffReport    = diffHeaderSize + 520
	diffOffSignature = diffHeaderSize + 584 + 4
	diffOffAttKey    = diffOffSignature + 64
	diffOffQEReport  = diffOffAttKey + 64 + 6
	diffOffQESig     = diffOffQEReport + 384
)

// flipAt returns a copy of b with one bit of byte off changed.
func flipAt(b []byte, off int) []byte {
	out := bytes.Clone(b)
	out[off] ^= 0x01
	return out
}

// bumpJSON changes the first digit (or hex digit) after "key": in a signed collateral body, which its
// signature covers.
func bumpJSON(t *testing.T, body []byte, key string) []byte {
	t.Helper()
	i := bytes.Index(body, []byte(`"`+key+`":`))
	if i < 0 {
		t.Fatalf("no %q in %.80s", key, body)
	}
	out := bytes.Clone(body)
	for j := i + len(key) + 3; j < len(out); j++ {
		switch c := out[j]; {
		case c >= '0' && c <= '8', c >= 'a' && c <= 'e', c >= 'A' && c <= 'E':
			out[j]++
			return out
		case c == '9':
			out[j] = '0'
			return out
		}
	}
	t.Fatalf("no digit after %q", key)
	return nil
}

// tamperedCases are the variants of s that Berth's verifier tests make, each named for the field changed.
func tamperedCases(t *testing.T, s source, other *tdxtest.Platform) []diffCase {
	t.Helper()
	q := func(name, field string, quote func([]byte) []byte) diffCase {
		return s.derive(name, field, func(c *diffCase) { c.quote = quote(c.quote) })
	}
	flip := func(off int) func([]byte) []byte { return func(b []byte) []byte { return flipAt(b, off) } }
	col := func(name, field string, change func(*tdx.Collateral)) diffCase {
		return s.derive(name, field, func(c *diffCase) { change(c.col) })
	}
	cases := []diffCase{
		s.derive("genuine", "", func(c *diffCase) { c.accept = s.accept }),
		q("changed version", "header: version", flip(0)),
		q("other QE vendor", "header: QE vendor ID", flip(12)),
		q("changed TD attributes", "TD quote body: TDATTRIBUTES", flip(diffOffTDAttr)),
		q("changed MRTD", "TD quote body: MRTD", flip(diffOffMRTD)),
		q("changed RTMR3", "TD quote body: RTMR3", flip(diffOffRTMR3)),
		q("changed report data", "TD quote body: REPORTDATA", flip(diffOffReport)),
		q("broken quote signature", "signature", flip(diffOffSignature+5)),
		q("swapped attestation key", "attestation key", flip(diffOffAttKey+63)),
		q("changed QE report", "QE report", flip(diffOffQEReport+300)),
		q("changed QE report data", "QE report: REPORTDATA", flip(diffOffQEReport+320)),
		q("broken QE report signature", "QE report signature", flip(diffOffQESig+1)),
		q("truncated", "length", func(b []byte) []byte { return b[:len(b)-100] }),
		q("header only", "length", func(b []byte) []byte { return b[:diffHeaderSize] }),
		q("garbage", "everything", func([]byte) []byte { return []byte("this is not a quote at all") }),
		q("empty", "everything", func([]byte) []byte { return nil }),
		col("tampered TCB info", "collateral: TCB info body", func(c *tdx.Collateral) {
			c.TCBInfo = bumpJSON(t, c.TCBInfo, "tcbEvaluationDataNumber")
		}),
		col("broken TCB info signature", "collateral: TCB info signature", func(c *tdx.Collateral) {
			c.TCBInfo = bumpJSON(t, c.TCBInfo, "signature")
		}),
		col("tampered QE identity", "collateral: QE identity body", func(c *tdx.Collateral) {
			c.QEIdentity = bumpJSON(t, c.QEIdentity, "isvprodid")
		}),
		col("broken QE identity signature", "collateral: QE identity signature", func(c *tdx.Collateral) {
			c.QEIdentity = bumpJSON(t, c.QEIdentity, "signature")
		}),
		col("TCB info signed by the PCK CA", "collateral: TCB info issuer chain", func(c *tdx.Collateral) {
			c.TCBInfoIssuerChain = c.PCKCRLIssuerChain
		}),
		s.derive("untrusted root", "roots", func(c *diffCase) { c.roots = other.Roots() }),
		col("another platform's collateral", "collateral", func(c *tdx.Collateral) { *c = *other.Collateral() }),
	}
	if s.revocation {
		cases = append(cases,
			col("another platform's PCK CRL", "collateral: PCK CRL", func(c *tdx.Collateral) {
				c.PCKCRL, c.PCKCRLIssuerChain = other.Collateral().PCKCRL, other.Collateral().PCKCRLIssuerChain
			}),
			col("another platform's root CA CRL", "collateral: root CA CRL", func(c *tdx.Collateral) {
				c.RootCACRL = other.Collateral().RootCACRL
			}),
			col("broken PCK CRL signature", "collateral: PCK CRL", func(c *tdx.Collateral) {
				der := crlDER(t, c.PCKCRL)
				c.PCKCRL = flipAt(der, len(der)-2)
			}),
			col("broken root CA CRL signature", "collateral: root CA CRL", func(c *tdx.Collateral) {
				der := crlDER(t, c.RootCACRL)
				c.RootCACRL = flipAt(der, len(der)-2)
			}),
		)
	}
	return cases
}

// crlDER returns a CRL in DER, as go-tdx-guest reads it; Berth's collateral may hold it in PEM.
func crlDER(t *testing.T, b []byte) []byte {
	t.Helper()
	if block, _ := pem.Decode(b); block != nil {
		return block.Bytes
	}
	return b
}

// diffSources returns the recorded samples and the software TD, with collateral valid at their times.
func diffSources(t *testing.T) (sources []source, software *tdxtest.Platform, other *tdxtest.Platform) {
	t.Helper()
	software, other = newPlatform(t, tdxtest.Options{}), newPlatform(t, tdxtest.Options{})
	genuine, err := software.Quote([tdx.ReportDataSize]byte{1, 2, 3})
	if err != nil {
		t.Fatal(err)
	}
	// go-tdx-guest's sample quote ends in a line of text appended for its tests: Berth refuses bytes after the
	// signature data, go-tdx-guest ignores them. The cases take the quote without them, so that both look
	// further; the quote as shipped is one case of its own.
	guestQuote := testdata.RawQuote[:len(testdata.RawQuote)-len(guestTrailer)]
	if !bytes.HasSuffix(testdata.RawQuote, []byte(guestTrailer)) {
		t.Fatalf("go-tdx-guest's sample quote does not end in %q", guestTrailer)
	}
	tdAttributes := func(quote []byte) []byte { return quote[diffOffTDAttr : diffOffTDAttr+8] }
	return []source{
		{name: "go-tdx-qpl sample", quote: blobs.TDXQuote(), col: sampleCollateralExternal(), roots: tdx.IntelSGXRootCA(), now: blobs.PCSIssueDate,
			tdAttributes: tdAttributes(blobs.TDXQuote()), accept: true},
		{name: "go-tdx-guest sample", quote: guestQuote, col: guestSampleCollateral(t), roots: tdx.IntelSGXRootCA(),
			now: time.Date(2023, time.July, 1, 1, 0, 0, 0, time.UTC), revocation: true, tdAttributes: tdAttributes(guestQuote)},
		{name: "software TD", quote: genuine, col: software.Collateral(), roots: software.Roots(), now: testNow, revocation: true,
			tdAttributes: tdAttributes(genuine), accept: true},
	}, software, other
}

// guestSampleCollateral is go-tdx-guest's recorded PCS responses as Berth's collateral.
func guestSampleCollateral(t *testing.T) *tdx.Collateral {
	t.Helper()
	chain := func(url string, phrase string) []byte {
		resp, ok := guesttest.TestGetter.Responses[url]
		if !ok {
			t.Fatalf("go-tdx-guest's sample has no response for %s", url)
		}
		pemText, err := unescapeChain(resp.Header[phrase])
		if err != nil {
			t.Fatal(err)
		}
		return pemText
	}
	return &tdx.Collateral{
		PCKCRL:                testdata.PckCrlBody,
		PCKCRLIssuerChain:     chain(pcs.PckCrlURL("platform"), pcs.SgxPckCrlIssuerChainPhrase),
		RootCACRL:             testdata.RootCrlBody,
		TCBInfo:               testdata.TcbInfoBody,
		TCBInfoIssuerChain:    chain(pcs.TcbInfoURL("50806f000000"), pcs.TcbInfoIssuerChainPhrase),
		QEIdentity:            testdata.QeIdentityBody,
		QEIdentityIssuerChain: chain(pcs.QeIdentityURL(), pcs.SgxQeIdentityIssuerChainPhrase),
	}
}

func unescapeChain(header []string) ([]byte, error) {
	if len(header) != 1 {
		return nil, fmt.Errorf("issuer chain header has %d values", len(header))
	}
	s, err := url.QueryUnescape(header[0])
	return []byte(s), err
}

// pcsResponses serves Berth's collateral to go-tdx-guest the way an Intel PCS would: by URL, with the issuer
// chains URL-encoded in the response headers. Any other URL is the root CA CRL's distribution point.
type pcsResponses struct {
	col *tdx.Collateral
}

func (p pcsResponses) Get(u string) (map[string][]string, []byte, error) {
	return p.GetContext(context.Background(), u)
}

func (p pcsResponses) GetContext(_ context.Context, u string) (map[string][]string, []byte, error) {
	header := func(phrase string, chain []byte) map[string][]string {
		return map[string][]string{phrase: {url.QueryEscape(string(chain))}}
	}
	switch {
	case strings.HasPrefix(u, pcs.TdxBaseURL+"/tcb?"):
		return header(pcs.TcbInfoIssuerChainPhrase, p.col.TCBInfoIssuerChain), p.col.TCBInfo, nil
	case u == pcs.QeIdentityURL():
		return header(pcs.SgxQeIdentityIssuerChainPhrase, p.col.QEIdentityIssuerChain), p.col.QEIdentity, nil
	case strings.HasPrefix(u, pcs.SgxBaseURL+"/pckcrl?"):
		return header(pcs.SgxPckCrlIssuerChainPhrase, p.col.PCKCRLIssuerChain), derOf(p.col.PCKCRL), nil
	case p.col.RootCACRL != nil:
		return nil, derOf(p.col.RootCACRL), nil
	}
	return nil, nil, fmt.Errorf("404: %s", u)
}

func derOf(b []byte) []byte {
	if block, _ := pem.Decode(b); block != nil {
		return block.Bytes
	}
	return b
}

// berthVerdict is Berth's verifier's judgement, nil for accepted.
func berthVerdict(t *testing.T, c diffCase) error {
	t.Helper()
	v, err := tdx.NewVerifier(tdx.VerifierConfig{
		Roots: c.roots, Collateral: tdx.StaticCollateral{Collateral: c.col}, Now: func() time.Time { return c.now },
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = v.VerifyQuote(context.Background(), c.quote)
	return err
}

// guestVerdict is go-tdx-guest's judgement, nil for accepted.
func guestVerdict(c diffCase) error {
	times := &verify.TimeSet{PckCertChain: c.now, TcbInfo: c.now, QeIdentity: c.now, PckCrl: c.now, RootCaCrl: c.now}
	opts := &verify.Options{
		GetCollateral: true, CheckRevocations: c.revocation, Getter: pcsResponses{col: c.col}, Now: times, TrustedRoots: c.roots,
	}
	if err := verify.RawTdxQuoteContext(context.Background(), c.quote, opts); err != nil {
		return err
	}
	quote, err := abi.QuoteToProto(c.quote)
	if err != nil {
		return err
	}
	return validate.TdxQuote(quote, &validate.Options{TdQuoteBodyOptions: validate.TdQuoteBodyOptions{TdAttributes: c.tdAttributes}})
}

// diffCases returns every case: the tampered variants of each source, and the software TD's shapes.
func diffCases(t *testing.T) []diffCase {
	t.Helper()
	sources, software, other := diffSources(t)
	var cases []diffCase
	for _, s := range sources {
		cases = append(cases, tamperedCases(t, s, other)...)
	}
	sw := sources[2]
	for _, shape := range []struct {
		name, field string
		opts        tdxtest.Options
	}{
		{"TCB OutOfDate", "TCB info: tcbStatus", tdxtest.Options{TCBStatus: tdx.TCBOutOfDate}},
		{"TCB SWHardeningNeeded", "TCB info: tcbStatus", tdxtest.Options{TCBStatus: tdx.TCBSWHardeningNeeded}},
		{"TCB ConfigurationNeeded", "TCB info: tcbStatus", tdxtest.Options{TCBStatus: tdx.TCBConfigurationNeeded}},
		{"TCB ConfigurationAndSWHardeningNeeded", "TCB info: tcbStatus", tdxtest.Options{TCBStatus: tdx.TCBConfigurationAndSWHardeningNeeded}},
		{"TCB OutOfDateConfigurationNeeded", "TCB info: tcbStatus", tdxtest.Options{TCBStatus: tdx.TCBOutOfDateConfigurationNeeded}},
		{"TCB Revoked", "TCB info: tcbStatus", tdxtest.Options{TCBStatus: tdx.TCBRevoked}},
		{"PCK certificate revoked", "PCK CRL: revoked serials", tdxtest.Options{RevokePCK: true}},
		{"PCK CA revoked", "root CA CRL: revoked serials", tdxtest.Options{RevokePCKCA: true}},
		{"debuggable TD", "TD quote body: TDATTRIBUTES.DEBUG", tdxtest.Options{Debug: true}},
	} {
		p := newPlatform(t, shape.opts)
		quote, err := p.Quote([tdx.ReportDataSize]byte{1, 2, 3})
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, diffCase{name: "software TD: " + shape.name, field: shape.field, quote: quote, col: p.Collateral(),
			roots: p.Roots(), now: testNow, revocation: true, tdAttributes: sw.tdAttributes})
	}
	for _, at := range []struct {
		name  string
		field string
		now   time.Time
	}{
		{"collateral expired", "TCB info, QE identity, CRLs: nextUpdate", testNow.Add(31 * 24 * time.Hour)},
		{"PCK chain expired", "PCK certificates: notAfter", testNow.Add(366 * 24 * time.Hour)},
		{"before the PCK chain", "PCK certificates: notBefore", testNow.Add(-25 * time.Hour)},
		{"far future", "everything: validity", time.Date(2053, 7, 1, 0, 0, 0, 0, time.UTC)},
	} {
		cases = append(cases, sw.derive(at.name, at.field, func(c *diffCase) { c.now = at.now }))
	}
	guest := sources[1]
	cases = append(cases, guest.derive("as shipped, with its trailing text", "length", func(c *diffCase) { c.quote = testdata.RawQuote }))
	_ = software
	return cases
}

// TestDifferentialGoTDXGuest: Berth's verifier and go-tdx-guest's agree, accept or refuse, on every case.
// A disagreement names the case, the field it changed, and both verdicts.
func TestDifferentialGoTDXGuest(t *testing.T) {
	cases := diffCases(t)
	accepted, refused := 0, 0
	for _, c := range cases {
		berthErr, guestErr := berthVerdict(t, c), guestVerdict(c)
		if testing.Verbose() {
			t.Logf("case %q: Berth %s; go-tdx-guest %s", c.name, verdict(berthErr), verdict(guestErr))
		}
		if (berthErr == nil) != (guestErr == nil) {
			t.Errorf("case %q (field: %s): Berth %s, go-tdx-guest %s", c.name, c.field, verdict(berthErr), verdict(guestErr))
			continue
		}
		if c.accept && berthErr != nil {
			t.Errorf("case %q: both refuse (Berth: %v), want both to accept", c.name, berthErr)
		}
		if berthErr == nil {
			accepted++
		} else {
			refused++
		}
	}
	t.Logf("%d cases: both verifiers accepted %d and refused %d", len(cases), accepted, refused)
}

func verdict(err error) string {
	if err == nil {
		return "accepts"
	}
	return "refuses (" + err.Error() + ")"
}

// TestDifferentialKnownDifferences: where Berth's verifier is deliberately stricter than go-tdx-guest's, it
// refuses with its named error what go-tdx-guest accepts. None of them lets a forged quote through
// go-tdx-guest: each is a quote or collateral that is genuine but inconsistent. The test keeps the list honest:
// a difference that goes away, or one that turns around, fails it.
func TestDifferentialKnownDifferences(t *testing.T) {
	sources, _, _ := diffSources(t)
	sw := sources[2]
	for _, d := range []struct {
		c       diffCase
		wantErr error
		why     string
	}{{
		c: sw.derive("bytes after the signature data", "length", func(c *diffCase) {
			c.quote = append(c.quote, guestTrailer...)
		}),
		wantErr: attestation.ErrMalformed,
		why:     "Berth parses a quote whole; go-tdx-guest ignores what follows the signature data",
	}, {
		c:       sw.derive("collateral not yet issued", "TCB info, QE identity, CRLs: issueDate and thisUpdate", func(c *diffCase) { c.now = testNow.Add(-90 * time.Minute) }),
		wantErr: tdx.ErrCollateral,
		why:     "Berth checks collateral's issue times; go-tdx-guest only its next update",
	}, {
		c: sw.derive("PCK CRL with another issuer chain", "collateral: PCK CRL issuer chain", func(c *diffCase) {
			c.col.PCKCRLIssuerChain = c.col.TCBInfoIssuerChain
		}),
		wantErr: tdx.ErrCollateral,
		why:     "Berth checks the PCK CRL against the chain the collateral names; go-tdx-guest against the quote's PCK CA and ignores that chain",
	}} {
		berthErr, guestErr := berthVerdict(t, d.c), guestVerdict(d.c)
		if !errors.Is(berthErr, d.wantErr) || guestErr != nil {
			t.Errorf("case %q (field: %s): Berth %s, go-tdx-guest %s; want Berth to refuse with %v and go-tdx-guest to accept (%s)",
				d.c.name, d.c.field, verdict(berthErr), verdict(guestErr), d.wantErr, d.why)
			continue
		}
		t.Logf("known difference %q: Berth refuses (%v), go-tdx-guest accepts: %s", d.c.name, berthErr, d.why)
	}
}
