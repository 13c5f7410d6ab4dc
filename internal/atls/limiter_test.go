package atls

import (
	"context"
	"net"
	"testing"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/peer"

	"github.com/berth-k8s/berth/internal/attestation"
)

func TestLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLimiterWithClock(Limits{PerPeer: 1, PerPeerBurst: 2, Global: 10, GlobalBurst: 3, MaxPeers: 3}, func() time.Time { return now })
	steps := []struct {
		peer string
		want bool
	}{
		{"a", true}, {"a", true}, {"a", false}, // per-peer burst of 2
		{"b", true}, {"c", false}, // global burst of 3 used up
	}
	for i, s := range steps {
		if got := l.Allow(s.peer); got != s.want {
			t.Fatalf("step %d: Allow(%q) = %v, want %v", i, s.peer, got, s.want)
		}
	}
	now = now.Add(time.Second) // one per-peer token for a, 10 global tokens
	if !l.Allow("a") || l.Allow("a") {
		t.Fatal("after 1s, a should get exactly one handshake")
	}
	// A fourth peer evicts the least recently seen one (b or c, seen a second before a).
	now = now.Add(time.Second)
	if !l.Allow("d") {
		t.Fatal("new peer d refused")
	}
	if len(l.peers) != 3 {
		t.Fatalf("tracking %d peers, limit 3", len(l.peers))
	}
	if _, ok := l.peers["a"]; !ok {
		t.Fatal("evicted the most recently seen peer")
	}
}

// TestLimiterBudgets: a probe and the handshake it precedes cost one per-peer token; probes and
// refusals never draw from the attested budgets; known peers have an attested budget of their own.
func TestLimiterBudgets(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLimiterWithClock(Limits{PerPeer: 1, PerPeerBurst: 2, Global: 1, GlobalBurst: 2, Known: 1, KnownBurst: 2,
		Unauthenticated: 1, UnauthenticatedBurst: 3, MaxPeers: 100}, func() time.Time { return now })
	// A probe pays for the handshake after it: two probe-and-handshake pairs fit the burst of 2.
	for i := range 2 {
		if !l.AllowProbe("nat", false) || !l.AllowHandshake("nat", false) {
			t.Fatalf("pair %d of a peer behind one address refused", i)
		}
	}
	if l.AllowProbe("nat", false) {
		t.Fatal("a third probe within the burst of 2 admitted")
	}
	// The unauthenticated budget (burst 3, two used) refuses probes of anyone past it, and those
	// refusals cost no attested token.
	if !l.AllowProbe("flood-1", false) || l.AllowProbe("flood-2", false) || l.AllowProbe("flood-3", false) {
		t.Fatal("the unauthenticated budget of 3 admitted more")
	}
	// The unknown peers' attested budget (burst 2) is spent by the two handshakes above; a known
	// peer still has its own.
	if l.AllowHandshake("stranger", false) {
		t.Fatal("an unknown peer got an attested handshake past the global budget")
	}
	if !l.AllowHandshake("cp-1", true) || !l.AllowHandshake("cp-2", true) || l.AllowHandshake("cp-3", true) {
		t.Fatal("known peers do not have their own budget of 2")
	}
	// A probe's credit expires.
	now = now.Add(time.Minute)
	if !l.AllowProbe("late", false) {
		t.Fatal("probe refused after a minute")
	}
	now = now.Add(probeCreditTTL)
	var got []bool
	for range 3 {
		got = append(got, l.AllowHandshake("late", false))
	}
	if !got[0] || !got[1] || got[2] {
		t.Fatalf("handshakes after the credit expired: %v, want exactly the 2 per-peer tokens, no credit", got)
	}
	// Unlimited budgets stay unlimited.
	u := NewLimiter(Limits{PerPeer: rate.Inf, Global: rate.Inf})
	for range 100 {
		if !u.AllowProbe("x", false) || !u.AllowHandshake("x", false) || !u.AllowHandshake("x", true) {
			t.Fatal("an unlimited limiter refused")
		}
	}
}

