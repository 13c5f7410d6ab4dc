package vtpmtest_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testPCRs returns 24 distinct SHA-256 PCR values.
func testPCRs() map[uint32][]byte {
	out := map[uint32][]byte{}
	for i := uint32(0); i < 24; i++ {
		v := sha256.Sum256([]byte{byte(i)})
		out[i] = v[:]
	}
	return out
}

// newSoft returns a SoftTPM with testPCRs and the CA its EK certificate comes from.
func newSoft(tb testing.TB) (*vtpmtest.SoftTPM, *vtpmtest.CA) {
	tb.Helper()
	ca, err := vtpmtest.NewCA("soft EK CA")
	if err != nil {
		tb.Fatal(err)
	}
	s, err := vtpmtest.NewSoftTPM(ca, testPCRs())
	if err != nil {
		tb.Fatalf("NewSoftTPM: %v", err)
	}
	return s, ca
}

// validator returns a vtpm.Validator trusting rootPEM with expectations given as YAML lines.
func validator(tb testing.TB, rootPEM []byte, measurements string) *vtpm.Validator {
	tb.Helper()
	var b strings.Builder
	b.WriteString("variant: tpm\n")
	if measurements != "" {
		b.WriteString("measurements:\n" + measurements)
	}
	b.WriteString("trustRoots:\n  - pem: |\n")
	for _, line := range strings.Split(strings.TrimSpace(string(rootPEM)), "\n") {
		b.WriteString("      " + line + "\n")
	}
	p, err := policy.Parse([]byte(b.String()), "soft-policy.yaml", nil)
	if err != nil {
		tb.Fatalf("parsing policy: %v\n%s", err, b.String())
	}
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

// expect returns policy lines expecting value at PCR idx.
func expect(idx uint32, value []byte) string {
	return fmt.Sprintf("  %d: {expected: %q}\n", idx, hex.EncodeToString(value))
}

func TestSoftTPMValidates(t *testing.T) {
	ctx := context.Background()
	s, ca := newSoft(t)
	pcrs := testPCRs()
	v := validator(t, ca.PEM(), expect(0, pcrs[0])+expect(7, pcrs[7]))
	userData, nonce := []byte("tls key hash"), []byte("nonce-0123456789abcdef0123456789")

	raw, err := s.Issue(ctx, userData, nonce)
	if err != nil {
		t.Fatalf("Issue: %v", err)
	}
	res, err := v.Validate(ctx, raw, nonce)
	if err != nil {
		t.Fatalf("Validate: %v", err)
	}
	if res.Variant != vtpm.Variant || s.Variant() != vtpm.Variant || !bytes.Equal(res.UserData, userData) {
		t.Fatalf("result variant %q, user data %q", res.Variant, res.UserData)
	}
	claims, err := s.Claims(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Measurements) != 24 || len(claims) != 24 {
		t.Fatalf("%d measurements, %d claims, want 24", len(res.Measurements), len(claims))
	}
	for idx, want := range pcrs {
		if !bytes.Equal(res.Measurements[idx], want) || !bytes.Equal(claims[idx], want) {
			t.Fatalf("PCR %d: measured %x, claimed %x, want %x", idx, res.Measurements[idx], claims[idx], want)
		}
	}
	// Claims is a copy.
	claims[0][0] ^= 1
	if again, _ := s.Claims(ctx); !bytes.Equal(again[0], pcrs[0]) {
		t.Fatal("Claims returned the SoftTPM's own PCR storage")
	}

	// The document looks like a TPM's: EK from the TCG template, AK from the Issuer's template.
	var doc vtpm.Document
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	ek, err := tpm2.Unmarshal[tpm2.TPMTPublic](doc.EKPublic)
	if err != nil {
		t.Fatal(err)
	}
	if ek.ObjectAttributes != tpm2.RSAEKTemplate.ObjectAttributes || !bytes.Equal(ek.AuthPolicy.Buffer, tpm2.RSAEKTemplate.AuthPolicy.Buffer) {
		t.Fatalf("EK attributes %+v differ from the TCG EK template", ek.ObjectAttributes)
	}
	if len(doc.EventLog) != 0 {
		t.Fatal("document carries an event log")
	}

	// Each Issue signs a fresh quote.
	raw2, err := s.Issue(ctx, userData, nonce)
	if err != nil {
		t.Fatal(err)
	}
	var doc2 vtpm.Document
	if err := json.Unmarshal(raw2, &doc2); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(doc.QuoteSignature, doc2.QuoteSignature) {
		t.Fatal("two Issue calls returned the same quote signature")
	}
	if _, err := v.Validate(ctx, raw2, nonce); err != nil {
		t.Fatalf("Validate second document: %v", err)
	}
}

func TestSoftTPMSetPCRs(t *testing.T) {
	ctx := context.Background()
	s, ca := newSoft(t)
	changed := sha256.Sum256([]byte("changed"))
	v := validator(t, ca.PEM(), expect(4, changed[:]))
	nonce := []byte("nonce")
	raw, err := s.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Validate(ctx, raw, nonce); !errors.Is(err, attestation.ErrMeasurementMismatch) {
		t.Fatalf("before SetPCRs: %v, want ErrMeasurementMismatch", err)
	}
	// Fewer PCRs than before: the quote selects exactly those it holds.
	s.SetPCRs(map[uint32][]byte{4: changed[:], 17: make([]byte, 32)})
	raw, err = s.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	res, err := v.Validate(ctx, raw, nonce)
	if err != nil {
		t.Fatalf("after SetPCRs: %v", err)
	}
	if len(res.Measurements) != 2 {
		t.Fatalf("%d measurements, want 2", len(res.Measurements))
	}
	if _, err := vtpmtest.NewSoftTPM(nil, map[uint32][]byte{24: make([]byte, 32)}); err == nil {
		t.Fatal("NewSoftTPM accepted PCR 24")
	}
}

func TestSoftTPMRejected(t *testing.T) {
	ctx := context.Background()
	s, ca := newSoft(t)
	otherCA, err := vtpmtest.NewCA("someone else's EK CA")
	if err != nil {
		t.Fatal(err)
	}
	nonce := []byte("nonce-1")
	raw, err := s.Issue(ctx, []byte("user"), nonce)
	if err != nil {
		t.Fatal(err)
	}
	testCases := map[string]struct {
		v       *vtpm.Validator
		nonce   []byte
		wantErr error
	}{
		"EK CA not trusted":    {v: validator(t, otherCA.PEM(), ""), nonce: nonce, wantErr: attestation.ErrUntrustedRoot},
		"measurement mismatch": {v: validator(t, ca.PEM(), expect(0, make([]byte, 32))), nonce: nonce, wantErr: attestation.ErrMeasurementMismatch},
		"replayed for a nonce": {v: validator(t, ca.PEM(), ""), nonce: []byte("nonce-2"), wantErr: attestation.ErrNonceMismatch},
		"accepted (reference)": {v: validator(t, ca.PEM(), ""), nonce: nonce},
		"empty nonce (replay)": {v: validator(t, ca.PEM(), ""), nonce: nil, wantErr: attestation.ErrNonceMismatch},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			res, err := tc.v.Validate(ctx, raw, tc.nonce)
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("got %v, want %v", err, tc.wantErr)
			}
			if err == nil && !bytes.Equal(res.UserData, []byte("user")) {
				t.Fatalf("user data %q", res.UserData)
			}
		})
	}

	// A document whose EK certificate belongs to another SoftTPM of the same CA.
	other, err := vtpmtest.NewSoftTPM(ca, testPCRs())
	if err != nil {
		t.Fatal(err)
	}
	otherRaw, err := other.Issue(ctx, []byte("user"), nonce)
	if err != nil {
		t.Fatal(err)
	}
	var doc, otherDoc vtpm.Document
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(otherRaw, &otherDoc); err != nil {
		t.Fatal(err)
	}
	doc.EKCert = otherDoc.EKCert
	swapped, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validator(t, ca.PEM(), "").Validate(ctx, swapped, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("EK certificate of another TPM: %v, want ErrUntrustedRoot", err)
	}
}

