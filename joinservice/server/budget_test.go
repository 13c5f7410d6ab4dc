package server

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// TestRefusalBudgets: attested refusals past the refused budget are counted as rate-limited instead
// of recorded one by one, and calls without evidence past the unverified budget are answered
// RATE_LIMITED before any check; neither touches the tickets budget.
func TestRefusalBudgets(t *testing.T) {
	j := &journal{}
	noEvidence := func(context.Context) ([]string, error) { return nil, ErrNoEvidence }
	s := newServer(t, peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, noEvidence, WithJournal(j),
		WithRefusalLimits(RefusalLimits{Refused: 0.001, RefusedBurst: 2, Unverified: 0.001, UnverifiedBurst: 1}))
	for range 5 {
		a := &attempt{rpc: "join", start: time.Now(), entry: ledger.Entry{Peer: "192.0.2.1", RPC: "join", EvidenceSHA256: "ab"}}
		s.finish(a, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster"))
	}
	if got := len(j.all()); got != 2 || j.rateLimited["192.0.2.1"] != 3 {
		t.Fatalf("5 attested refusals with a refused burst of 2: %d recorded, %d counted as rate-limited; want 2 and 3", got, j.rateLimited["192.0.2.1"])
	}
	req := &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID}
	if _, err := s.IssueJoinTicket(context.Background(), req); reason(err) != ReasonNoEvidence {
		t.Fatalf("first call without evidence: %v, want %s", err, ReasonNoEvidence)
	}
	if _, err := s.IssueJoinTicket(context.Background(), req); reason(err) != ReasonRateLimited {
		t.Fatalf("second call without evidence past the unverified burst of 1: %v, want %s", err, ReasonRateLimited)
	}
	if got := s.budgets.tickets.Tokens(); got < float64(DefaultLimits.GlobalBurst)-0.5 {
		t.Fatalf("the tickets budget holds %.1f tokens after refusals only, want its burst of %d", got, DefaultLimits.GlobalBurst)
	}
}
