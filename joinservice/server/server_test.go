package server

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/cpfiles"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Disk UUIDs of the tests.
const (
	testDiskUUID  = "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"
	otherDiskUUID = "7c1e4a9b-2f3d-4e8a-b6c5-9d0e1f2a3b4c"
)

type peers []metadata.Instance

func (p peers) Peers(context.Context) ([]metadata.Instance, error) { return p, nil }

// testKeys are the cluster keys of the tests' joinservices.
func testKeys() *clusterkeys.Keys {
	keys, _ := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	return keys
}

// newServer returns a joinservice for meta without attestation checks (attest nil).
func newServer(t *testing.T, meta peers, attest AttestationCheck, opts ...Option) *Server {
	t.Helper()
	pki := catest.WriteControlPlaneDir(t)
	authority, err := ca.Load(pki)
	if err != nil {
		t.Fatal(err)
	}
	return New(Config{APIServerEndpoint: "198.51.100.10:6443", KubernetesVersion: "v1.34.2", PKIDir: pki},
		zap.NewNop(), testKeys(), bytes.Repeat([]byte{2}, 32), authority, meta, attest, opts...)
}

func start(t *testing.T, meta peers, opts ...Option) joinproto.JoinServiceClient {
	t.Helper()
	return serveInsecure(t, newServer(t, meta, nil, opts...))
}

// serveInsecure serves srv without transport security on loopback until the test ends and returns a
// client of it.
func serveInsecure(t *testing.T, srv *Server) joinproto.JoinServiceClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	joinproto.RegisterJoinServiceServer(g, srv)
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(); g.Stop(); <-done })
	return joinproto.NewJoinServiceClient(conn)
}

func csr(t testing.TB, cn string) []byte {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: cn}}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func reason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

