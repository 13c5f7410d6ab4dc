package server

import (
	"context"
	"encoding/hex"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinproto"
)

// fakeTraces stores traces by identity, for the identities that have a Machine.
type fakeTraces struct {
	mu     sync.Mutex
	known  map[string]bool
	stored map[string]*v1alpha1.JoinTrace
}

func (f *fakeTraces) StoreTrace(_ context.Context, identity string, tr *v1alpha1.JoinTrace) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.known[identity] {
		return "", fmt.Errorf("patching: %w", ErrNoMachine)
	}
	f.stored[identity] = tr
	return "m-" + identity[:8], nil
}

func tracePhases() []*joinproto.JoinPhase {
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	return []*joinproto.JoinPhase{
		{Name: jointrace.PhaseMetadata, Start: timestamppb.New(start), Duration: durationpb.New(200 * time.Millisecond), Outcome: jointrace.OutcomeSucceeded},
		{Name: jointrace.PhaseTicket, Start: timestamppb.New(start), Duration: durationpb.New(3 * time.Second), Outcome: jointrace.OutcomeSucceeded, Message: "attempt 2"},
		{Name: jointrace.PhaseJoin, Start: timestamppb.New(start), Duration: durationpb.New(41 * time.Second), Outcome: jointrace.OutcomeFailed, Reason: jointrace.ReasonJoinFailed},
	}
}

// TestReportTraceWritesOnlyTheCallersMachine: a trace is stored on the Machine of the identity the
// caller attested, whatever else is at its address; a caller without a Machine, a removed machine,
// a malformed trace and a caller without evidence are refused, each with its reason, and nothing
// is stored for them.
func TestReportTraceWritesOnlyTheCallersMachine(t *testing.T) {
	worker := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}
	a, b, c := machine("EK digest of machine A"), machine("EK digest of machine B"), machine("EK digest of machine C")
	idA, idB := hex.EncodeToString([]byte("EK digest of machine A")), hex.EncodeToString([]byte("EK digest of machine B"))
	idC := hex.EncodeToString([]byte("EK digest of machine C"))
	traces := &fakeTraces{known: map[string]bool{idA: true, idB: true, idC: true}, stored: map[string]*v1alpha1.JoinTrace{}}
	rec := &fakeRecord{byID: map[string]machines.Machine{
		idC: {Identity: idC, Node: "worker-0", Removal: &machines.Removal{Time: time.Date(2026, 11, 25, 6, 0, 0, 0, time.UTC)}},
	}}
	accept := func(context.Context) ([]string, error) { return nil, nil }
	evidenceOnly := func(ctx context.Context) ([]string, error) {
		if _, ok := atls.PeerEvidence(ctx); !ok {
			return nil, ErrNoEvidence
		}
		return nil, nil
	}
	s := newServer(t, worker, accept, WithMachineRecord(rec), WithTraceStore(traces, evidenceOnly),
		WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 10}))
	report := func(ev *atls.Evidence, phases []*joinproto.JoinPhase) (*joinproto.ReportTraceResponse, error) {
		return s.ReportTrace(peerCtx(ev), &joinproto.ReportTraceRequest{Phases: phases})
	}

	resp, err := report(a, tracePhases())
	if err != nil {
		t.Fatalf("report of A: %v", err)
	}
	if resp.GetMachine() != "m-"+idA[:8] {
		t.Errorf("stored on %q, want A's machine", resp.GetMachine())
	}
	got := traces.stored[idA]
	if got == nil || len(got.Phases) != 3 || got.Phases[2].Reason != jointrace.ReasonJoinFailed || got.Phases[1].Duration.Duration != 3*time.Second {
		t.Fatalf("A's stored trace = %+v", got)
	}
	if traces.stored[idB] != nil {
		t.Fatal("A's report wrote B's machine")
	}
	// B, at the same address, writes its own machine and leaves A's trace alone.
	if _, err := report(b, tracePhases()[:1]); err != nil {
		t.Fatalf("report of B: %v", err)
	}
	if len(traces.stored[idB].Phases) != 1 || len(traces.stored[idA].Phases) != 3 {
		t.Fatalf("after B's report: A %+v, B %+v", traces.stored[idA], traces.stored[idB])
	}

	unknown := machine("EK digest of a machine never admitted")
	for name, tc := range map[string]struct {
		ev     *atls.Evidence
		phases []*joinproto.JoinPhase
		code   codes.Code
		reason string
	}{
		"no machine":  {unknown, tracePhases(), codes.FailedPrecondition, ReasonNoMachine},
		"removed":     {c, tracePhases(), codes.PermissionDenied, ReasonRevoked},
		"bad trace":   {a, append(tracePhases(), tracePhases()[0]), codes.InvalidArgument, ReasonBadTrace},
		"no evidence": {nil, tracePhases(), codes.Unauthenticated, ReasonNoEvidence},
	} {
		before := len(traces.stored)
		_, err := report(tc.ev, tc.phases)
		if status.Code(err) != tc.code || reason(err) != tc.reason {
			t.Errorf("%s: ReportTrace = %v, want %v %s", name, err, tc.code, tc.reason)
		}
		if len(traces.stored) != before || name == "bad trace" && len(traces.stored[idA].Phases) != 3 {
			t.Errorf("%s: a refused report stored something", name)
		}
	}
}
