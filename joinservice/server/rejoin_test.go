package server

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// peerCtx is the context of a call from 127.0.0.1 that proved ev in its handshake (nil: no evidence).
func peerCtx(ev *atls.Evidence) context.Context {
	p := &peer.Peer{Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 40000}}
	if ev != nil {
		p.AuthInfo = atls.AuthInfo{Evidence: ev}
	}
	return peer.NewContext(context.Background(), p)
}

// machine is the evidence of an attested TPM machine whose endorsement key digests to id.
func machine(id string) *atls.Evidence {
	return &atls.Evidence{Variant: "tpm", Activated: true, Result: attestation.Result{Identity: []byte(id)}}
}

// TestRejoinNeedsTheDiskBinding drives the server's handlers with the evidence a handshake leaves in
// the call's context.
func TestRejoinNeedsTheDiskBinding(t *testing.T) {
	worker := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}
	j, m := &journal{}, &counter{attempts: map[string]int{}, stages: map[string]int{}}
	s := newServer(t, worker, nil, WithJournal(j), WithObserver(m), WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 1000, GlobalBurst: 1000, MaxPeers: 10}))
	a, b := machine("EK digest of machine A"), machine("EK digest of machine B")

	join := func(t *testing.T, ev *atls.Evidence, uuid string) *joinproto.IssueJoinTicketResponse {
		t.Helper()
		resp, err := s.IssueJoinTicket(peerCtx(ev), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: uuid})
		if err != nil {
			t.Fatalf("IssueJoinTicket() = %v", err)
		}
		return resp
	}
	rejoin := func(ev *atls.Evidence, uuid string, binding []byte) (*joinproto.IssueRejoinTicketResponse, error) {
		return s.IssueRejoinTicket(peerCtx(ev), &joinproto.IssueRejoinTicketRequest{DiskUuid: uuid, DiskBinding: binding})
	}
	refused := func(t *testing.T, ev *atls.Evidence, uuid string, binding []byte) {
		t.Helper()
		resp, err := rejoin(ev, uuid, binding)
		st := status.Convert(err)
		if err == nil || st.Code() != codes.PermissionDenied || reason(err) != ReasonDiskNotBound || st.Message() != "this disk does not belong to the attested machine" {
			t.Fatalf("IssueRejoinTicket() = %v (reason %q), want PermissionDenied %s", err, reason(err), ReasonDiskNotBound)
		}
		if resp != nil {
			t.Fatalf("a refused rejoin returned %v", resp)
		}
		es := j.all()
		last := es[len(es)-1]
		if last.RPC != "rejoin" || last.Outcome != ledger.OutcomeRejected || last.Reason != ReasonDiskNotBound || last.Node != "worker-0" || last.Message != st.Message() {
			t.Fatalf("ledger entry %+v, want the refused rejoin of worker-0 with %s", last, ReasonDiskNotBound)
		}
	}

	ticketA := join(t, a, testDiskUUID)
	keys := testKeys()
	idA := []byte("EK digest of machine A")
	if len(ticketA.GetDiskBinding()) == 0 || !bytes.Equal(ticketA.GetDiskKey(), keys.DiskKey(testDiskUUID, idA)) {
		t.Fatalf("join ticket has disk key %x and binding %x", ticketA.GetDiskKey(), ticketA.GetDiskBinding())
	}
	if !keys.VerifyDiskBinding(testDiskUUID, []byte("EK digest of machine A"), ticketA.GetDiskBinding()) {
		t.Fatal("the join ticket's binding is not for the attested identity")
	}

	t.Run("the machine that joined gets its disk key with its binding", func(t *testing.T) {
		resp, err := rejoin(a, testDiskUUID, ticketA.GetDiskBinding())
		if err != nil {
			t.Fatalf("IssueRejoinTicket() = %v", err)
		}
		if !bytes.Equal(resp.GetDiskKey(), keys.DiskKey(testDiskUUID, idA)) || !bytes.Equal(resp.GetClusterId(), keys.ClusterID()) {
			t.Fatal("rejoin ticket carries the wrong disk key or cluster ID")
		}
		// The UUID's case does not matter (the disk key ignores it too).
		if _, err := rejoin(a, "0F8B9C2E-5D1A-4B7E-9A3C-2E6F1D4B8A70", ticketA.GetDiskBinding()); err != nil {
			t.Fatalf("IssueRejoinTicket(upper-case UUID) = %v", err)
		}
	})
	t.Run("another attested machine presenting the binding is refused", func(t *testing.T) {
		refused(t, b, testDiskUUID, ticketA.GetDiskBinding())
	})
	t.Run("another machine naming my disk on the join RPC gets a key that is not mine", func(t *testing.T) {
		// Disk UUIDs are public; the join RPC has nothing to check one against, so the key it
		// hands out is that of the disk on the asking machine, and its binding is to that machine.
		ticketB := join(t, b, testDiskUUID)
		if bytes.Equal(ticketB.GetDiskKey(), ticketA.GetDiskKey()) || bytes.Equal(ticketB.GetDiskKey(), keys.LegacyDiskKey(testDiskUUID)) {
			t.Fatal("machine B got machine A's disk key by naming its UUID")
		}
		if keys.VerifyDiskBinding(testDiskUUID, idA, ticketB.GetDiskBinding()) {
			t.Fatal("machine B's binding verifies for machine A")
		}
		// Its binding gets it on rejoin only the same key for nothing.
		resp, err := rejoin(b, testDiskUUID, ticketB.GetDiskBinding())
		if err != nil || !bytes.Equal(resp.GetDiskKey(), ticketB.GetDiskKey()) {
			t.Fatalf("IssueRejoinTicket(B's binding) = %v, want B's own key again", err)
		}
		if es := j.all(); es[len(es)-1].DiskUUID != testDiskUUID {
			t.Fatalf("the ledger entry names disk %q, want %s", es[len(es)-1].DiskUUID, testDiskUUID)
		}
	})
	t.Run("a disk bound before keys named the machine gets its legacy key, only for its owner", func(t *testing.T) {
		legacy := keys.LegacyDiskBinding(testDiskUUID, idA)
		resp, err := rejoin(a, testDiskUUID, legacy)
		if err != nil || !bytes.Equal(resp.GetDiskKey(), keys.LegacyDiskKey(testDiskUUID)) {
			t.Fatalf("IssueRejoinTicket(legacy binding) = %v, want the legacy disk key", err)
		}
		refused(t, b, testDiskUUID, legacy)
	})
	t.Run("another disk's UUID with my binding is refused", func(t *testing.T) {
		refused(t, a, otherDiskUUID, ticketA.GetDiskBinding())
	})
	t.Run("no binding is refused", func(t *testing.T) {
		refused(t, a, testDiskUUID, nil)
	})
	t.Run("a truncated binding is refused", func(t *testing.T) {
		refused(t, a, testDiskUUID, ticketA.GetDiskBinding()[:16])
	})
	t.Run("another machine's own binding does not open my disk", func(t *testing.T) {
		ticketB := join(t, b, otherDiskUUID)
		refused(t, b, testDiskUUID, ticketB.GetDiskBinding())
		if _, err := rejoin(b, otherDiskUUID, ticketB.GetDiskBinding()); err != nil {
			t.Fatalf("IssueRejoinTicket(B's own disk) = %v", err)
		}
	})
	t.Run("an identity without activation is not trusted", func(t *testing.T) {
		// A peer whose attestation key was not activated could show any machine's EK: its claimed
		// identity counts for nothing, the binding falls back to the instance name.
		unactivated := machine("EK digest of machine A")
		unactivated.Activated = false
		refused(t, unactivated, testDiskUUID, ticketA.GetDiskBinding())
		ticket := join(t, unactivated, testDiskUUID)
		if !keys.VerifyDiskBinding(testDiskUUID, []byte("instance/worker-0"), ticket.GetDiskBinding()) {
			t.Fatal("the binding of an unactivated peer is not for its instance name")
		}
	})
	t.Run("a variant without identity binds to the instance name", func(t *testing.T) {
		// TDX: the known weaker binding. Whoever attests at worker-0's address gets worker-0's disk.
		tdx := &atls.Evidence{Variant: "tdx", Activated: false}
		ticket := join(t, tdx, testDiskUUID)
		if !keys.VerifyDiskBinding(testDiskUUID, []byte("instance/worker-0"), ticket.GetDiskBinding()) {
			t.Fatal("the binding of a peer without identity is not for its instance name")
		}
		if _, err := rejoin(&atls.Evidence{Variant: "tdx"}, testDiskUUID, ticket.GetDiskBinding()); err != nil {
			t.Fatalf("IssueRejoinTicket() = %v", err)
		}
		refused(t, a, testDiskUUID, ticket.GetDiskBinding())
		// Another instance name (metadata gave the address to another node) is another identity.
		other := newServer(t, peers{{Name: "worker-1", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, nil)
		if _, err := other.IssueRejoinTicket(peerCtx(tdx), &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()}); reason(err) != ReasonDiskNotBound {
			t.Fatalf("IssueRejoinTicket(as worker-1) = %v, want %s", err, ReasonDiskNotBound)
		}
	})
	t.Run("a malformed disk UUID is refused before the binding is checked", func(t *testing.T) {
		_, err := rejoin(a, "not-a-uuid", ticketA.GetDiskBinding())
		if status.Code(err) != codes.InvalidArgument || reason(err) != ReasonBadDiskUUID {
			t.Fatalf("IssueRejoinTicket() = %v (reason %q), want InvalidArgument %s", err, reason(err), ReasonBadDiskUUID)
		}
	})
	t.Run("metrics count every refusal", func(t *testing.T) {
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.attempts["rejoin/rejected/"+ReasonDiskNotBound] != 8 || m.inFlight != 0 {
			t.Fatalf("metrics %+v, in flight %d", m.attempts, m.inFlight)
		}
	})
}

