package main

import (
	"context"
	"encoding/hex"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// TestAttestedBinaryTDX runs the real joinservice binary configured for TDX against a real API server.
// It quotes through configfs-tsm under --tdx-root, where a software TD serves it over FUSE, its lock
// RTMR holding the cluster's ID. The cluster policy ships the collateral as a bundle. A node on the same
// platform whose measurements match joins, and checks in turn that the joinservice is bootstrapped into
// the cluster. A node whose RTMR2 differs is refused, with the RTMR's index (3) in the join ledger. After
// the policy is switched to fetching collateral from a PCS that does not answer, the genuine node is
// refused too, as UNTRUSTED_ROOT, and the ledger says that the collateral is unavailable.
func TestAttestedBinaryTDX(t *testing.T) {
	env := apiservertest.Shared(t) // skips without kube-apiserver and etcd
	ctx := context.Background()
	started := time.Now().Add(-time.Second)

	mrtd := [tdx.MeasurementSize]byte{0x4d, 0x52, 0x54, 0x44}
	platform, service, pol := tdxControlPlane(t, mrtd)
	root := t.TempDir()
	tdxtest.ServeTSM(t, service, root) // skips without FUSE; unmounted after the joinservice stops

	if err := env.InstallBerth(ctx, pol.cluster(pol.bundle)); err != nil {
		t.Fatal(err)
	}
	joinPolicy, err := policy.Parse([]byte(pol.join(pol.bundle)), "join policy", nil)
	if err != nil {
		t.Fatal(err)
	}

	js, addr := startJoinService(t, env, "self: {name: cp-0, role: control-plane, ips: [198.51.100.10]}\npeers:\n  - {name: worker-9, role: worker, ips: [127.0.0.1]}\n",
		nil, "--attestation=tdx", "--tdx-root="+root, "--metrics-listen=")

	joinAs, genuine := checkTDXJoins(ctx, t, js, addr, joinPolicy, platform, "5d0c3e5a-8f7b-4c2d-9e1a-6b3f2a7c9d10")

	// Collateral from a PCS that does not answer (a closed port on loopback), nothing cached: the
	// genuine node is refused from the moment the joinservice has the new policy.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadPCS := "http://" + lis.Addr().String()
	lis.Close()
	cms := env.Client(t, apiservertest.AdminUser).CoreV1().ConfigMaps(joinconfig.Namespace)
	cm, err := cms.Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data[joinconfig.KeyAttestationPolicy] = pol.cluster("tdx:\n  pcsURL: " + deadPCS + "\n")
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		_, err := joinAs(genuine)
		return err != nil, nil
	}); err != nil {
		t.Fatalf("the genuine node still joins with collateral from an unreachable PCS: %v", err)
	}

	admin := env.Client(t, apiservertest.AdminUser)
	var mine []ledger.Entry
	// The ledger is written asynchronously: wait until the refusal for the unreachable PCS is in (or
	// time out and judge what is there).
	_ = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		entries, _ := joinledger.Read(ctx, admin, joinconfig.Namespace)
		mine = mine[:0]
		for _, e := range entries {
			if e.Peer == "127.0.0.1" && (e.RPC == "join" || e.RPC == "handshake") && e.Time.After(started) {
				mine = append(mine, e)
			}
		}
		return len(mine) >= 3 && mine[len(mine)-1].Reason == "UNTRUSTED_ROOT", nil
	})
	for _, e := range mine {
		t.Logf("ledger: %s %s %s %s %q", e.RPC, e.Outcome, e.Node, e.Reason, e.Message)
	}
	// The genuine join, the tampered node, the genuine joins while the policy switched, the refusal.
	if len(mine) < 3 {
		t.Fatalf("%d ledger entries from the nodes, want at least 3", len(mine))
	}
	accepted := func(e ledger.Entry) bool {
		return e.RPC == "join" && e.Reason == "" && e.Node == "worker-9" && len(e.EvidenceSHA256) == 64
	}
	if !accepted(mine[0]) {
		t.Errorf("first entry %+v, want the genuine node's join with its evidence digest", mine[0])
	}
	// TDX documents claim nothing: the quote passes the handshake and the policy refuses the call.
	if e := mine[1]; e.RPC != "join" || e.Reason != "MEASUREMENT_MISMATCH" || !strings.Contains(e.Message, "index 3: expected "+zeroMeasurement) || len(e.EvidenceSHA256) != 64 {
		t.Errorf("second entry %+v, want the tampered node's join refused for index 3 (RTMR2) with its evidence digest", e)
	}
	for _, e := range mine[2 : len(mine)-1] {
		if !accepted(e) {
			t.Errorf("entry %+v between the refusals, want only genuine joins", e)
		}
	}
	if e := mine[len(mine)-1]; e.RPC != "handshake" || e.Reason != "UNTRUSTED_ROOT" || !strings.Contains(e.Message, "tdx collateral unavailable") {
		t.Errorf("last entry %+v, want the genuine node refused for unavailable collateral", e)
	}
}