func TestWorkerTicketBindsAttestedName(t *testing.T) {
	c := start(t, peers{{Name: "worker-7", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}})
	resp, err := c.IssueJoinTicket(context.Background(), &joinproto.IssueJoinTicketRequest{
		KubeletCsr: csr(t, "system:node:control-plane-0"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID,
	})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(resp.GetKubeletCert())
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if cert.Subject.CommonName != "system:node:worker-7" || resp.GetNodeName() != "worker-7" {
		t.Fatalf("certificate for %q, ticket for %q; want worker-7", cert.Subject.CommonName, resp.GetNodeName())
	}
	if len(resp.GetControlPlaneFiles()) != 0 || len(resp.GetKmsKeys()) != 0 || resp.GetKmsActiveGeneration() != 0 {
		t.Fatal("worker got control-plane files or KMS keys")
	}
	if len(resp.GetDiscoveryTokenCaCertHashes()) != 1 || len(resp.GetClusterCaCert()) == 0 || len(resp.GetClusterId()) != 32 {
		t.Fatalf("ticket incomplete: %v", resp)
	}
	// A worker joins with its certificate (kubeadm discovery file): no bootstrap token, no API write.
	if resp.GetBootstrapToken() != "" || resp.GetBootstrapTokenExpiry() != nil {
		t.Fatal("worker ticket carries a bootstrap token")
	}
}

func TestControlPlaneTicketCarriesFiles(t *testing.T) {
	c := start(t, peers{{Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}})
	resp, err := c.IssueJoinTicket(context.Background(), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(resp.GetControlPlaneFiles()); got != len(controlPlaneFiles) {
		t.Fatalf("got %d control-plane files, want %d", got, len(controlPlaneFiles))
	}
	if resp.GetBootstrapToken() != "" || len(resp.GetClusterCaCert()) == 0 || len(resp.GetKubeletCert()) == 0 {
		t.Fatal("control-plane ticket is not for a tokenless join")
	}
	// Without a rotation, the KMS key of generation 1.
	if k := resp.GetKmsKeys(); len(k) != 1 || k[0].GetGeneration() != 1 || !bytes.Equal(k[0].GetKey(), testKeys().KMSKey(1)) || resp.GetKmsActiveGeneration() != 1 {
		t.Fatalf("KMS keys of a control-plane ticket = %v, active %d", k, resp.GetKmsActiveGeneration())
	}
}

// During a rotation a joining control plane gets every generation the spec holds, with the active
// one; a spec the joinservice cannot read refuses the join instead of handing out a partial key set.
func TestControlPlaneTicketCarriesEveryKMSGeneration(t *testing.T) {
	self := peers{{Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}}
	req := &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID}
	c := start(t, self, WithKMSSpec(func(context.Context) (kmsstate.Spec, error) {
		return kmsstate.Spec{Generations: []uint32{3, 4}, Active: 4}, nil
	}))
	resp, err := c.IssueJoinTicket(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	k := resp.GetKmsKeys()
	if len(k) != 2 || k[0].GetGeneration() != 3 || k[1].GetGeneration() != 4 || resp.GetKmsActiveGeneration() != 4 ||
		!bytes.Equal(k[0].GetKey(), testKeys().KMSKey(3)) || !bytes.Equal(k[1].GetKey(), testKeys().KMSKey(4)) {
		t.Fatalf("KMS keys = %v, active %d; want generations 3 and 4, active 4", k, resp.GetKmsActiveGeneration())
	}
	for name, f := range map[string]KMSSpec{
		"unreadable": func(context.Context) (kmsstate.Spec, error) { return kmsstate.Spec{}, errors.New("forbidden") },
		"invalid": func(context.Context) (kmsstate.Spec, error) {
			return kmsstate.Spec{Generations: []uint32{1}, Active: 2}, nil
		},
	} {
		c := start(t, self, WithKMSSpec(f))
		_, err := c.IssueJoinTicket(context.Background(), req)
		if status.Code(err) != codes.Unavailable || reason(err) != ReasonInternal {
			t.Errorf("%s spec: IssueJoinTicket = %v, want Unavailable INTERNAL", name, err)
		}
	}
}

// A control-plane ticket carries, besides the PKI's shared keys, the files of the cluster
// configuration in force (read from the ConfigMap the cluster keeps): the admission configuration,
// the audit policy, the patches. A worker's ticket carries none. A configuration the joinservice
// cannot read refuses the join without saying why, and frees the control-plane slot.
func TestControlPlaneTicketCarriesClusterConfigFiles(t *testing.T) {
	c, _, err := clusterconfig.Parse([]byte(`apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
apiServer: {audit: {policy: {rules: [{level: Metadata}]}}}
patches: [{target: etcd, patch: "metadata: {annotations: {a: b}}"}]
`))
	if err != nil {
		t.Fatal(err)
	}
	cm, err := clusterconfig.ConfigMap(c)
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(cm)
	fromCluster := WithClusterFiles(func(ctx context.Context) ([]*joinproto.File, error) { return cpfiles.FromCluster(ctx, client) })
	want, err := cpfiles.Render(&c)
	if err != nil {
		t.Fatal(err)
	}
	cp := peers{{Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}}
	req := &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID}
	resp, err := start(t, cp, fromCluster).IssueJoinTicket(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	files := resp.GetControlPlaneFiles()
	if len(files) != len(controlPlaneFiles)+len(want) {
		t.Fatalf("%d files, want %d PKI files and %d of the configuration", len(files), len(controlPlaneFiles), len(want))
	}
	got := map[string]*joinproto.File{}
	for _, f := range files {
		got[f.GetRoot().String()+":"+f.GetPath()] = f
	}
	for _, w := range want {
		if f := got[w.GetRoot().String()+":"+w.GetPath()]; f == nil || !bytes.Equal(f.GetData(), w.GetData()) {
			t.Errorf("ticket's %v %s = %v, want the configuration's", w.GetRoot(), w.GetPath(), f)
		}
	}
	for _, name := range []string{"FILE_ROOT_KUBERNETES:" + cpfiles.AuditPolicyFile, "FILE_ROOT_KUBERNETES:" + cpfiles.AdmissionConfigFile, "FILE_ROOT_PATCHES:etcd000+strategic.yaml", "FILE_ROOT_UNSPECIFIED:ca.key"} {
		if got[name] == nil {
			t.Errorf("the ticket has no %s", name)
		}
	}

	worker := peers{{Name: "w-1", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}
	wresp, err := start(t, worker, fromCluster).IssueJoinTicket(context.Background(),
		&joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
	if err != nil || len(wresp.GetControlPlaneFiles()) != 0 {
		t.Fatalf("worker ticket: %v, %d files; want none", err, len(wresp.GetControlPlaneFiles()))
	}

	var failing atomic.Bool
	failing.Store(true)
	srv := start(t, cp, WithClusterFiles(func(ctx context.Context) ([]*joinproto.File, error) {
		if failing.Load() {
			return nil, errors.New("configmaps \"berth-cluster-config\" is forbidden: secret detail")
		}
		return cpfiles.FromCluster(ctx, client)
	}))
	_, err = srv.IssueJoinTicket(context.Background(), req)
	if status.Code(err) != codes.Unavailable || reason(err) != ReasonInternal || strings.Contains(err.Error(), "secret detail") {
		t.Fatalf("unreadable configuration: IssueJoinTicket = %v, want Unavailable INTERNAL without the cause", err)
	}
	failing.Store(false)
	if _, err := srv.IssueJoinTicket(context.Background(), req); err != nil {
		t.Fatalf("the next join after a refused one (slot released?): %v", err)
	}
}

func TestRejections(t *testing.T) {
	for name, tc := range map[string]struct {
		meta   peers
		req    *joinproto.IssueJoinTicketRequest
		code   codes.Code
		reason string
	}{
		"unknown peer": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER},
			code: codes.PermissionDenied, reason: ReasonUnknownPeer,
		},
		"worker asks for control plane": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE},
			code: codes.PermissionDenied, reason: ReasonRoleMismatch,
		},
		"garbage CSR": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: []byte("garbage"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID},
			code: codes.InvalidArgument, reason: ReasonBadCSR,
		},
		"no disk UUID": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER},
			code: codes.InvalidArgument, reason: ReasonBadDiskUUID,
		},
		"disk UUID without dashes": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: strings.ReplaceAll(testDiskUUID, "-", "")},
			code: codes.InvalidArgument, reason: ReasonBadDiskUUID,
		},
		"disk UUID in braces": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: "{" + testDiskUUID + "}"},
			code: codes.InvalidArgument, reason: ReasonBadDiskUUID,
		},
		"disk UUID with a path": {
			meta: peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
			req:  &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: "../../../../../../../../etc/passwd.."},
			code: codes.InvalidArgument, reason: ReasonBadDiskUUID,
		},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := start(t, tc.meta).IssueJoinTicket(context.Background(), tc.req)
			if status.Code(err) != tc.code || reason(err) != tc.reason {
				t.Fatalf("IssueJoinTicket() = %v (reason %q), want %s %s", err, reason(err), tc.code, tc.reason)
			}
		})
	}
}