func TestSoftTPMActivation(t *testing.T) {
	ctx := context.Background()
	s, ca := newSoft(t)
	v := validator(t, ca.PEM(), "")
	id, err := s.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	challenge, secret, validate, err := v.Challenge(id)
	if err != nil {
		t.Fatalf("Challenge: %v", err)
	}
	if challenge == nil {
		t.Fatal("a fresh validator did not challenge")
	}
	got, err := s.Activate(ctx, challenge)
	if err != nil {
		t.Fatalf("Activate: %v", err)
	}
	if !bytes.Equal(got, secret) {
		t.Fatalf("recovered %x, want %x", got, secret)
	}

	// Without the secret the attester cannot quote over the nonce the validator expects.
	nonce := []byte("handshake nonce")
	mixed := sha256.Sum256(append(append([]byte("test mix\x00"), nonce...), secret...))
	plain, err := s.Issue(ctx, []byte("user"), nonce)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validate(ctx, plain, mixed[:]); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("document without the secret: %v, want ErrUntrustedRoot", err)
	}
	// Another attester's document does not pass for the challenged identity.
	other, err := vtpmtest.NewSoftTPM(ca, testPCRs())
	if err != nil {
		t.Fatal(err)
	}
	otherDoc, err := other.Issue(ctx, []byte("user"), mixed[:])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validate(ctx, otherDoc, mixed[:]); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("another attester's document: %v, want ErrUntrustedRoot", err)
	}
	doc, err := s.Issue(ctx, []byte("user"), mixed[:])
	if err != nil {
		t.Fatal(err)
	}
	res, err := validate(ctx, doc, mixed[:])
	if err != nil {
		t.Fatalf("validating activated document: %v", err)
	}
	if !bytes.Equal(res.UserData, []byte("user")) || len(res.Measurements) != 24 {
		t.Fatalf("result %+v", res)
	}
	// The validator remembers the activated key pair.
	if again, _, _, err := v.Challenge(id); err != nil || again != nil {
		t.Fatalf("second challenge %x, %v; want none", again, err)
	}
}

