package server

import (
	"bytes"
	"context"
	"encoding/hex"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ledger"
	"github.com/berth-k8s/berth/nodelock"
)

// bootPCR is what the tests' genuine image measures into PCR 4.
var bootPCR = bytes.Repeat([]byte{0x4b}, 32)

// tpmClusterPolicy is a cluster's policy as berth mini writes it: the image in PCR 4, a fresh
// node's lock register (PCR 15) zero.
func tpmClusterPolicy(t *testing.T) *policy.Policy {
	t.Helper()
	return mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+strings.Repeat("4b", 32)+", source: the image}\n"+
		"  15: {expected: "+strings.Repeat("00", 32)+", source: lock register of a fresh node}\n")
}

// lockedAt is the evidence of machine id whose boot measured pcr4 and whose lock register holds lock.
func lockedAt(id string, pcr4, lock []byte) *atls.Evidence {
	ev := machine(id)
	ev.Result.Measurements = attestation.Measurements{4: pcr4, 15: lock}
	return ev
}

// TestCheckInAdmitsThisClusterLockValues: a node that booted on its sealed key while no joinservice
// answered checks in with its lock register extended. The check-in admits a register that is zero or
// holds this cluster's worker or control-plane value, and refuses another cluster's values, any
// other value, and a wrong image whatever its register holds (MEASUREMENT_MISMATCH, index named);
// join and rejoin still admit only a zero register; a revoked machine that booted is REVOKED, not
// refused on measurements. Without WithCheckInAttestation the check-in judges like a join.
func TestCheckInAdmitsThisClusterLockValues(t *testing.T) {
	p := tpmClusterPolicy(t)
	cluster := testKeys().ClusterID()
	other := bytes.Repeat([]byte{0xee}, 32)
	workerValue, cpValue := vtpm.ExpectedLockValue(cluster), vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(cluster))
	zero := make([]byte, 32)
	limits := WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 10})
	worker := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}
	rec := &fakeRecord{byID: map[string]machines.Machine{}}
	j := &journal{}
	checkInPolicy := NewCheckInPolicy(func() *policy.Policy { return p }, cluster)
	s := newServer(t, worker, PolicyCheck(p), WithJournal(j), WithMachineRecord(rec), limits, WithCheckInAttestation(checkInPolicy.Check))
	checkIn := func(s *Server, ev *atls.Evidence) error {
		_, err := s.CheckIn(peerCtx(ev), &joinproto.CheckInRequest{DiskUuid: testDiskUUID, ClusterId: cluster})
		return err
	}

	for name, lock := range map[string][]byte{
		"a fresh register (the boot stage's check-in)": zero,
		"this cluster's worker value":                  workerValue,
		"this cluster's control-plane value":           cpValue,
	} {
		if err := checkIn(s, lockedAt("machine A", bootPCR, lock)); err != nil {
			t.Errorf("check-in with %s = %v; want admitted", name, err)
			continue
		}
		if es := j.all(); es[len(es)-1].RPC != RPCCheckIn || es[len(es)-1].Outcome != ledger.OutcomeAccepted {
			t.Errorf("ledger entry of the check-in with %s: %+v; want it accepted", name, es[len(es)-1])
		}
	}
	for name, tc := range map[string]struct {
		pcr4, lock []byte
		index      string
	}{
		"another cluster's worker value":                 {bootPCR, vtpm.ExpectedLockValue(other), "index 15"},
		"another cluster's control-plane value":          {bootPCR, vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(other)), "index 15"},
		"this cluster's ID extended twice":               {bootPCR, vtpm.ExpectedLockValue(workerValue), "index 15"},
		"the cluster ID itself, not its extend":          {bootPCR, cluster, "index 15"},
		"a wrong image with this cluster's worker value": {bytes.Repeat([]byte{0x9d}, 32), workerValue, "index 4"},
		"no lock register at all":                        {bootPCR, nil, "index 15"},
	} {
		ev := lockedAt("machine A", tc.pcr4, tc.lock)
		if tc.lock == nil {
			delete(ev.Result.Measurements, 15)
		}
		err := checkIn(s, ev)
		if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonMeasurements || !strings.Contains(status.Convert(err).Message(), tc.index) {
			t.Errorf("check-in with %s = %v (reason %q); want PermissionDenied %s naming %s", name, err, reason(err), ReasonMeasurements, tc.index)
			continue
		}
		if es := j.all(); es[len(es)-1].RPC != RPCCheckIn || es[len(es)-1].Reason != ReasonMeasurements {
			t.Errorf("ledger entry of the check-in with %s: %+v; want it refused %s", name, es[len(es)-1], ReasonMeasurements)
		}
	}

	// Join and rejoin keep requiring a fresh register: a node that booted gets no ticket and no key.
	ticket, err := s.IssueJoinTicket(peerCtx(lockedAt("machine A", bootPCR, zero)),
		&joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
	if err != nil {
		t.Fatalf("join with a fresh register: %v", err)
	}
	for _, lock := range [][]byte{workerValue, cpValue} {
		ev := lockedAt("machine A", bootPCR, lock)
		_, joinErr := s.IssueJoinTicket(peerCtx(ev), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
		_, rejoinErr := s.IssueRejoinTicket(peerCtx(ev), &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()})
		for rpc, err := range map[string]error{"join": joinErr, "rejoin": rejoinErr} {
			if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonMeasurements || !strings.Contains(status.Convert(err).Message(), "index 15") {
				t.Errorf("%s of a node whose lock register holds %x = %v; want PermissionDenied %s naming index 15", rpc, lock, err, ReasonMeasurements)
			}
		}
	}

	// A removed machine that booted on its sealed key is told REVOKED, which locks it.
	idA := machines.Identity([]byte("machine A"), "worker-0")
	rec.mu.Lock()
	rec.byID[idA] = machines.Machine{Identity: idA, Node: "worker-0", Removal: &machines.Removal{}}
	rec.mu.Unlock()
	if err := checkIn(s, lockedAt("machine A", bootPCR, workerValue)); reason(err) != ReasonRevoked {
		t.Errorf("check-in of the removed machine that booted = %v (reason %q); want %s", err, reason(err), ReasonRevoked)
	}

	// Without the option the check-in judges by the server's policy, as a join does.
	strict := newServer(t, worker, PolicyCheck(p), limits)
	if err := checkIn(strict, lockedAt("machine A", bootPCR, workerValue)); reason(err) != ReasonMeasurements {
		t.Errorf("check-in without WithCheckInAttestation = %v; want %s", err, ReasonMeasurements)
	}
}

