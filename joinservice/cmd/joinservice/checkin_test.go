package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// TestAttestedBinaryCheckInAfterBoot runs the real joinservice binary (swtpm, a real API server)
// against nodes whose boot stage extended their lock register (real PCR 15) because no joinservice
// answered while they booted. A booted worker and a booted control plane of this cluster check in;
// a node locked to another cluster is refused on its claims in the handshake; a booted node gets no
// join or rejoin ticket (MEASUREMENT_MISMATCH on index 15). The cluster's policy asks for a zero
// register, as berth mini's does.
func TestAttestedBinaryCheckInAfterBoot(t *testing.T) {
	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm
	env := apiservertest.Shared(t) // skips without kube-apiserver and etcd
	ctx := context.Background()

	serviceTPM := vtpmtest.StartSwtpm(t, swCA)
	if err := vtpm.NewLockRegister(serviceTPM.Open, 15).MarkBootstrapped(ctx, nodelock.ControlPlaneLockID(apiservertest.ClusterID())); err != nil {
		t.Fatal(err)
	}
	zero := strings.Repeat("00", 32)
	roots := "trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	if err := env.InstallBerth(ctx, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {expected: "+zero+", source: fresh node}\n"+roots); err != nil {
		t.Fatal(err)
	}
	joinPolicy, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {nonZero: true, source: bootstrapped}\n"+roots), "join policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	js, addr := startJoinService(t, env, "self: {name: cp-0, role: control-plane, ips: [198.51.100.10]}\npeers:\n  - {name: worker-9, role: worker, ips: [127.0.0.1]}\n",
		nil, "--attestation=tpm", "--tpm="+serviceTPM.Spec, "--attest-rate-per-peer-burst=32", "--rate-per-peer-burst=16")

	// booted dials the joinservice as a node whose boot stage extended lock into its PCR 15, and the
	// node's check against the joinservice: its lock register holds this cluster's control-plane value.
	booted := func(t *testing.T, lock []byte) (joinproto.JoinServiceClient, func()) {
		sw := vtpmtest.StartSwtpm(t, swCA)
		if lock != nil {
			if err := vtpm.NewLockRegister(sw.Open, 15).MarkBootstrapped(ctx, lock); err != nil {
				t.Fatal(err)
			}
		}
		validator, err := choose.NewValidator(joinPolicy, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		dial, err := joindial.New(vtpm.NewIssuer(sw.Open, zap.NewNop()), validator, joindial.ControlPlaneLock(15, vtpm.ExpectedLockValue))
		if err != nil {
			t.Fatal(err)
		}
		client, closer, err := dial(ctx, addr)
		if err != nil {
			t.Fatal(err)
		}
		return client, func() { _ = closer.Close() }
	}
	req := &joinproto.CheckInRequest{DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70", ClusterId: apiservertest.ClusterID()}
	checkIn := func(t *testing.T, lock []byte) (*joinproto.CheckInResponse, error) {
		c, done := booted(t, lock)
		defer done()
		return c.CheckIn(ctx, req)
	}
	// The first check-in waits until the joinservice serves and has read the machine record.
	var resp *joinproto.CheckInResponse
	if err := proctest.WaitReady(ctx, 200*time.Millisecond, 30*time.Second, func(context.Context) error {
		resp, err = checkIn(t, apiservertest.ClusterID())
		if c := status.Code(err); c == codes.Unavailable {
			return err
		}
		return nil
	}, js); err != nil {
		t.Fatalf("waiting for the joinservice: %v", err)
	}
	if err != nil || resp.GetNodeName() != "worker-9" {
		t.Fatalf("check-in of a booted worker of this cluster = %v, %v; want admitted as worker-9", resp, err)
	}
	if resp, err := checkIn(t, nodelock.ControlPlaneLockID(apiservertest.ClusterID())); err != nil || resp.GetNodeName() != "worker-9" {
		t.Fatalf("check-in of a booted control plane of this cluster = %v, %v; want admitted", resp, err)
	}
	if _, err := checkIn(t, nil); err != nil {
		t.Fatalf("check-in of a node whose lock register is still zero (the boot stage's) = %v; want admitted", err)
	}
	_, err = checkIn(t, []byte("some other cluster's ID"))
	if rej, ok := atls.ParseRejection(status.Convert(err).Message()); !ok || rej.Reason != "MEASUREMENT_MISMATCH" {
		t.Fatalf("check-in of a node locked to another cluster = %v; want the refusal on claims", err)
	}
	c, done := booted(t, apiservertest.ClusterID())
	defer done()
	_, err = c.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t), Role: joinproto.Role_ROLE_WORKER, DiskUuid: req.GetDiskUuid()})
	if status.Code(err) != codes.PermissionDenied || reasonOf(err) != "MEASUREMENT_MISMATCH" || !strings.Contains(status.Convert(err).Message(), "index 15") {
		t.Fatalf("join of a booted node = %v; want PermissionDenied MEASUREMENT_MISMATCH naming index 15", err)
	}
	_, err = c.IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: req.GetDiskUuid(), DiskBinding: []byte("any")})
	if status.Code(err) != codes.PermissionDenied || reasonOf(err) != "MEASUREMENT_MISMATCH" {
		t.Fatalf("rejoin of a booted node = %v; want PermissionDenied MEASUREMENT_MISMATCH", err)
	}
}