// checkTDXJoins joins a software TD of platform whose measurements match joinPolicy through the
// joinservice js at addr (waiting until it serves), then one whose RTMR2 was extended afterwards,
// which must be refused. It returns the join and the genuine TD for more joins.
func checkTDXJoins(ctx context.Context, t *testing.T, js *proctest.Process, addr string, joinPolicy *policy.Policy, platform *tdxtest.Platform, diskUUID string) (join func(*tdxtest.TD) (*joinproto.IssueJoinTicketResponse, error), genuine *tdxtest.TD) {
	t.Helper()
	joinAs := func(td *tdxtest.TD) (*joinproto.IssueJoinTicketResponse, error) {
		validator, err := choose.NewValidator(joinPolicy, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		dial, err := joindial.New(tdx.NewIssuer(td.Open, nil), validator, joindial.LockRegisterCheck(1+tdx.DefaultLockRTMR, tdx.ExpectedLockRTMR))
		if err != nil {
			t.Fatal(err)
		}
		client, closer, err := dial(ctx, addr)
		if err != nil {
			return nil, err
		}
		defer closer.Close()
		return client.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t), Role: joinproto.Role_ROLE_WORKER, DiskUuid: diskUUID})
	}
	genuine = platform.NewTD()
	var resp *joinproto.IssueJoinTicketResponse
	var err error
	if err := proctest.WaitReady(ctx, 200*time.Millisecond, 30*time.Second, func(context.Context) error {
		if resp, err = joinAs(genuine); status.Code(err) == codes.Unavailable {
			return err
		}
		return nil
	}, js); err != nil {
		t.Fatalf("waiting for the joinservice: %v", err)
	}
	if err != nil || resp.GetNodeName() != "worker-9" {
		t.Fatalf("join of a node whose measurements match: %v", err)
	}
	t.Logf("accepted: ticket for %s", resp.GetNodeName())

	tampered := platform.NewTD()
	dev, err := tampered.Open()
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.ExtendRTMR(ctx, 2, []byte("init=/bin/sh")); err != nil {
		t.Fatal(err)
	}
	if _, err := joinAs(tampered); err == nil {
		t.Fatal("a node whose RTMR2 differs got a ticket")
	} else {
		t.Logf("refused: %v", err)
	}
	return joinAs, genuine
}

// zeroMeasurement is an RTMR nothing was extended into, in hex.
var zeroMeasurement = strings.Repeat("00", tdx.MeasurementSize)

// tdxPolicy writes the attestation policies of a test cluster on a software TDX platform: the
// image's measurements (MRTD and RTMR0 to RTMR2), the platform's root, and the collateral.
type tdxPolicy struct {
	image, roots string
	// bundle is the collateral as a bundle of the platform's.
	bundle string
}

// cluster is the cluster's policy with collateral: a fresh node's RTMR3 is zero.
func (p tdxPolicy) cluster(collateral string) string {
	return "variant: tdx\n" + p.image + "  4: {expected: " + zeroMeasurement + ", source: fresh node (RTMR3)}\n" + p.roots + collateral
}

// join is the policy a node checks the joinservice against: its RTMR3 holds a cluster's lock value.
func (p tdxPolicy) join(collateral string) string {
	return "variant: tdx\n" + p.image + "  4: {nonZero: true, source: bootstrapped}\n" + p.roots + collateral
}

// tdxControlPlane makes a software TDX platform whose TDs measure mrtd, and the TD of the control
// plane the joinservice runs on, its lock RTMR marked bootstrapped for the test API server's
// cluster; pol writes the policies for the platform.
func tdxControlPlane(t *testing.T, mrtd [tdx.MeasurementSize]byte) (platform *tdxtest.Platform, service *tdxtest.TD, pol tdxPolicy) {
	t.Helper()
	platform, err := tdxtest.New(tdxtest.Options{MRTD: mrtd})
	if err != nil {
		t.Fatal(err)
	}
	service = platform.NewTD()
	lock, err := tdx.NewLockRegister(service.Open, tdx.DefaultLockRTMR)
	if err != nil {
		t.Fatal(err)
	}
	if err := lock.MarkBootstrapped(t.Context(), apiservertest.ClusterID()); err != nil {
		t.Fatal(err)
	}
	bundle, err := platform.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	pol.image = "measurements:\n" +
		"  0: {expected: " + hex.EncodeToString(mrtd[:]) + ", source: the image's TD build}\n" +
		"  1: {expected: " + zeroMeasurement + ", source: firmware (RTMR0)}\n" +
		"  2: {expected: " + zeroMeasurement + ", source: boot loader (RTMR1)}\n" +
		"  3: {expected: " + zeroMeasurement + ", source: kernel command line (RTMR2)}\n"
	pol.roots = "trustRoots:\n  - pem: |\n" + indent(string(platform.RootPEM()), "      ")
	pol.bundle = "tdx:\n  collateralBundle:\n    json: |\n" + indent(string(bundle), "      ")
	return platform, service, pol
}
