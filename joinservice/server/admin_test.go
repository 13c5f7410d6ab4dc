package server

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// adminLimits let a test make many calls from one address.
var adminLimits = atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 16}

// clock is a settable clock for the server's nonces.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); defer c.mu.Unlock(); c.t = c.t.Add(d) }

// startAdmin serves a joinservice without attestation on loopback, on clk's time.
func startAdmin(t *testing.T, clk *clock, opts ...Option) joinproto.JoinServiceClient {
	t.Helper()
	srv := newServer(t, nil, nil, append([]Option{WithLimits(adminLimits)}, opts...)...)
	srv.now = clk.now
	return serveInsecure(t, srv)
}

func publicKeyDER(t testing.TB) []byte {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// adminRequest asks c for a nonce and builds a request proved with keys.
func adminRequest(t *testing.T, c joinproto.JoinServiceClient, keys *clusterkeys.Keys, pub []byte, seconds int64) *joinproto.IssueAdminCredentialRequest {
	t.Helper()
	ch, err := c.AdminChallenge(context.Background(), &joinproto.AdminChallengeRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return &joinproto.IssueAdminCredentialRequest{Nonce: ch.GetNonce(), PublicKey: pub, ValiditySeconds: seconds,
		Proof: keys.AdminProof(ch.GetNonce(), pub, seconds)}
}

func TestAdminCredentialForTheMasterSecret(t *testing.T) {
	clk := &clock{t: time.Now()}
	j := &journal{}
	c := startAdmin(t, clk, WithJournal(j))
	pub := publicKeyDER(t)
	resp, err := c.IssueAdminCredential(context.Background(), adminRequest(t, c, testKeys(), pub, 3600))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(resp.GetCertificate())
	if b == nil {
		t.Fatal("the certificate is not PEM")
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	gotPub, _ := x509.MarshalPKIXPublicKey(cert.PublicKey)
	if !bytes.Equal(gotPub, pub) || cert.Subject.CommonName != ca.AdminUser || len(cert.Subject.Organization) != 1 || cert.Subject.Organization[0] != ca.AdminGroup {
		t.Fatalf("certificate for %s in %v", cert.Subject.CommonName, cert.Subject.Organization)
	}
	// Not valid longer than asked, not much shorter, and only for client authentication.
	if d := cert.NotAfter.Sub(clk.now()); d > time.Hour || d < time.Hour-2*time.Second {
		t.Errorf("valid for %s from now, want 1h", d)
	}
	if len(cert.ExtKeyUsage) != 1 || cert.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth || cert.IsCA {
		t.Errorf("key usage %v, CA %v", cert.ExtKeyUsage, cert.IsCA)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(resp.GetClusterCaCert()) {
		t.Fatal("no cluster CA in the response")
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: clk.now(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("the certificate does not chain to the cluster CA: %v", err)
	}
	if resp.GetApiServerEndpoint() != "198.51.100.10:6443" {
		t.Errorf("API server endpoint %q", resp.GetApiServerEndpoint())
	}
	es := j.all()
	if len(es) != 1 || es[0].RPC != rpcAdmin || es[0].Outcome != ledger.OutcomeAccepted || es[0].Kind != joinledger.KindAccepted ||
		!strings.Contains(es[0].Message, cert.SerialNumber.Text(16)) {
		t.Fatalf("ledger %+v, want the issued credential with serial %x", es, cert.SerialNumber)
	}
}

func TestAdminCredentialRefusals(t *testing.T) {
	clk := &clock{t: time.Now()}
	j := &journal{}
	c := startAdmin(t, clk, WithJournal(j))
	ctx := context.Background()
	keys := testKeys()
	wrong, _ := clusterkeys.New(bytes.Repeat([]byte{7}, 32), bytes.Repeat([]byte{2}, 32))
	pub, other := publicKeyDER(t), publicKeyDER(t)

	// A replay within the nonce's time to live: the nonce was spent.
	replayed := adminRequest(t, c, keys, pub, 600)
	if _, err := c.IssueAdminCredential(ctx, replayed); err != nil {
		t.Fatal(err)
	}
	if _, err := c.IssueAdminCredential(ctx, replayed); status.Code(err) != codes.PermissionDenied || reason(err) != joinproto.ReasonAdminChallengeStale {
		t.Fatalf("a replayed request: %v, want %s", err, joinproto.ReasonAdminChallengeStale)
	}
	expired := adminRequest(t, c, keys, pub, 600)
	clk.add(adminNonceTTL)

	for _, tc := range []struct {
		name   string
		req    func() *joinproto.IssueAdminCredentialRequest
		code   codes.Code
		reason string
	}{
		{"wrong secret", func() *joinproto.IssueAdminCredentialRequest { return adminRequest(t, c, wrong, pub, 600) },
			codes.PermissionDenied, joinproto.ReasonAdminProofMismatch},
		{"expired nonce", func() *joinproto.IssueAdminCredentialRequest { return expired },
			codes.PermissionDenied, joinproto.ReasonAdminChallengeStale},
		{"forged nonce", func() *joinproto.IssueAdminCredentialRequest {
			n := make([]byte, adminNonceSize)
			_, _ = rand.Read(n)
			return &joinproto.IssueAdminCredentialRequest{Nonce: n, PublicKey: pub, ValiditySeconds: 600, Proof: keys.AdminProof(n, pub, 600)}
		}, codes.PermissionDenied, joinproto.ReasonAdminChallengeStale},
		{"altered validity", func() *joinproto.IssueAdminCredentialRequest {
			r := adminRequest(t, c, keys, pub, 600)
			r.ValiditySeconds = 6000
			return r
		}, codes.PermissionDenied, joinproto.ReasonAdminProofMismatch},
		{"other public key", func() *joinproto.IssueAdminCredentialRequest {
			r := adminRequest(t, c, keys, pub, 600)
			r.PublicKey = other
			return r
		}, codes.PermissionDenied, joinproto.ReasonAdminProofMismatch},
		{"tampered proof", func() *joinproto.IssueAdminCredentialRequest {
			r := adminRequest(t, c, keys, pub, 600)
			r.Proof[0] ^= 1
			return r
		}, codes.PermissionDenied, joinproto.ReasonAdminProofMismatch},
		{"no proof", func() *joinproto.IssueAdminCredentialRequest {
			r := adminRequest(t, c, keys, pub, 600)
			r.Proof = nil
			return r
		}, codes.PermissionDenied, joinproto.ReasonAdminProofMismatch},
		{"validity under the minimum", func() *joinproto.IssueAdminCredentialRequest { return adminRequest(t, c, keys, pub, 59) },
			codes.InvalidArgument, joinproto.ReasonBadValidity},
		{"negative validity", func() *joinproto.IssueAdminCredentialRequest { return adminRequest(t, c, keys, pub, -3600) },
			codes.InvalidArgument, joinproto.ReasonBadValidity},
		{"validity over the maximum", func() *joinproto.IssueAdminCredentialRequest {
			return adminRequest(t, c, keys, pub, int64(joinproto.MaxAdminValidity/time.Second)+1)
		}, codes.InvalidArgument, joinproto.ReasonBadValidity},
		{"not a public key", func() *joinproto.IssueAdminCredentialRequest { return adminRequest(t, c, keys, []byte("not DER"), 600) },
			codes.InvalidArgument, joinproto.ReasonBadPublicKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := c.IssueAdminCredential(ctx, tc.req())
			if status.Code(err) != tc.code || reason(err) != tc.reason {
				t.Fatalf("IssueAdminCredential() = %v, %v; want %s %s", resp, err, tc.code, tc.reason)
			}
		})
	}
	// The bounds themselves are accepted.
	for _, d := range []time.Duration{joinproto.MinAdminValidity, joinproto.MaxAdminValidity} {
		if _, err := c.IssueAdminCredential(ctx, adminRequest(t, c, keys, pub, int64(d/time.Second))); err != nil {
			t.Errorf("validity %s: %v", d, err)
		}
	}
	// The wrong secret's refusal names only that, and the ledger keeps it as a refusal of a peer that
	// proved nothing.
	_, err := c.IssueAdminCredential(ctx, adminRequest(t, c, wrong, pub, 600))
	if msg := status.Convert(err).Message(); msg != "the master secret does not match this cluster" {
		t.Errorf("wrong secret's message %q", msg)
	}
	var refused int
	for _, e := range j.all() {
		if e.RPC == rpcAdmin && e.Reason == joinproto.ReasonAdminProofMismatch {
			refused++
			if e.Outcome != ledger.OutcomeRejected || e.Kind != joinledger.KindUnverified {
				t.Errorf("ledger entry %+v, want a refusal of kind %s", e, joinledger.KindUnverified)
			}
		}
	}
	if refused != 6 {
		t.Errorf("ledger holds %d proof refusals, want 6", refused)
	}
}

// TestAdminCredentialRefusalsAreBudgeted: wrong proofs spend the unverified budget, and once it is
// spent the next call is refused RATE_LIMITED before any check, challenge or credential alike.
func TestAdminCredentialRefusalsAreBudgeted(t *testing.T) {
	clk := &clock{t: time.Now()}
	c := startAdmin(t, clk, WithRefusalLimits(RefusalLimits{Refused: 1, RefusedBurst: 1, Unverified: 0.001, UnverifiedBurst: 4}))
	ctx := context.Background()
	wrong, _ := clusterkeys.New(bytes.Repeat([]byte{7}, 32), bytes.Repeat([]byte{2}, 32))
	pub := publicKeyDER(t)
	// Two challenges and two wrong proofs spend the burst of 4.
	for range 2 {
		if _, err := c.IssueAdminCredential(ctx, adminRequest(t, c, wrong, pub, 600)); reason(err) != joinproto.ReasonAdminProofMismatch {
			t.Fatalf("IssueAdminCredential() = %v, want %s", err, joinproto.ReasonAdminProofMismatch)
		}
	}
	if _, err := c.AdminChallenge(ctx, &joinproto.AdminChallengeRequest{}); reason(err) != ReasonRateLimited {
		t.Fatalf("AdminChallenge() = %v, want %s", err, ReasonRateLimited)
	}
	if _, err := c.IssueAdminCredential(ctx, &joinproto.IssueAdminCredentialRequest{}); reason(err) != ReasonRateLimited {
		t.Fatalf("IssueAdminCredential() = %v, want %s", err, ReasonRateLimited)
	}
}

func TestAdminNoncesAreThisProcesssOwn(t *testing.T) {
	now := time.Now()
	a, b := newAdminNonces(), newAdminNonces()
	n := a.issue(now)
	if !a.valid(n, now) || b.valid(n, now) {
		t.Fatal("a nonce is valid on another process, or not on its own")
	}
	if a.valid(n, now.Add(adminNonceTTL)) {
		t.Error("a nonce is valid after its time to live")
	}
	n[20] ^= 1 // a later expiry
	if a.valid(n, now) {
		t.Error("a nonce with a changed expiry is valid")
	}
	if !a.spend(a.issue(now), now) {
		t.Error("a fresh nonce cannot be spent")
	}
	spent := a.issue(now)
	a.spend(spent, now)
	if a.spend(spent, now) {
		t.Error("a nonce was spent twice")
	}
	a.spend(a.issue(now.Add(time.Hour)), now.Add(2*time.Hour))
	if len(a.used) != 1 {
		t.Errorf("%d spent nonces kept after they expired, want 1", len(a.used))
	}
}