func TestSoftTPMActivateRejects(t *testing.T) {
	ctx := context.Background()
	s, ca := newSoft(t)
	other, err := vtpmtest.NewSoftTPM(ca, nil)
	if err != nil {
		t.Fatal(err)
	}
	id, err := s.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	otherID, err := other.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Identities are (size, EK public) (size, AK name); splice s's EK with the other AK's name.
	ekLen := int(id[0])<<8 | int(id[1])
	otherEKLen := int(otherID[0])<<8 | int(otherID[1])
	otherAKName := otherID[2+otherEKLen+2:]
	spliced := vtpm.MarshalIdentity(id[2:2+ekLen], otherAKName)

	challengeFor := func(identity []byte) []byte {
		t.Helper()
		c, _, _, err := validator(t, ca.PEM(), "").Challenge(identity)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	good := challengeFor(id)
	tamper := func(at int) []byte {
		c := bytes.Clone(good)
		c[at] ^= 0x01
		return c
	}
	blobLen := int(good[0])<<8 | int(good[1])
	testCases := map[string]struct {
		challenge []byte
		wantErr   error
	}{
		"for another AK name":        {challenge: challengeFor(spliced), wantErr: vtpmtest.ErrBadCredential},
		"for another EK":             {challenge: challengeFor(otherID), wantErr: vtpmtest.ErrBadCredential},
		"integrity HMAC tampered":    {challenge: tamper(2 + 2 + 5), wantErr: vtpmtest.ErrBadCredential},
		"encrypted credential flips": {challenge: tamper(2 + 2 + 32 + 1), wantErr: vtpmtest.ErrBadCredential},
		"encrypted seed tampered":    {challenge: tamper(2 + blobLen + 2 + 7), wantErr: vtpmtest.ErrBadCredential},
		"truncated":                  {challenge: good[:len(good)-1], wantErr: attestation.ErrMalformed},
		"empty":                      {challenge: nil, wantErr: attestation.ErrMalformed},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			secret, err := s.Activate(ctx, tc.challenge)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("got secret %x, error %v; want %v", secret, err, tc.wantErr)
			}
		})
	}
}