// TestRejoinChecksAttestationAndInstanceFirst: a valid binding does not replace the checks a join
// makes.
func TestRejoinChecksAttestationAndInstanceFirst(t *testing.T) {
	a := machine("EK digest of machine A")
	binding := testKeys().DiskBinding(testDiskUUID, []byte("EK digest of machine A"))
	req := &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: binding}
	worker := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}

	failing := func(context.Context) ([]string, error) { return nil, errors.New("index 4: expected 00, got 01") }
	if _, err := newServer(t, worker, failing).IssueRejoinTicket(peerCtx(a), req); status.Code(err) != codes.PermissionDenied || reason(err) != ReasonMeasurements {
		t.Fatalf("IssueRejoinTicket(measurements off) = %v, want %s", err, ReasonMeasurements)
	}
	none := func(context.Context) ([]string, error) { return nil, ErrNoEvidence }
	if _, err := newServer(t, worker, none).IssueRejoinTicket(peerCtx(nil), req); reason(err) != ReasonNoEvidence {
		t.Fatalf("IssueRejoinTicket(no evidence) = %v, want %s", err, ReasonNoEvidence)
	}
	elsewhere := peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}}
	if _, err := newServer(t, elsewhere, nil).IssueRejoinTicket(peerCtx(a), req); reason(err) != ReasonUnknownPeer {
		t.Fatalf("IssueRejoinTicket(unknown address) = %v, want %s", err, ReasonUnknownPeer)
	}
	if _, err := newServer(t, worker, nil).IssueRejoinTicket(peerCtx(a), req); err != nil {
		t.Fatalf("IssueRejoinTicket() = %v", err)
	}
}

func TestCanonicalUUID(t *testing.T) {
	for u, want := range map[string]bool{
		testDiskUUID:                            true,
		"0F8B9C2E-5D1A-4B7E-9A3C-2E6F1D4B8A70":  true,
		"":                                      false,
		"0f8b9c2e5d1a4b7e9a3c2e6f1d4b8a70":      false,
		"0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a7":   false,
		"0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a700": false,
		"0f8b9c2e-5d1a-4b7e-9a3c_2e6f1d4b8a70":  false,
		"0f8b9c2g-5d1a-4b7e-9a3c-2e6f1d4b8a70":  false,
		"0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a7\n": false,
	} {
		if canonicalUUID(u) != want {
			t.Errorf("canonicalUUID(%q) = %v, want %v", u, !want, want)
		}
	}
}
