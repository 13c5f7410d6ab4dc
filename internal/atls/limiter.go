package atls

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Limits are the rate limits of an attesting server. Three budgets, so that what anyone can cause
// never uses up what the cluster's own machines need:
//
//   - per peer (PerPeer, PerPeerBurst): the attempts of one remote IP. An identity probe and the
//     attested handshake it precedes are one attempt: the probe pays, and the handshake that follows
//     within probeCreditTTL uses the probe's credit.
//   - attested handshakes (the TPM's and the validation's work): peers the server knows as its
//     cluster's instances (WithKnownPeers) draw from Known, every other peer from Global.
//   - unauthenticated answers (Unauthenticated): identity probes, which cost a plain TLS handshake
//     and no TPM work, are charged here and never to the attested budgets. Known peers' probes draw
//     from a second budget of the same size, so that a probe flood from elsewhere never keeps a
//     node of the cluster from the probe its join needs.
//
// A refusal on claims (claims.go) is charged to its peer (a per-peer token, or the credit of a
// probe), and a peer with neither gets the rate-limit refusal before its claims are judged.
//
// A peer over a budget gets the pre-made refusal certificate (ErrRateLimited), which costs a plain
// TLS handshake.
type Limits struct {
	// PerPeer and PerPeerBurst limit attempts per remote IP.
	PerPeer      rate.Limit
	PerPeerBurst int
	// Global and GlobalBurst limit the attested handshakes of all peers the server does not know.
	Global      rate.Limit
	GlobalBurst int
	// Known and KnownBurst limit the attested handshakes of peers the server knows as its cluster's
	// instances; zero means Global and GlobalBurst again, in a budget of their own.
	Known      rate.Limit
	KnownBurst int
	// Unauthenticated and UnauthenticatedBurst limit the identity probes of all peers together; zero
	// means unlimited (the per-peer limit still holds).
	Unauthenticated      rate.Limit
	UnauthenticatedBurst int
	// MaxPeers bounds the number of remote IPs tracked; the least recently seen is forgotten first.
	MaxPeers int
}

// DefaultLimits: per peer 2 attempts a second (burst 8); attested handshakes 20 a second (burst 40)
// for unknown peers and as many again for known ones; identity probes 500 a second (burst 1000); 4096 peers tracked. See internal/attestation/README.md for the reasoning and the numbers.
var DefaultLimits = Limits{PerPeer: 2, PerPeerBurst: 8, Global: 20, GlobalBurst: 40, Known: 20, KnownBurst: 40,
	Unauthenticated: 500, UnauthenticatedBurst: 1000, MaxPeers: 4096}

// probeCreditTTL is how long an admitted probe pays for its peer's next attested handshake.
const probeCreditTTL = 10 * time.Second

// maxProbeCredits bounds the handshakes one peer's probes can pay for in advance.
const maxProbeCredits = 4

// Limiter decides whether a handshake may cost a quote. It is safe for concurrent use.
type Limiter struct {
	limits Limits
	now    func() time.Time

	mu     sync.Mutex
	global *rate.Limiter
	known  *rate.Limiter
	unauth *rate.Limiter
	// knownUnauth is the probe budget of known peers.
	knownUnauth *rate.Limiter
	peers       map[string]*peerState
}

type peerState struct {
	lim      *rate.Limiter
	lastSeen time.Time
	// credits are handshakes paid for by admitted probes, each valid until its time.
	credits []time.Time
}

// NewLimiter returns a limiter enforcing l.
func NewLimiter(l Limits) *Limiter {
	return newLimiterWithClock(l, time.Now)
}

func newLimiterWithClock(l Limits, now func() time.Time) *Limiter {
	if l.MaxPeers <= 0 {
		l.MaxPeers = DefaultLimits.MaxPeers
	}
	if l.Known == 0 && l.KnownBurst == 0 {
		l.Known, l.KnownBurst = l.Global, l.GlobalBurst
	}
	unauth, knownUnauth := rate.NewLimiter(rate.Inf, 0), rate.NewLimiter(rate.Inf, 0)
	if l.Unauthenticated > 0 {
		unauth = rate.NewLimiter(l.Unauthenticated, l.UnauthenticatedBurst)
		knownUnauth = rate.NewLimiter(l.Unauthenticated, l.UnauthenticatedBurst)
	}
	return &Limiter{limits: l, now: now, global: rate.NewLimiter(l.Global, l.GlobalBurst), known: rate.NewLimiter(l.Known, l.KnownBurst),
		unauth: unauth, knownUnauth: knownUnauth, peers: map[string]*peerState{}}
}

