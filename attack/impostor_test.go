package attack

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinproto"
)

// impostor is a "joinservice" that is only a bootstrapped worker's TPM: it hands every node a ticket
// for the real cluster with a disk key the attacker knows.
type impostor struct {
	joinproto.UnimplementedJoinServiceServer
	diskKey []byte
}

func (i impostor) IssueJoinTicket(context.Context, *joinproto.IssueJoinTicketRequest) (*joinproto.IssueJoinTicketResponse, error) {
	return &joinproto.IssueJoinTicketResponse{NodeName: "worker-1", ClusterId: apiservertest.ClusterID(), DiskKey: i.diskKey,
		DiskBinding: bytes.Repeat([]byte{7}, 32)}, nil
}

// CheckIn answers every joined node REVOKED: a node that believed it would lock itself (its kubelet
// off, its sealed disk key destroyed).
func (impostor) CheckIn(context.Context, *joinproto.CheckInRequest) (*joinproto.CheckInResponse, error) {
	st, err := status.New(codes.PermissionDenied, "this machine was removed from the cluster").
		WithDetails(&errdetails.ErrorInfo{Reason: joinledger.ReasonRevoked, Domain: "berth.joinservice"})
	if err != nil {
		return nil, err
	}
	return nil, st.Err()
}

// TestWorkerPosingAsJoinService: a privileged pod on a joined worker serves the join protocol over
// attested TLS with the worker's own TPM: same image, lock register set to the cluster's ID, so it
// passes the image's join policy (which has no cluster-specific attestation-key CA). A fresh node
// must not take its ticket (or the disk key in it): only a control plane's lock register holds the
// control plane's value for the cluster (nodelock.ControlPlaneLockID), and an extend cannot turn a
// worker's value into it. Nor may a joined node take its REVOKED answer to a check-in, which would
// lock a genuine node: the same check applies to the check-in's answer, admission or refusal.
func TestWorkerPosingAsJoinService(t *testing.T) {
	c := startJoinCluster(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	// The bootstrapped worker's TPM: its boot stage extended the cluster ID, as a worker's does.
	workerTPM := vtpmtest.StartSwtpm(t, c.swCA)
	if err := vtpm.NewLockRegister(workerTPM.Open, vtpm.DefaultLockPCR).MarkBootstrapped(ctx, apiservertest.ClusterID()); err != nil {
		t.Fatal(err)
	}
	creds, err := atls.NewCredentials(vtpm.NewIssuer(workerTPM.Open, zap.NewNop()), nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(creds))
	attackerKey := bytes.Repeat([]byte{0xa5}, 32)
	joinproto.RegisterJoinServiceServer(srv, impostor{diskKey: attackerKey})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-served })

	// The fresh node: a genuine TPM, the image's join policy (no AK CA: it probes and activates), and
	// the ticket check the bootstrapper applies (bootstrapper/cmd/bootstrapper's lockCheck).
	node := softTPM(t, c.nodeCA, genuinePCRs())
	validator, err := choose.NewValidator(c.activating, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	check := joindial.ControlPlaneLock(vtpm.DefaultLockPCR, vtpm.ExpectedLockValue)
	dial, err := joindial.New(node, validator, check)
	if err != nil {
		t.Fatal(err)
	}
	client, closer, err := dial(ctx, lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer closer.Close()
	ticket, err := client.IssueJoinTicket(ctx, workerRequest(t, diskA))
	if err == nil {
		t.Fatalf("the fresh node took the impostor's ticket (disk key %x…)", ticket.GetDiskKey()[:4])
	}
	if reasonOf(err) != joindial.ReasonNotBound {
		t.Fatalf("the impostor's ticket: %v, want %s (the attested handshake itself passes the image's policy)", err, joindial.ReasonNotBound)
	}
	t.Logf("a worker's TPM posing as the joinservice, against a fresh node with the image's policy: refused %s: %s",
		reasonOf(err), err)
	_, err = client.CheckIn(ctx, &joinproto.CheckInRequest{DiskUuid: diskA, ClusterId: apiservertest.ClusterID()})
	if reasonOf(err) != joindial.ReasonNotBound {
		t.Fatalf("the impostor's REVOKED answer to a check-in: %v, want %s", err, joindial.ReasonNotBound)
	}
	t.Logf("the impostor's REVOKED answer to a joined node's check-in: refused %s", reasonOf(err))

	// The check can pass: the real joinservice, whose TPM holds the control plane's value, passes it
	// for its own ticket under the same policy.
	var p peer.Peer
	conn := c.connWith(t, workerIP(37), node, c.activating)
	real, err := joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, workerRequest(t, diskB), grpc.Peer(&p))
	if err != nil {
		t.Fatal(err)
	}
	info, ok := p.AuthInfo.(atls.AuthInfo)
	if !ok || info.Evidence == nil {
		t.Fatal("the real joinservice's connection carries no evidence")
	}
	if err := check(info.Evidence, real.GetClusterId()); err != nil {
		t.Fatalf("the real joinservice fails the check: %v", err)
	}
	var pc peer.Peer
	admitted, err := joinproto.NewJoinServiceClient(conn).CheckIn(ctx, &joinproto.CheckInRequest{DiskUuid: diskB, ClusterId: real.GetClusterId()}, grpc.Peer(&pc))
	if err != nil {
		t.Fatalf("the real joinservice's check-in of the node it just admitted: %v", err)
	}
	if info, ok := pc.AuthInfo.(atls.AuthInfo); !ok || info.Evidence == nil || check(info.Evidence, real.GetClusterId()) != nil {
		t.Fatal("the real joinservice's check-in answer fails the check")
	}
	t.Logf("the real joinservice (a control plane) passes the same check for its ticket and its check-in (admitted as %s)", admitted.GetNodeName())
}