// TestWithClusterLockValues: only an exact-value expectation at the variant's lock index is widened
// (TPM PCR 15, TDX index 4 = RTMR3), by this cluster's two values, in a copy; everything else is left
// as it is. CheckInPolicy builds the copy once per policy in force.
func TestWithClusterLockValues(t *testing.T) {
	cluster := testKeys().ClusterID()
	p := tpmClusterPolicy(t)
	w := WithClusterLockValues(p, cluster)
	if len(p.Expectations[1].AnyOf) != 1 || strings.Contains(p.Expectations[1].Source, "check-in") {
		t.Fatalf("the policy in force was changed: %+v", p.Expectations[1])
	}
	want := [][]byte{make([]byte, 32), vtpm.ExpectedLockValue(cluster), vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(cluster))}
	if got := w.Expectations[1]; got.Index != 15 || len(got.AnyOf) != 3 || !bytes.Equal(got.AnyOf[0], want[0]) || !bytes.Equal(got.AnyOf[1], want[1]) || !bytes.Equal(got.AnyOf[2], want[2]) {
		t.Fatalf("widened expectation %+v; want zero, the worker and the control-plane value", got)
	}
	if !bytes.Equal(w.Expectations[0].AnyOf[0], p.Expectations[0].AnyOf[0]) || len(w.Expectations[0].AnyOf) != 1 {
		t.Fatalf("the image's expectation changed: %+v", w.Expectations[0])
	}

	td := mustPolicy(t, "variant: tdx\nmeasurements:\n  0: {expected: "+strings.Repeat("11", 48)+"}\n  4: {expected: "+strings.Repeat("00", 48)+"}\n")
	if got := WithClusterLockValues(td, cluster).Expectations[1]; len(got.AnyOf) != 3 || !bytes.Equal(got.AnyOf[1], tdx.ExpectedLockRTMR(cluster)) ||
		!bytes.Equal(got.AnyOf[2], tdx.ExpectedLockRTMR(nodelock.ControlPlaneLockID(cluster))) {
		t.Fatalf("TDX RTMR3 expectation %+v; want the cluster's two RTMR values added", got)
	}
	nonZero := mustPolicy(t, "variant: tpm\nmeasurements:\n  15: {nonZero: true}\n")
	if WithClusterLockValues(nonZero, cluster) != nonZero {
		t.Fatal("a nonZero lock expectation was changed")
	}
	noLock := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+strings.Repeat("4b", 32)+"}\n")
	if WithClusterLockValues(noLock, cluster) != noLock {
		t.Fatal("a policy without a lock expectation was changed")
	}

	cur := p
	c := NewCheckInPolicy(func() *policy.Policy { return cur }, cluster)
	first := c.Policy()
	if c.Policy() != first {
		t.Fatal("the check-in policy was built again for the same policy in force")
	}
	cur = tpmClusterPolicy(t) // a hot reload
	if c.Policy() == first || len(c.Policy().Expectations[1].AnyOf) != 3 {
		t.Fatal("the check-in policy did not follow the reload")
	}
}