// journal records what the server tells the ledger.
type journal struct {
	mu          sync.Mutex
	entries     []ledger.Entry
	rateLimited map[string]int
}

func (j *journal) Record(e ledger.Entry) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.entries = append(j.entries, e)
}
func (j *journal) RecordRateLimited(p string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.rateLimited == nil {
		j.rateLimited = map[string]int{}
	}
	j.rateLimited[p]++
}

func (j *journal) RecordCounted(p, reason string) { j.RecordRateLimited(p + "/" + reason) }

func (j *journal) all() []ledger.Entry {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]ledger.Entry(nil), j.entries...)
}

// counter counts what the server tells the metrics.
type counter struct {
	mu       sync.Mutex
	attempts map[string]int
	inFlight int
	stages   map[string]int
}

func (c *counter) Attempt(rpc, outcome, reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.attempts[rpc+"/"+outcome+"/"+reason]++
}
func (c *counter) Latency(rpc, stage string, _ time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stages[rpc+"/"+stage]++
}
func (c *counter) InFlight(d int) { c.mu.Lock(); defer c.mu.Unlock(); c.inFlight += d }

func TestLedgerAndMetricsSeeEveryAttempt(t *testing.T) {
	j, m := &journal{}, &counter{attempts: map[string]int{}, stages: map[string]int{}}
	c := start(t, peers{{Name: "worker-7", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, WithJournal(j), WithObserver(m))
	ctx := context.Background()
	ticket, err := c.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID}); reason(err) != ReasonRoleMismatch {
		t.Fatalf("IssueJoinTicket() = %v, want %s", err, ReasonRoleMismatch)
	}
	if _, err := c.IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: testDiskUUID, DiskBinding: ticket.GetDiskBinding()}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: otherDiskUUID, DiskBinding: ticket.GetDiskBinding()}); reason(err) != ReasonDiskNotBound {
		t.Fatalf("IssueRejoinTicket(other disk) = %v, want %s", err, ReasonDiskNotBound)
	}
	es := j.all()
	if len(es) != 4 {
		t.Fatalf("ledger got %d entries, want 4: %+v", len(es), es)
	}
	ok, rej, rejoin, notBound := es[0], es[1], es[2], es[3]
	if ok.Outcome != ledger.OutcomeAccepted || ok.Node != "worker-7" || ok.Role != "worker" || ok.Peer != "127.0.0.1" || ok.RPC != "join" || ok.Time.IsZero() {
		t.Fatalf("accepted entry %+v", ok)
	}
	if rej.Outcome != ledger.OutcomeRejected || rej.Reason != ReasonRoleMismatch || rej.Node != "worker-7" || rej.Role != "control-plane" || !strings.Contains(rej.Message, "metadata says") {
		t.Fatalf("rejected entry %+v", rej)
	}
	if rejoin.RPC != "rejoin" || rejoin.Outcome != ledger.OutcomeAccepted || rejoin.Node != "worker-7" {
		t.Fatalf("rejoin entry %+v", rejoin)
	}
	if notBound.RPC != "rejoin" || notBound.Outcome != ledger.OutcomeRejected || notBound.Reason != ReasonDiskNotBound ||
		notBound.Node != "worker-7" || notBound.Message != "this disk does not belong to the attested machine" {
		t.Fatalf("refused rejoin entry %+v", notBound)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.attempts["join/accepted/"] != 1 || m.attempts["join/rejected/"+ReasonRoleMismatch] != 1 || m.inFlight != 0 || m.stages["join/total"] != 2 || m.stages["join/issue"] != 1 ||
		m.attempts["rejoin/accepted/"] != 1 || m.attempts["rejoin/rejected/"+ReasonDiskNotBound] != 1 || m.stages["rejoin/total"] != 2 {
		t.Fatalf("metrics %+v %+v in flight %d", m.attempts, m.stages, m.inFlight)
	}
}