// TestSoftTPMAttestedTLS runs attested TLS handshakes with key activation over loopback, with the
// SoftTPM attesting as client and as server to a vtpm.Validator.
func TestSoftTPMAttestedTLS(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, ca := newSoft(t)

	t.Run("client attests", func(t *testing.T) {
		v := validator(t, ca.PEM(), "")
		verdicts := make(chan error, 4)
		evidence := make(chan atls.Evidence, 4)
		srv, err := atls.NewServerConfig(nil, v, atls.WithObserver(func(ev atls.Evidence, err error) {
			evidence <- ev
			verdicts <- err
		}))
		if err != nil {
			t.Fatal(err)
		}
		addr := atlstest.ServeTLS(t, srv)
		cfg, err := atls.NewClientConfig(ctx, s, nil)
		if err != nil {
			t.Fatal(err)
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		tc := tls.Client(c, cfg)
		defer tc.Close()
		if err := tc.HandshakeContext(ctx); err != nil {
			t.Fatalf("client handshake: %v", err)
		}
		// The server checks a TLS 1.3 client certificate after the client's handshake returned; the
		// observer reports its verdict.
		if _, err := tc.Write([]byte{0}); err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("writing: %v", err)
		}
		var ev atls.Evidence
		select {
		case ev = <-evidence:
		case <-ctx.Done():
			t.Fatal("server never validated the client")
		}
		if err := <-verdicts; err != nil {
			t.Fatalf("server verdict: %v", err)
		}
		if !ev.Activated || ev.Variant != vtpm.Variant || len(ev.Result.Measurements) != 24 {
			t.Fatalf("server saw evidence activated=%v variant=%q with %d measurements", ev.Activated, ev.Variant, len(ev.Result.Measurements))
		}
	})

	t.Run("server attests", func(t *testing.T) {
		v := validator(t, ca.PEM(), "")
		srv, err := atls.NewServerConfig(s, nil)
		if err != nil {
			t.Fatal(err)
		}
		addr := atlstest.ServeTLS(t, srv)
		var d net.Dialer
		for i := range 2 {
			var ev atls.Evidence
			conn, err := atls.Dial(ctx, &d, addr, nil, v, atls.WithObserver(func(e atls.Evidence, _ error) { ev = e }))
			if err != nil {
				t.Fatalf("handshake %d: %v", i, err)
			}
			conn.Close()
			if !ev.Activated || len(ev.Result.Measurements) != 24 {
				t.Fatalf("handshake %d: evidence activated=%v with %d measurements", i, ev.Activated, len(ev.Result.Measurements))
			}
		}
	})

	t.Run("rejected by policy", func(t *testing.T) {
		v := validator(t, ca.PEM(), expect(0, make([]byte, 32)))
		srv, err := atls.NewServerConfig(s, nil)
		if err != nil {
			t.Fatal(err)
		}
		addr := atlstest.ServeTLS(t, srv)
		var d net.Dialer
		var verdict error
		conn, err := atls.Dial(ctx, &d, addr, nil, v, atls.WithObserver(func(_ atls.Evidence, err error) { verdict = err }))
		if err == nil {
			conn.Close()
			t.Fatal("handshake succeeded although the policy rejects the measurements")
		}
		if !errors.Is(verdict, attestation.ErrMeasurementMismatch) {
			t.Fatalf("verdict %v, want ErrMeasurementMismatch", verdict)
		}
	})
}