// TestClaimCheckOfCheckInPolicy: the handshake judges claims by the check-in's policy (it does not
// know the RPC yet), so a booted node of this cluster passes its claims; another cluster's lock value
// is still refused before the joinservice quotes.
func TestClaimCheckOfCheckInPolicy(t *testing.T) {
	cluster := testKeys().ClusterID()
	p := tpmClusterPolicy(t)
	check := measuredCheck(t, ClaimCheck(NewCheckInPolicy(func() *policy.Policy { return p }, cluster).Policy, &journal{}, nil))
	claims := func(lock []byte) attestation.Measurements { return attestation.Measurements{4: bootPCR, 15: lock} }
	if err := check(context.Background(), "198.51.100.20", claims(vtpm.ExpectedLockValue(cluster))); err != nil {
		t.Errorf("claims of a booted worker of this cluster refused: %v", err)
	}
	if err := check(context.Background(), "198.51.100.20", claims(vtpm.ExpectedLockValue(bytes.Repeat([]byte{0xee}, 32)))); err == nil {
		t.Error("claims with another cluster's lock value passed")
	}
}

// TestReportTraceJudgedByCheckInPolicy: a joined node reports its trace with its lock register
// extended; judged by the check-in's policy (as the joinservice wires it) this cluster's worker
// value is admitted and stored, another cluster's refused and nothing stored.
func TestReportTraceJudgedByCheckInPolicy(t *testing.T) {
	p := tpmClusterPolicy(t)
	cluster := testKeys().ClusterID()
	worker := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}
	joined := lockedAt("machine A", bootPCR, vtpm.ExpectedLockValue(cluster))
	stranger := lockedAt("machine A", bootPCR, vtpm.ExpectedLockValue(bytes.Repeat([]byte{0xee}, 32)))
	id := hex.EncodeToString(joined.Result.Identity)
	traces := &fakeTraces{known: map[string]bool{id: true}, stored: map[string]*v1alpha1.JoinTrace{}}
	s := newServer(t, worker, PolicyCheck(p), WithMachineRecord(&fakeRecord{byID: map[string]machines.Machine{}}),
		WithTraceStore(traces, NewCheckInPolicy(func() *policy.Policy { return p }, cluster).Check),
		WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 10}))
	if _, err := s.ReportTrace(peerCtx(stranger), &joinproto.ReportTraceRequest{Phases: tracePhases()}); reason(err) != ReasonMeasurements || traces.stored[id] != nil {
		t.Errorf("another cluster's lock value: %v, stored %v; want %s and nothing stored", err, traces.stored[id], ReasonMeasurements)
	}
	if _, err := s.ReportTrace(peerCtx(joined), &joinproto.ReportTraceRequest{Phases: tracePhases()}); err != nil || traces.stored[id] == nil {
		t.Errorf("this cluster's worker value: %v; want the trace stored", err)
	}
}