func TestRateLimitIsCheapAndNamed(t *testing.T) {
	j := &journal{}
	c := start(t, peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, WithJournal(j),
		WithLimits(atls.Limits{PerPeer: 0.001, PerPeerBurst: 3, Global: 1000, GlobalBurst: 1000}))
	req := &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID}
	for i := range 3 {
		if _, err := c.IssueJoinTicket(context.Background(), req); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	_, err := c.IssueJoinTicket(context.Background(), req)
	if status.Code(err) != codes.ResourceExhausted || reason(err) != ReasonRateLimited {
		t.Fatalf("IssueJoinTicket() = %v, want ResourceExhausted %s", err, ReasonRateLimited)
	}
	if len(j.all()) != 3 || j.rateLimited["127.0.0.1"] != 1 {
		t.Fatalf("ledger %d entries, rate-limited %v", len(j.all()), j.rateLimited)
	}
	// The tickets budget (the global limit) is spent only by calls that pass every cheap check: any
	// number of refused calls leave it whole, and it applies across peers.
	c = start(t, peers{{Name: "w", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
		WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 0.001, GlobalBurst: 1}))
	for range 5 {
		if _, err := c.IssueRejoinTicket(context.Background(), &joinproto.IssueRejoinTicketRequest{}); reason(err) != ReasonBadDiskUUID {
			t.Fatalf("IssueRejoinTicket() = %v, want %s", err, ReasonBadDiskUUID)
		}
	}
	if _, err := c.IssueJoinTicket(context.Background(), req); err != nil {
		t.Fatalf("a join after refused calls: %v, want its ticket", err)
	}
	if _, err := c.IssueJoinTicket(context.Background(), req); reason(err) != ReasonRateLimited {
		t.Fatalf("IssueJoinTicket() = %v, want %s", err, ReasonRateLimited)
	}
}

