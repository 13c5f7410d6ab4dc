package server

import (
	"bytes"
	"context"
	"net"
	"strings"
	"testing"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
)

// BenchmarkAttestedJoin measures one join RPC as in production, one after the other: the joinservice
// (this package's server with the credentials the binary builds: its swtpm, the cluster policy's
// handshake validator, claim check) and a node on its own swtpm dialing through joindial with a new
// validator each time (a new node has never seen the joinservice), over a new connection: the whole
// handshake, IssueJoinTicket and the node's lock register check. The node is the same TPM each time,
// so the joinservice's activation of the node is remembered after the first join, as for the
// identities of the load harness.
func BenchmarkAttestedJoin(b *testing.B) {
	swCA := vtpmtest.NewSwtpmCA(b) // skips without swtpm
	ctx := context.Background()
	zero := strings.Repeat("00", 32)
	service, node := vtpmtest.StartSwtpm(b, swCA), vtpmtest.StartSwtpm(b, swCA)
	roots := "trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(b))+string(swCA.IssuerPEM(b)), "      ")
	clusterPolicy, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+zero+"}\n  15: {expected: "+zero+"}\n"+roots), "cluster policy", nil)
	if err != nil {
		b.Fatal(err)
	}
	joinPolicy, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+zero+"}\n  15: {nonZero: true}\n"+roots), "join policy", nil)
	if err != nil {
		b.Fatal(err)
	}
	keys := testKeys()
	if err := vtpm.NewLockRegister(service.Open, 15).MarkBootstrapped(ctx, keys.ClusterID()); err != nil {
		b.Fatal(err)
	}
	j := &journal{}
	validator, err := NewHandshakeValidator(clusterPolicy, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	lifted := atls.Limits{PerPeer: 1e9, PerPeerBurst: 1 << 30, Global: 1e9, GlobalBurst: 1 << 30, MaxPeers: 10}
	creds, err := atls.NewCredentials(vtpm.NewIssuer(service.Open, zap.NewNop()), validator, atls.WithLimiter(atls.NewLimiter(lifted)),
		atls.WithClaimCheck(ClaimCheck(func() *policy.Policy { return clusterPolicy }, j, nil)))
	if err != nil {
		b.Fatal(err)
	}
	pki := writePKI(b)
	authority, err := ca.Load(pki)
	if err != nil {
		b.Fatal(err)
	}
	srv := New(Config{APIServerEndpoint: "198.51.100.10:6443", PKIDir: pki}, zap.NewNop(), keys, bytes.Repeat([]byte{2}, 32),
		authority, peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, PolicyCheck(clusterPolicy),
		WithJournal(j), WithLimits(lifted))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	g := grpc.NewServer(grpc.Creds(RecordHandshakes(creds, j, nil)))
	joinproto.RegisterJoinServiceServer(g, srv)
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	b.Cleanup(func() { g.Stop(); <-done })

	nodeIssuer := vtpm.NewIssuer(node.Open, zap.NewNop())
	req := &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(b, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID}
	join := func() {
		v, err := choose.NewValidator(joinPolicy, zap.NewNop())
		if err != nil {
			b.Fatal(err)
		}
		dial, err := joindial.New(nodeIssuer, v, joindial.LockRegisterCheck(15, vtpm.ExpectedLockValue))
		if err != nil {
			b.Fatal(err)
		}
		client, closer, err := dial(ctx, lis.Addr().String())
		if err != nil {
			b.Fatal(err)
		}
		defer closer.Close()
		if _, err := client.IssueJoinTicket(ctx, req); err != nil {
			b.Fatalf("IssueJoinTicket() = %v", err)
		}
	}
	join() // AKs created on both sides, the node's key activated once
	b.ResetTimer()
	for range b.N {
		join()
	}
}