func FuzzCheckPeer(f *testing.F) {
	f.Add([]byte{0x30, 0x03, 0x02, 0x01, 0x00})
	f.Add([]byte("garbage"))
	f.Fuzz(func(t *testing.T, der []byte) {
		_, err := checkPeer(t.Context(), plainCheck(nopValidator{}, make([]byte, nonceSize)), [][]byte{der})
		if err == nil {
			t.Fatal("accepted a fuzzed certificate")
		}
	})
}

func FuzzNonceCarriers(f *testing.F) {
	f.Add("0123456789abcdefghijklmnopqrstuv0123456789abcdefghij.atls.berth.invalid", []byte{0x30, 0x00})
	f.Fuzz(func(t *testing.T, sni string, ca []byte) {
		if n, err := decodeSNINonce(sni); err == nil && len(n) != nonceSize {
			t.Fatalf("SNI nonce of %d bytes", len(n))
		}
		if n, err := decodeCANonce([][]byte{ca}); err == nil && len(n) != nonceSize {
			t.Fatalf("CA nonce of %d bytes", len(n))
		}
		if c := decodeCAChallenge([][]byte{ca}); len(c) > maxActivationBlob {
			t.Fatalf("CA challenge of %d bytes", len(c))
		}
		if b := fromALPN(alpnChallenge, []string{sni, string(ca)}); len(b) > maxActivationBlob {
			t.Fatalf("ALPN blob of %d bytes", len(b))
		}
	})
}

type nopValidator struct{}

func (nopValidator) Variant() string { return "fake-insecure" }
func (nopValidator) Validate(context.Context, []byte, []byte) (attestation.Result, error) {
	return attestation.Result{UserData: []byte("never matches a key hash")}, nil
}

// TestLimiterProbesOfKnownPeers: a probe flood from unknown peers uses up their probe budget and
// none of the known peers'; a refusal on claims is charged to its peer, which is then over its limit.
func TestLimiterProbesOfKnownPeers(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLimiterWithClock(Limits{PerPeer: 1, PerPeerBurst: 2, Global: 1, GlobalBurst: 2,
		Unauthenticated: 1, UnauthenticatedBurst: 3, MaxPeers: 100}, func() time.Time { return now })
	for _, peer := range []string{"f1", "f2", "f3"} {
		if !l.AllowProbe(peer, false) {
			t.Fatalf("probe of %s refused within the burst", peer)
		}
	}
	if l.AllowProbe("f4", false) {
		t.Fatal("a fourth unknown peer's probe admitted past the unauthenticated burst of 3")
	}
	if !l.AllowProbe("node", true) {
		t.Fatal("a known peer's probe refused: the unknown peers' flood used up its budget")
	}
	// Refusals on claims: charged a token each, the peer is over its limit after its burst of 2.
	for range 2 {
		if !l.CanAttempt("liar") {
			t.Fatal("a peer within its burst may not attempt")
		}
		l.ChargeRefusal("liar")
	}
	if l.CanAttempt("liar") {
		t.Fatal("a peer whose refusals used up its burst may still attempt")
	}
}

// TestPeerHost: the caller's address keys the limits without its port, so one host's connections
// from many ports share one budget; a context without a peer is "unknown".
func TestPeerHost(t *testing.T) {
	for _, tc := range []struct {
		addr       net.Addr
		addr2, key string
	}{
		{&net.TCPAddr{IP: net.IPv4(10, 0, 0, 7), Port: 40123}, "10.0.0.7:40123", "10.0.0.7"},
		{&net.TCPAddr{IP: net.ParseIP("fd00::7"), Port: 9000}, "[fd00::7]:9000", "fd00::7"},
		{&net.UnixAddr{Name: "/run/berth.sock", Net: "unix"}, "/run/berth.sock", "/run/berth.sock"},
		{nil, "unknown", "unknown"},
	} {
		ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: tc.addr})
		if got, key := PeerAddr(ctx), PeerHost(ctx); got != tc.addr2 || key != tc.key {
			t.Errorf("PeerAddr, PeerHost of %v = %q, %q; want %q, %q", tc.addr, got, key, tc.addr2, tc.key)
		}
	}
	if got := PeerHost(context.Background()); got != "unknown" {
		t.Errorf("PeerHost without a peer = %q, want unknown", got)
	}
}