// TestSoftTPMConcurrent exercises every method from several goroutines (run with -race).
func TestSoftTPMConcurrent(t *testing.T) {
	ctx := context.Background()
	s, ca := newSoft(t)
	v := validator(t, ca.PEM(), "")
	id, err := s.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 4 {
				nonce := []byte(fmt.Sprintf("nonce %d %d", w, i))
				raw, err := s.Issue(ctx, nil, nonce)
				if err == nil {
					_, err = v.Validate(ctx, raw, nonce)
				}
				if err != nil {
					errs <- fmt.Errorf("issue/validate: %w", err)
				}
				// v never validates through the returned function, so it challenges every time.
				challenge, secret, _, err := v.Challenge(id)
				if err != nil {
					errs <- err
					continue
				}
				if got, err := s.Activate(ctx, challenge); err != nil || !bytes.Equal(got, secret) {
					errs <- fmt.Errorf("activate: %x, %w", got, err)
				}
				pcrs := testPCRs()
				pcrs[uint32(i)] = make([]byte, 32)
				s.SetPCRs(pcrs)
				if _, err := s.Claims(ctx); err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func BenchmarkNewSoftTPM(b *testing.B) {
	ca, err := vtpmtest.NewCA("bench EK CA")
	if err != nil {
		b.Fatal(err)
	}
	pcrs := testPCRs()
	for b.Loop() {
		if _, err := vtpmtest.NewSoftTPM(ca, pcrs); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSoftTPMIssue(b *testing.B) {
	s, _ := newSoft(b)
	ctx := context.Background()
	userData, nonce := make([]byte, 32), make([]byte, 32)
	for b.Loop() {
		if _, err := s.Issue(ctx, userData, nonce); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSoftTPMActivate(b *testing.B) {
	s, ca := newSoft(b)
	ctx := context.Background()
	id, err := s.Identity(ctx)
	if err != nil {
		b.Fatal(err)
	}
	challenge, _, _, err := validator(b, ca.PEM(), "").Challenge(id)
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := s.Activate(ctx, challenge); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSoftTPMValidate is the validator's cost per SoftTPM document, for comparison.
func BenchmarkSoftTPMValidate(b *testing.B) {
	s, ca := newSoft(b)
	ctx := context.Background()
	v := validator(b, ca.PEM(), "")
	nonce := make([]byte, 32)
	raw, err := s.Issue(ctx, nil, nonce)
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := v.Validate(ctx, raw, nonce); err != nil {
			b.Fatal(err)
		}
	}
}

// forgedCA is a CA that claims ca's name and key ID (its certificate's Subject and SubjectKeyId)
// under a key of its own: what an attacker makes to pass for a trusted EK issuer.
func forgedCA(t testing.TB, ca *vtpmtest.CA) *vtpmtest.CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := *ca.Cert
	tmpl.PublicKey, tmpl.Raw, tmpl.RawSubjectPublicKeyInfo = nil, nil, nil
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, &tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(cert.RawSubject, ca.Cert.RawSubject) || !bytes.Equal(cert.SubjectKeyId, ca.Cert.SubjectKeyId) {
		t.Fatal("the forged CA does not claim the trusted CA's name and key ID")
	}
	return &vtpmtest.CA{Cert: cert, Key: key}
}

// TestValidatorRefusesForgedEKIssuer: a validator refuses an EK certificate from another CA and from
// one that forges the trusted issuer's name and key ID, before and after it verified chains of the
// genuine issuer for new TPMs.
func TestValidatorRefusesForgedEKIssuer(t *testing.T) {
	ctx := context.Background()
	ca, err := vtpmtest.NewCA("soft EK CA")
	if err != nil {
		t.Fatal(err)
	}
	other, err := vtpmtest.NewCA("another EK CA")
	if err != nil {
		t.Fatal(err)
	}
	nonce := make([]byte, 32)
	doc := func(ca *vtpmtest.CA) []byte {
		s, err := vtpmtest.NewSoftTPM(ca, testPCRs())
		if err != nil {
			t.Fatal(err)
		}
		raw, err := s.Issue(ctx, nil, nonce)
		if err != nil {
			t.Fatal(err)
		}
		return raw
	}
	forged, untrusted := doc(forgedCA(t, ca)), doc(other)
	v := validator(t, ca.PEM(), "")
	refused := func(when string) {
		t.Helper()
		for name, raw := range map[string][]byte{"forged issuer": forged, "untrusted issuer": untrusted} {
			if _, err := v.Validate(ctx, raw, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
				t.Errorf("%s, %s: %v, want ErrUntrustedRoot", name, when, err)
			}
		}
	}
	refused("before any chain verified")
	for i := range 3 {
		if _, err := v.Validate(ctx, doc(ca), nonce); err != nil {
			t.Fatalf("TPM %d of the trusted CA: %v", i, err)
		}
	}
	refused("after chains of the genuine issuer verified")
}

// BenchmarkSoftTPMValidateNewNode is a validator's first contact with a TPM whose EK issuer it has
// met before: each document comes from a TPM it has never seen, all under one CA. (The EK chain is
// one signature check; x509's chain building around it measured nothing worth caching.)
func BenchmarkSoftTPMValidateNewNode(b *testing.B) {
	ctx := context.Background()
	ca, err := vtpmtest.NewCA("bench EK CA")
	if err != nil {
		b.Fatal(err)
	}
	v := validator(b, ca.PEM(), "")
	nonce := make([]byte, 32)
	docs := make([][]byte, 0, 64)
	for range cap(docs) {
		s, err := vtpmtest.NewSoftTPM(ca, testPCRs())
		if err != nil {
			b.Fatal(err)
		}
		raw, err := s.Issue(ctx, nil, nonce)
		if err != nil {
			b.Fatal(err)
		}
		docs = append(docs, raw)
	}
	if _, err := v.Validate(ctx, docs[0], nonce); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := range b.N {
		if i > 0 && i%(len(docs)-1) == 0 {
			b.StopTimer()
			v = validator(b, ca.PEM(), "") // forget the identities
			if _, err := v.Validate(ctx, docs[0], nonce); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
		if _, err := v.Validate(ctx, docs[1+i%(len(docs)-1)], nonce); err != nil {
			b.Fatal(err)
		}
	}
}
