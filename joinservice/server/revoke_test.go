package server

import (
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// fakeRecord is a machine record in memory.
type fakeRecord struct {
	mu       sync.Mutex
	byID     map[string]machines.Machine
	admitted []machines.Machine
	err      error
}

func (r *fakeRecord) Lookup(identity string) (machines.Machine, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return machines.Machine{}, false, r.err
	}
	m, ok := r.byID[identity]
	return m, ok, nil
}

func (r *fakeRecord) Admit(m machines.Machine) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.admitted = append(r.admitted, m)
}

// TestRevokedMachineIsRefused: a machine an operator removed is refused on join, on rejoin and on
// its check-in with REVOKED, by its attested identity (the EK digest), whatever it presents; another machine at the
// same address is not; every admitted machine is recorded with its identity; a replica that has not
// read the record refuses rather than admit a removed machine.
func TestRevokedMachineIsRefused(t *testing.T) {
	worker := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}
	a, b := machine("EK digest of machine A"), machine("EK digest of machine B")
	idA, idB := hex.EncodeToString([]byte("EK digest of machine A")), hex.EncodeToString([]byte("EK digest of machine B"))
	rec := &fakeRecord{byID: map[string]machines.Machine{}}
	j := &journal{}
	s := newServer(t, worker, nil, WithJournal(j), WithMachineRecord(rec),
		WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 10}))
	join := func(ev *atls.Evidence) (*joinproto.IssueJoinTicketResponse, error) {
		return s.IssueJoinTicket(peerCtx(ev), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
	}

	ticket, err := join(a)
	if err != nil {
		t.Fatalf("join of A: %v", err)
	}
	if len(rec.admitted) != 1 || rec.admitted[0].Identity != idA || rec.admitted[0].Node != "worker-0" || rec.admitted[0].Role != machines.RoleWorker {
		t.Fatalf("admitted %+v, want machine A as worker-0", rec.admitted)
	}
	if es := j.all(); es[len(es)-1].Identity != idA {
		t.Fatalf("ledger entry of the join: %+v, want identity %s", es[len(es)-1], idA)
	}

	checkIn := func(ev *atls.Evidence, clusterID []byte) (*joinproto.CheckInResponse, error) {
		return s.CheckIn(peerCtx(ev), &joinproto.CheckInRequest{DiskUuid: testDiskUUID, ClusterId: clusterID})
	}
	// A joined node checks in: admitted with its instance name, recorded, nothing handed out.
	if resp, err := checkIn(a, s.keys.ClusterID()); err != nil || resp.GetNodeName() != "worker-0" {
		t.Fatalf("check-in of A = %v, %v; want admitted as worker-0", resp, err)
	}
	if es := j.all(); es[len(es)-1].RPC != RPCCheckIn || es[len(es)-1].Outcome != ledger.OutcomeAccepted || es[len(es)-1].Identity != idA {
		t.Fatalf("ledger entry of the check-in: %+v, want A's accepted check-in", es[len(es)-1])
	}
	// A node of another cluster is told so, not admitted.
	if _, err := checkIn(a, []byte("another cluster's ID")); status.Code(err) != codes.PermissionDenied || reason(err) != ReasonWrongCluster {
		t.Fatalf("check-in naming another cluster = %v, want PermissionDenied %s", err, ReasonWrongCluster)
	}

	// The operator removes worker-0: machine A is revoked.
	rec.mu.Lock()
	rec.byID[idA] = machines.Machine{Identity: idA, Node: "worker-0", Removal: &machines.Removal{Time: time.Date(2026, 11, 25, 6, 0, 0, 0, time.UTC)}}
	rec.mu.Unlock()
	for name, call := range map[string]func() error{
		"join": func() error { _, err := join(a); return err },
		"rejoin": func() error {
			_, err := s.IssueRejoinTicket(peerCtx(a), &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()})
			return err
		},
		RPCCheckIn: func() error { _, err := checkIn(a, s.keys.ClusterID()); return err },
	} {
		err := call()
		if status.Code(err) != codes.PermissionDenied || reason(err) != ReasonRevoked || !strings.Contains(status.Convert(err).Message(), "berth node readmit") {
			t.Fatalf("%s of the removed machine = %v, want PermissionDenied %s", name, err, ReasonRevoked)
		}
		es := j.all()
		if last := es[len(es)-1]; last.RPC != name || last.Outcome != ledger.OutcomeRejected || last.Reason != ReasonRevoked || last.Identity != idA ||
			last.Node != "worker-0" || last.Time.IsZero() || !strings.Contains(last.Message, machines.Short(idA)) {
			t.Fatalf("ledger entry %+v, want the refused %s of A (worker-0, its identity in the message) with %s", last, name, ReasonRevoked)
		}
	}
	if len(rec.admitted) != 1 {
		t.Fatalf("a refused machine was admitted: %+v", rec.admitted)
	}
	// A refused etcd removal does not revoke.
	rec.mu.Lock()
	rec.byID[idA].Removal.Etcd = machines.EtcdRefused
	rec.mu.Unlock()
	if _, err := join(a); err != nil {
		t.Fatalf("join of A after a refused removal: %v", err)
	}
	// Another machine at the removed node's address is a different machine.
	rec.mu.Lock()
	rec.byID[idA].Removal.Etcd = ""
	rec.mu.Unlock()
	if _, err := join(b); err != nil {
		t.Fatalf("join of B at worker-0's address: %v", err)
	}
	if last := rec.admitted[len(rec.admitted)-1]; last.Identity != idB {
		t.Fatalf("admitted %+v, want B", last)
	}

	// A replica that has not read the record refuses.
	rec.mu.Lock()
	rec.err = errors.New("not synced")
	rec.mu.Unlock()
	if _, err := join(b); status.Code(err) != codes.Unavailable || reason(err) != ReasonRecordUnavailable {
		t.Fatalf("join before the record was read = %v, want Unavailable %s", err, ReasonRecordUnavailable)
	}
}

// TestRevokedByInstanceWithoutIdentity: a machine without an attested identity is recorded and
// revoked by its instance name.
func TestRevokedByInstanceWithoutIdentity(t *testing.T) {
	rec := &fakeRecord{byID: map[string]machines.Machine{}}
	c := start(t, peers{{Name: "cp-9", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}}, WithMachineRecord(rec))
	req := &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID}
	if _, err := c.IssueJoinTicket(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if len(rec.admitted) != 1 || rec.admitted[0].Identity != "instance/cp-9" || rec.admitted[0].Role != machines.RoleControlPlane {
		t.Fatalf("admitted %+v, want instance/cp-9 as a control plane", rec.admitted)
	}
	rec.mu.Lock()
	rec.byID["instance/cp-9"] = machines.Machine{Identity: "instance/cp-9", Node: "cp-9", Removal: &machines.Removal{Etcd: machines.EtcdRemoved}}
	rec.mu.Unlock()
	if _, err := c.IssueJoinTicket(context.Background(), req); reason(err) != ReasonRevoked {
		t.Fatalf("join of the removed instance = %v, want %s", err, ReasonRevoked)
	}
}
