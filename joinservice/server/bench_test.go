package server

import (
	"bytes"
	"context"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
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
	"github.com/berth-k8s/berth/joinservice/ca/catest"
)

// BenchmarkAttestedJoin measures one join RPC as in production, one after the other: the joinservice
// (this package's server with the credentials the binary builds: its swtpm, the cluster policy's
// handshake validator, claim check) and a node on its own swtpm dialing through joindial with a new
// validator each time (a new node has never seen the joinservice), over a new connection: the whole
// handshake, IssueJoinTicket and the node's lock register check. The node is the same TPM each time,
// so the joinservice's activation of the node is remembered after the first join, as for the
// identities of the load harness.
//
// activated: the node's join policy has no akRoots, so it probes the joinservice's identity and
// challenges its key, and the joinservice quotes and activates for every join. certified-session: the
// joinservice's AK is certified by the cluster's AK CA (as the binary does at start) and it serves a
// session proof; the node's join policy lists the CA: no probe, and no TPM command on the
// joinservice's side per join. Besides wall time it reports the CPU of this process (server and
// node code) and of both swtpm processes per join.
func BenchmarkAttestedJoin(b *testing.B) {
	b.Run("activated", func(b *testing.B) { benchAttestedJoin(b, false) })
	b.Run("certified-session", func(b *testing.B) { benchAttestedJoin(b, true) })
}

func benchAttestedJoin(b *testing.B, session bool) {
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
	akCA, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		b.Fatal(err)
	}
	if session {
		joinPolicy.AKRoots = []*x509.Certificate{akCA.Cert}
	}
	if err := vtpm.NewLockRegister(service.Open, 15).MarkBootstrapped(ctx, keys.ClusterID()); err != nil {
		b.Fatal(err)
	}
	j := &journal{}
	validator, err := NewHandshakeValidator(clusterPolicy, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	lifted := atls.Limits{PerPeer: 1e9, PerPeerBurst: 1 << 30, Global: 1e9, GlobalBurst: 1 << 30, MaxPeers: 10}
	serviceIssuer := vtpm.NewIssuer(service.Open, zap.NewNop())
	opts := []atls.Option{atls.WithLimiter(atls.NewLimiter(lifted)), atls.WithClaimCheck(ClaimCheck(func() *policy.Policy { return clusterPolicy }, j, nil))}
	if session {
		if err := serviceIssuer.CertifyAK(ctx, akCA.Certify); err != nil {
			b.Fatal(err)
		}
		sp := atls.NewSessionProof(serviceIssuer, zap.NewNop())
		sctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = sp.Run(sctx) }()
		b.Cleanup(func() { stop(); <-done })
		if err := sp.Renew(ctx); err != nil {
			b.Fatal(err)
		}
		opts = append(opts, atls.WithSessionProof(sp))
	}
	creds, err := atls.NewCredentials(serviceIssuer, validator, opts...)
	if err != nil {
		b.Fatal(err)
	}
	pki := catest.WriteControlPlaneDir(b)
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
	cpu0, svc0, node0 := processCPU(), procCPU(service.PID()), procCPU(node.PID())
	b.ResetTimer()
	for range b.N {
		join()
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(float64(processCPU()-cpu0)/n/1e6, "cpu-ms/join")
	b.ReportMetric((procCPU(service.PID())-svc0)/n*1e3, "joinservice-swtpm-cpu-ms/join")
	b.ReportMetric((procCPU(node.PID())-node0)/n*1e3, "node-swtpm-cpu-ms/join")
}

// processCPU is the CPU time this process has used, in nanoseconds.
func processCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// procCPU is the user+system CPU seconds of process pid (clock ticks of 10 ms).
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseFloat(fields[11], 64)
	st, _ := strconv.ParseFloat(fields[12], 64)
	return (ut + st) / 100
}