// Allow reports whether peer may have one more attested handshake now, and takes the tokens if so:
// the credit of an earlier probe or a per-peer token, and one of the attested budget of unknown
// peers.
func (l *Limiter) Allow(peer string) bool { return l.AllowHandshake(peer, false) }

// AllowHandshake is Allow for a peer the server knows as its cluster's instance (known: its own
// attested budget) or not.
func (l *Limiter) AllowHandshake(peer string, known bool) bool {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.peer(peer, now)
	budget := l.global
	if known {
		budget = l.known
	}
	if !available(budget, now) {
		return false
	}
	if !p.useCredit(now) {
		if !available(p.lim, now) {
			return false
		}
		p.lim.AllowN(now, 1)
	}
	budget.AllowN(now, 1)
	return true
}

// AllowPeer reports whether peer may make one more attempt now, taking a per-peer token if so and
// charging no other budget: for servers that charge their own budgets once they know what kind of
// peer is calling (joinservice/server, bootstrapper/initserver).
func (l *Limiter) AllowPeer(peer string) bool {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.peer(peer, now)
	if !available(p.lim, now) {
		return false
	}
	p.lim.AllowN(now, 1)
	return true
}

// AllowProbe reports whether peer may have an identity probe answered now, charging a per-peer token
// and the unauthenticated budget (known: the known peers' one); an admitted probe pays for the
// peer's next attested handshake.
func (l *Limiter) AllowProbe(peer string, known bool) bool {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.peer(peer, now)
	budget := l.unauth
	if known {
		budget = l.knownUnauth
	}
	if !available(p.lim, now) || !available(budget, now) {
		return false
	}
	p.lim.AllowN(now, 1)
	budget.AllowN(now, 1)
	p.addCredit(now)
	return true
}

// CanAttempt reports whether peer has a probe's credit or a per-peer token now, taking nothing.
func (l *Limiter) CanAttempt(peer string) bool {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.peer(peer, now)
	p.dropExpired(now)
	return len(p.credits) > 0 || available(p.lim, now)
}

// ChargeRefusal charges a refusal of peer (on its claims): a probe's credit, else a per-peer token,
// if it has either.
func (l *Limiter) ChargeRefusal(peer string) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.peer(peer, now)
	if !p.useCredit(now) && available(p.lim, now) {
		p.lim.AllowN(now, 1)
	}
}

// available says whether lim has a token at now (an unlimited one always has).
func available(lim *rate.Limiter, now time.Time) bool {
	return lim.Limit() == rate.Inf || lim.TokensAt(now) >= 1
}

// peer returns peer's state, tracking it (and forgetting the least recently seen peer when the
// table is full).
func (l *Limiter) peer(peer string, now time.Time) *peerState {
	p, ok := l.peers[peer]
	if !ok {
		if len(l.peers) >= l.limits.MaxPeers {
			l.evictOldest()
		}
		p = &peerState{lim: rate.NewLimiter(l.limits.PerPeer, l.limits.PerPeerBurst)}
		l.peers[peer] = p
	}
	p.lastSeen = now
	return p
}

func (p *peerState) addCredit(now time.Time) {
	p.dropExpired(now)
	if len(p.credits) < maxProbeCredits {
		p.credits = append(p.credits, now.Add(probeCreditTTL))
	}
}

func (p *peerState) useCredit(now time.Time) bool {
	p.dropExpired(now)
	if len(p.credits) == 0 {
		return false
	}
	p.credits = p.credits[1:]
	return true
}

func (p *peerState) dropExpired(now time.Time) {
	for len(p.credits) > 0 && !now.Before(p.credits[0]) {
		p.credits = p.credits[1:]
	}
}

// evictOldest forgets the least recently seen peer. O(n), only when the table is full.
func (l *Limiter) evictOldest() {
	var oldest string
	var at time.Time
	first := true
	for k, p := range l.peers {
		if first || p.lastSeen.Before(at) {
			oldest, at, first = k, p.lastSeen, false
		}
	}
	delete(l.peers, oldest)
}
