package server

import (
	"golang.org/x/time/rate"

	"github.com/berth-k8s/berth/internal/atls"
)

// RefusalLimits bound the refusals the join RPCs answer and record in full, in budgets of their own
// so that no refused peer spends the tickets of the peers that pass: Unverified is charged by calls
// without attestation evidence (anyone can make them), Refused by attested calls refused by a cheap
// check (the policy, metadata, the role, the revocation list, the disk binding). A refusal beyond
// its budget is answered RATE_LIMITED (NO_EVIDENCE calls) or counted as rate-limited in the ledger
// instead of recorded as its own entry (attested refusals, whose verdict is computed already).
type RefusalLimits struct {
	Refused         rate.Limit
	RefusedBurst    int
	Unverified      rate.Limit
	UnverifiedBurst int
}

// DefaultRefusalLimits: 20 refusals a second (burst 40) of attested peers, and as many of peers
// without evidence.
var DefaultRefusalLimits = RefusalLimits{Refused: 20, RefusedBurst: 40, Unverified: 20, UnverifiedBurst: 40}

// budgets are the join RPCs' rate limits. The per-peer limit comes first (a map lookup); the
// tickets budget (Limits.Global) is charged only once a call passed every cheap check, so only a peer
// that the policy admits and metadata knows spends it.
type budgets struct {
	peers      *atls.Limiter // per peer only (AllowPeer)
	tickets    *rate.Limiter
	refused    *rate.Limiter
	unverified *rate.Limiter
}

func newBudgets(l atls.Limits, r RefusalLimits) *budgets {
	return &budgets{
		peers:      atls.NewLimiter(l),
		tickets:    rate.NewLimiter(l.Global, l.GlobalBurst),
		refused:    rate.NewLimiter(r.Refused, r.RefusedBurst),
		unverified: rate.NewLimiter(r.Unverified, r.UnverifiedBurst),
	}
}
