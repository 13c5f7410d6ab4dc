package atls

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Limits are the handshake rate limits of an attesting server.
type Limits struct {
	// PerPeer and PerPeerBurst limit handshakes per remote IP.
	PerPeer      rate.Limit
	PerPeerBurst int
	// Global and GlobalBurst limit all handshakes together.
	Global      rate.Limit
	GlobalBurst int
	// MaxPeers bounds the number of remote IPs tracked; the least recently seen is forgotten first.
	MaxPeers int
}

// DefaultLimits: 2/s per peer (burst 8), 20/s overall (burst 40), 4096 peers tracked. See the package
// documentation for the reasoning.
var DefaultLimits = Limits{PerPeer: 2, PerPeerBurst: 8, Global: 20, GlobalBurst: 40, MaxPeers: 4096}

// Limiter decides whether a handshake may cost a quote. It is safe for concurrent use.
type Limiter struct {
	limits Limits
	now    func() time.Time

	mu     sync.Mutex
	global *rate.Limiter
	peers  map[string]*peerState
}

type peerState struct {
	lim      *rate.Limiter
	lastSeen time.Time
}

// NewLimiter returns a limiter enforcing l.
func NewLimiter(l Limits) *Limiter {
	return newLimiterWithClock(l, time.Now)
}

func newLimiterWithClock(l Limits, now func() time.Time) *Limiter {
	if l.MaxPeers <= 0 {
		l.MaxPeers = DefaultLimits.MaxPeers
	}
	return &Limiter{limits: l, now: now, global: rate.NewLimiter(l.Global, l.GlobalBurst), peers: map[string]*peerState{}}
}

// Allow reports whether peer may have one more attested handshake now, and takes the tokens if so.
func (l *Limiter) Allow(peer string) bool {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	p, ok := l.peers[peer]
	if !ok {
		if len(l.peers) >= l.limits.MaxPeers {
			l.evictOldest()
		}
		p = &peerState{lim: rate.NewLimiter(l.limits.PerPeer, l.limits.PerPeerBurst)}
		l.peers[peer] = p
	}
	p.lastSeen = now
	if p.lim.TokensAt(now) < 1 || l.global.TokensAt(now) < 1 {
		return false
	}
	p.lim.AllowN(now, 1)
	l.global.AllowN(now, 1)
	return true
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