// recordingLock records the slots taken and what became of them.
type recordingLock struct {
	mu      sync.Mutex
	holders []string
	// joining and released record the slots' ends: node=address, holder.
	joining, released []string
	failJoining       error
	waitedFor         string
}

func (l *recordingLock) Lock(_ context.Context, holder string) (ControlPlaneSlot, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.holders = append(l.holders, holder)
	return &recordingSlot{l: l, holder: holder}, nil
}

type recordingSlot struct {
	l      *recordingLock
	holder string
}

func (s *recordingSlot) Release() {
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	s.l.released = append(s.l.released, s.holder)
}

func (s *recordingSlot) WaitedFor() string { return s.l.waitedFor }

func (s *recordingSlot) Joining(_ context.Context, node, address string) error {
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	if s.l.failJoining != nil {
		return s.l.failJoining
	}
	s.l.joining = append(s.l.joining, node+"="+address)
	return nil
}

// TestControlPlaneJoinTakesTheLock: a control-plane ticket takes the slot and hands it to the
// node's join (the slot stays taken until the join finished); a worker ticket never touches it.
func TestControlPlaneJoinTakesTheLock(t *testing.T) {
	l := &recordingLock{waitedFor: "control plane cp-0 is joining"}
	j := &journal{}
	c := start(t, peers{{Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}}, WithControlPlaneLock(l), WithJournal(j))
	if _, err := c.IssueJoinTicket(context.Background(), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID}); err != nil {
		t.Fatal(err)
	}
	if len(l.holders) != 1 || l.holders[0] != "cp-1" || len(l.joining) != 1 || l.joining[0] != "cp-1=127.0.0.1" || len(l.released) != 0 {
		t.Fatalf("slot: taken by %v, handed to joins %v, released %v", l.holders, l.joining, l.released)
	}
	// The ledger shows that this join waited for the one before.
	if es := j.all(); len(es) != 1 || es[0].Outcome != ledger.OutcomeAccepted || !strings.Contains(es[0].Message, "for the control-plane slot (control plane cp-0 is joining)") {
		t.Fatalf("ledger %+v, want the accepted join naming the join it waited for", es)
	}
	w := &recordingLock{}
	c = start(t, peers{{Name: "w-1", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}}, WithControlPlaneLock(w))
	if _, err := c.IssueJoinTicket(context.Background(), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_WORKER, DiskUuid: testDiskUUID}); err != nil {
		t.Fatal(err)
	}
	if len(w.holders) != 0 {
		t.Fatalf("a worker join took the control-plane slot: %v", w.holders)
	}
}

// TestControlPlaneSlotNotHandedOverIsNoTicket: when the slot cannot be handed to the join, no ticket
// is issued and the slot is released.
func TestControlPlaneSlotNotHandedOverIsNoTicket(t *testing.T) {
	l := &recordingLock{failJoining: errors.New("lease update refused")}
	c := start(t, peers{{Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}}, WithControlPlaneLock(l))
	resp, err := c.IssueJoinTicket(context.Background(), &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t, "x"), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: testDiskUUID})
	if err == nil || resp != nil || status.Code(err) != codes.Unavailable {
		t.Fatalf("IssueJoinTicket() = %v, %v; want Unavailable and no ticket", resp, err)
	}
	if len(l.released) != 1 {
		t.Fatalf("slot not released: %v", l.released)
	}
}

func TestLocalLockRespectsContext(t *testing.T) {
	l := NewLocalLock()
	slot, err := l.Lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := l.Lock(ctx, "b"); !errors.Is(err, ErrControlPlaneBusy) {
		t.Fatalf("Lock() = %v, want ErrControlPlaneBusy", err)
	}
	if err := slot.Joining(context.Background(), "a", "127.0.0.1"); err != nil {
		t.Fatal(err)
	}
	slot.Release() // a second end of the same slot changes nothing
	slot2, err := l.Lock(context.Background(), "b")
	if err != nil {
		t.Fatal(err)
	}
	slot2.Release()
	slot3, err := l.Lock(context.Background(), "c")
	if err != nil {
		t.Fatal(err)
	}
	slot3.Release()
}
