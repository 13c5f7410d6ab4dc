package initserver

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// Reasons of rejected calls, as logged.
const (
	reasonWrongSecret = "init secret does not match"
	reasonRateLimited = "rate limited"
)

// rejectLogInterval is the least time between two log lines about one peer's rejected calls.
const rejectLogInterval = 10 * time.Second

// maxRejectPeers bounds the peers rejectLog remembers; when it is full, the quietest half is
// forgotten (their next rejection is logged at once again).
const maxRejectPeers = 1024

// rejectLog logs rejected Init calls sampled per peer: a peer's first rejection at once, then at
// most one line per rejectLogInterval saying how many calls were rejected since the last line, by
// reason. A peer cannot make the node log faster than that, whatever it sends.
type rejectLog struct {
	log *zap.Logger
	now func() time.Time

	mu    sync.Mutex
	peers map[string]*rejectedPeer
}

type rejectedPeer struct {
	logged time.Time
	// since counts the rejections per reason since the last line.
	since map[string]int
}

func newRejectLog(log *zap.Logger, now func() time.Time) *rejectLog {
	return &rejectLog{log: log, now: now, peers: map[string]*rejectedPeer{}}
}

// note records one rejected call of peer and writes a line when one is due.
func (r *rejectLog) note(peer, reason string) {
	now := r.now()
	r.mu.Lock()
	p, ok := r.peers[peer]
	if !ok {
		if len(r.peers) >= maxRejectPeers {
			r.forgetLocked(now)
		}
		p = &rejectedPeer{since: map[string]int{}}
		r.peers[peer] = p
	}
	p.since[reason]++
	if ok && now.Sub(p.logged) < rejectLogInterval {
		r.mu.Unlock()
		return
	}
	counts, prev := p.since, p.logged
	p.since, p.logged = map[string]int{}, now
	r.mu.Unlock()
	fields := []zap.Field{zap.String("peer", peer), zap.String("reason", reason)}
	if !ok {
		r.log.Warn("init request rejected", fields...)
		return
	}
	r.log.Warn("init requests rejected", append(fields,
		zap.Int("wrongSecret", counts[reasonWrongSecret]), zap.Int("rateLimited", counts[reasonRateLimited]),
		zap.Time("since", prev))...)
}

// forgetLocked drops the peers whose last line is older than rejectLogInterval, or all when none is.
func (r *rejectLog) forgetLocked(now time.Time) {
	for k, p := range r.peers {
		if now.Sub(p.logged) >= rejectLogInterval {
			delete(r.peers, k)
		}
	}
	if len(r.peers) >= maxRejectPeers {
		r.peers = map[string]*rejectedPeer{}
	}
}
