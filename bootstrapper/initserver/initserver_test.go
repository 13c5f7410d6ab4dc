package initserver

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/nodelock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var secret = []byte("correct horse battery staple 123")

type staticHash []byte

func (h staticHash) InitSecretHash(context.Context) ([]byte, error) { return h, nil }

// fakeInit runs scripted phases and records which ran.
type fakeInit struct {
	mu         sync.Mutex
	ran        []string
	failAt     map[string]int // phase → remaining failures
	block      chan struct{}  // if set, the first phase waits on it
	prepareErr error          // what Prepare returns
	restored   string         // what the restore-etcd phase found in the job
}

func (f *fakeInit) Prepare(context.Context, *initcluster.Job) error { return f.prepareErr }

func (f *fakeInit) Phases(restore bool) []initcluster.Phase {
	var ps []initcluster.Phase
	names := []string{"preflight", "kubeadm-config", "certs", "kubeadm-init", "wait-apiserver", "components", initcluster.PhaseAdminKubeconfig}
	if restore {
		names = slices.Insert(names, 3, initcluster.PhaseRestoreEtcd)
	}
	for _, name := range names {
		ps = append(ps, initcluster.Phase{Name: name, Run: func(ctx context.Context, job *initcluster.Job) error {
			f.mu.Lock()
			f.ran = append(f.ran, name)
			if name == initcluster.PhaseRestoreEtcd {
				f.restored = readRestore(job)
			}
			fail := f.failAt[name] > 0
			if fail {
				f.failAt[name]--
			}
			block := f.block
			f.mu.Unlock()
			if block != nil && name == "preflight" {
				select {
				case <-block:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			fmt.Fprintf(job.Out, "output of %s\n", name)
			if fail {
				return errors.New("boom in " + name)
			}
			if name == initcluster.PhaseAdminKubeconfig {
				job.Kubeconfig = []byte("apiVersion: v1\nkind: Config\n")
			}
			return nil
		}})
	}
	return ps
}

func (f *fakeInit) Ran() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.ran...)
}

type harness struct {
	client initproto.InitServiceClient
	fs     afero.Fs
	lock   *nodelock.Lock
	init   *fakeInit
	state  *nodestate.Store
}

func newHarness(t testing.TB, init *fakeInit, opts ...Option) *harness {
	t.Helper()
	fsys := afero.NewMemMapFs()
	h := &harness{
		fs:    fsys,
		lock:  nodelock.New(nodelock.NewFileMarker(fsys, "/state/bootstrapped")),
		init:  init,
		state: nodestate.NewStore(fsys, "/state/node-state.json"),
	}
	sum := sha256.Sum256(secret)
	srv := New(zap.NewNop(), h.lock, staticHash(sum[:]), init, h.state, opts...)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve() = %v", err)
		}
	})
	h.client = initproto.NewInitServiceClient(conn)
	return h
}

func request(master byte) *initproto.InitRequest {
	return &initproto.InitRequest{
		InitSecret:        secret,
		MasterSecret:      bytes.Repeat([]byte{master}, 32),
		Salt:              bytes.Repeat([]byte{2}, 32),
		ClusterName:       "berth",
		KubernetesVersion: clusterconfig.DefaultKubernetesVersion,
		ServiceCidr:       "10.96.0.0/12",
		PodCidr:           "10.244.0.0/16",
	}
}

// transcript runs Init and renders the stream as lines, e.g. "preflight STARTED", "log", "FAILURE PHASE_FAILED certs".
func (h *harness) transcript(t *testing.T, req *initproto.InitRequest) ([]string, error) {
	t.Helper()
	stream, err := h.client.Init(context.Background(), req)
	if err != nil {
		return nil, err
	}
	return render(stream, (*initproto.InitFailure).GetPhase)
}

// render reads an Init or Restore answer to its end as transcript lines: "<phase> <STATE>" for
// progress, one "log" for a run of log lines, "FAILURE <CODE> <detail(failure)>", "SUCCESS".
func render(stream interface {
	Recv() (*initproto.InitResponse, error)
}, detail func(*initproto.InitFailure) string,
) ([]string, error) {
	var lines []string
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return lines, nil
		}
		if err != nil {
			return lines, err
		}
		switch k := resp.GetKind().(type) {
		case *initproto.InitResponse_Progress:
			lines = append(lines, fmt.Sprintf("%s %s", k.Progress.GetPhase(), strings.TrimPrefix(k.Progress.GetState().String(), "PHASE_STATE_")))
		case *initproto.InitResponse_Log:
			if len(lines) == 0 || lines[len(lines)-1] != "log" {
				lines = append(lines, "log")
			}
		case *initproto.InitResponse_Failure:
			lines = append(lines, fmt.Sprintf("FAILURE %s %s", strings.TrimPrefix(k.Failure.GetCode().String(), "FAILURE_CODE_"), detail(k.Failure)))
		case *initproto.InitResponse_Success:
			lines = append(lines, "SUCCESS")
		}
	}
}

func phasesOK(names ...string) []string {
	var out []string
	for _, n := range names {
		out = append(out, n+" STARTED", "log", n+" SUCCEEDED")
	}
	return out
}

func equal(t *testing.T, got, want []string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stream:\n%s\n\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestInitStreamsPhasesInOrder(t *testing.T) {
	h := newHarness(t, &fakeInit{})
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	want := append(phasesOK("preflight", "kubeadm-config", "certs", "kubeadm-init", "wait-apiserver", "components", "admin-kubeconfig"), "SUCCESS")
	equal(t, got, want)
	st, _ := h.state.Load()
	if st == nil || !st.Done || st.Role != nodestate.RoleInit {
		t.Fatalf("node state = %+v, want done init", st)
	}
}

func TestWrongSecretIsGenericAndHarmless(t *testing.T) {
	h := newHarness(t, &fakeInit{})
	for name, mutate := range map[string]func(*initproto.InitRequest){
		"wrong secret": func(r *initproto.InitRequest) { r.InitSecret = []byte("guess") },
		"no secret":    func(r *initproto.InitRequest) { r.InitSecret = nil },
		// A bad field is not even looked at before the secret is checked.
		"wrong secret and bad request": func(r *initproto.InitRequest) { r.InitSecret = []byte("x"); r.ClusterName = "NOT VALID" },
	} {
		t.Run(name, func(t *testing.T) {
			req := request(1)
			mutate(req)
			_, err := h.transcript(t, req)
			if status.Code(err) != codes.PermissionDenied || status.Convert(err).Message() != "init request rejected" {
				t.Fatalf("Init() = %v, want PermissionDenied \"init request rejected\"", err)
			}
		})
	}
	if ran := h.init.Ran(); len(ran) != 0 {
		t.Fatalf("phases ran after a rejected request: %v", ran)
	}
	if locked, _ := h.lock.Locked(); locked {
		t.Fatal("node locked after a rejected request")
	}
	if ok, _ := afero.Exists(h.fs, "/state/bootstrapped"); ok {
		t.Fatal("bootstrap marker written after a rejected request")
	}
	if ok, _ := afero.Exists(h.fs, "/state/node-state.json"); ok {
		t.Fatal("node state written after a rejected request")
	}
}

func TestFailedPhaseResumes(t *testing.T) {
	h := newHarness(t, &fakeInit{failAt: map[string]int{"kubeadm-init": 1}})
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	want := append(phasesOK("preflight", "kubeadm-config", "certs"), "kubeadm-init STARTED", "log", "kubeadm-init FAILED", "FAILURE PHASE_FAILED kubeadm-init")
	equal(t, got, want)

	// A different master secret cannot take over the half-initialized node.
	got, err = h.transcript(t, request(9))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE CLUSTER_MISMATCH "})

	got, err = h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	want = append([]string{"preflight SKIPPED", "kubeadm-config SKIPPED", "certs SKIPPED"},
		phasesOK("kubeadm-init", "wait-apiserver", "components", "admin-kubeconfig")...)
	equal(t, got, append(want, "SUCCESS"))
	ran := strings.Join(h.init.Ran(), ",")
	if want := "preflight,kubeadm-config,certs,kubeadm-init,kubeadm-init,wait-apiserver,components,admin-kubeconfig"; ran != want {
		t.Fatalf("phases ran: %s\nwant:       %s", ran, want)
	}
}

func TestInitOnFinishedNode(t *testing.T) {
	h := newHarness(t, &fakeInit{})
	if _, err := h.transcript(t, request(1)); err != nil {
		t.Fatal(err)
	}
	for _, master := range []byte{1, 7} {
		got, err := h.transcript(t, request(master))
		if err != nil {
			t.Fatal(err)
		}
		equal(t, got, []string{"FAILURE ALREADY_INITIALIZED "})
	}
}

func TestInitOnJoinedNode(t *testing.T) {
	h := newHarness(t, &fakeInit{})
	if err := h.lock.TryLockOnce(context.Background(), "join", []byte("other cluster")); err != nil {
		t.Fatal(err)
	}
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE NODE_LOCKED "})
	if ran := h.init.Ran(); len(ran) != 0 {
		t.Fatalf("phases ran on a joined node: %v", ran)
	}
}

func TestInvalidRequestNamesField(t *testing.T) {
	h := newHarness(t, &fakeInit{})
	req := request(1)
	req.PodCidr = "10.244.0.0"
	stream, err := h.client.Init(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	f := resp.GetFailure()
	if f.GetCode() != initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST || !strings.Contains(f.GetMessage(), "pod_cidr") {
		t.Fatalf("failure = %v, want INVALID_REQUEST naming pod_cidr", f)
	}
	if locked, _ := h.lock.Locked(); locked {
		t.Fatal("node locked by an invalid request")
	}
}

func TestConcurrentInitIsBusy(t *testing.T) {
	block := make(chan struct{})
	h := newHarness(t, &fakeInit{block: block})
	first, err := h.client.Init(context.Background(), request(1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.Recv(); err != nil { // preflight STARTED: the first init holds the node
		t.Fatal(err)
	}
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE BUSY "})
	close(block)
	for {
		if _, err := first.Recv(); err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
			break
		}
	}
}

func TestServeStopsAndFreesPort(t *testing.T) {
	sum := sha256.Sum256(secret)
	fsys := afero.NewMemMapFs()
	srv := New(zap.NewNop(), nodelock.New(), staticHash(sum[:]), &fakeInit{}, nodestate.NewStore(fsys, "/s"))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	// Serving: a request with a wrong secret gets its answer.
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	stream, err := initproto.NewInitServiceClient(conn).Init(ctx, &initproto.InitRequest{InitSecret: []byte("wrong")})
	if err == nil {
		_, err = stream.Recv()
	}
	conn.Close()
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Init with a wrong secret = %v, want PermissionDenied", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve() = %v", err)
	}
	again, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("port %s still taken after Serve returned: %v", addr, err)
	}
	again.Close()
}

// diskRecorder records the cluster IDs of BindWithKeys calls.
type diskRecorder struct {
	mu  sync.Mutex
	ids [][]byte
	err error
}

func (d *diskRecorder) BindWithKeys(_ context.Context, keys *clusterkeys.Keys) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ids = append(d.ids, keys.ClusterID())
	return d.err
}

func TestInitBindsStateDisk(t *testing.T) {
	d := &diskRecorder{}
	h := newHarness(t, &fakeInit{}, WithDisk(d))
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got[len(got)-1:], []string{"SUCCESS"})
	keys, _ := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if len(d.ids) != 1 || !bytes.Equal(d.ids[0], keys.ClusterID()) {
		t.Fatalf("BindWithKeys cluster IDs = %x, want one call for %x", d.ids, keys.ClusterID())
	}
}

func TestInitStopsWhenStateDiskCannotBeBound(t *testing.T) {
	init := &fakeInit{}
	h := newHarness(t, init, WithDisk(&diskRecorder{err: errors.New("rekey failed")}))
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE PHASE_FAILED "})
	if ran := init.Ran(); len(ran) != 0 {
		t.Fatalf("phases ran although the state disk was not bound: %v", ran)
	}
}

// TestWorkerIsRefusedBeforeTheLock: a node that metadata calls a worker answers NOT_CONTROL_PLANE
// and stays fresh (no lock, no state, no phase), so it can still join its cluster.
func TestWorkerIsRefusedBeforeTheLock(t *testing.T) {
	h := newHarness(t, &fakeInit{prepareErr: fmt.Errorf("%w: its role is \"worker\"", initcluster.ErrNotControlPlane)})
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE NOT_CONTROL_PLANE "})
	if locked, _ := h.lock.Locked(); locked {
		t.Fatal("a worker took the node lock for init")
	}
	if st, _ := h.state.Load(); st != nil {
		t.Fatalf("node state written on a worker: %+v", st)
	}
	// A metadata outage is retryable and changes nothing either.
	h = newHarness(t, &fakeInit{prepareErr: errors.New("metadata unreachable")})
	got, err = h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE PHASE_FAILED "})
	if locked, _ := h.lock.Locked(); locked {
		t.Fatal("node locked although metadata could not be read")
	}
}

// TestRequestIsValidatedBeforeTheLock: bad SANs and policies that do not parse are named and
// leave the node fresh.
func TestRequestIsValidatedBeforeTheLock(t *testing.T) {
	for name, tc := range map[string]struct {
		mutate func(*initproto.InitRequest)
		want   string
	}{
		"SAN with a control character": {func(r *initproto.InitRequest) { r.ApiserverCertSans = []string{"api.example\x1b[31m"} }, `apiserver_cert_sans[0] "api.example\x1b[31m"`},
		"SAN that is no name":          {func(r *initproto.InitRequest) { r.ApiserverCertSans = []string{"198.51.100.1", "a..b"} }, "apiserver_cert_sans[1]"},
		"too many SANs":                {func(r *initproto.InitRequest) { r.ApiserverCertSans = make([]string, maxSANs+1) }, "at most 64"},
		"attestation policy garbage":   {func(r *initproto.InitRequest) { r.AttestationPolicy = []byte("{{{") }, "attestation_policy"},
		"attestation policy variant":   {func(r *initproto.InitRequest) { r.AttestationPolicy = []byte("variant: sgx\n") }, "attestation_policy"},
		"image policy garbage": {func(r *initproto.InitRequest) {
			r.Components = &initproto.Components{ImagePolicy: []byte("rules: [{name: NOT A LABEL, registries: [x]}]")}
		}, "components.image_policy"},
	} {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, &fakeInit{})
			req := request(1)
			tc.mutate(req)
			stream, err := h.client.Init(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := stream.Recv()
			if err != nil {
				t.Fatal(err)
			}
			f := resp.GetFailure()
			if f.GetCode() != initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST || !strings.Contains(f.GetMessage(), tc.want) {
				t.Fatalf("failure = %v, want INVALID_REQUEST containing %q", f, tc.want)
			}
			if locked, _ := h.lock.Locked(); locked {
				t.Fatal("node locked by an invalid request")
			}
		})
	}
	// Valid values pass: IPs, names, a wildcard, both policies.
	h := newHarness(t, &fakeInit{})
	req := request(1)
	req.ApiserverCertSans = []string{"198.51.100.10", "2001:db8::1", "api.example.com", "*.berth.example"}
	req.AttestationPolicy = []byte("variant: tpm\nmeasurements:\n  15: {expected: " + strings.Repeat("00", 32) + "}\n" +
		"trustRoots:\n  - pem: |\n" + indent(testCAPEM(t), "      "))
	req.Components = &initproto.Components{ImagePolicy: []byte("rules: [{name: local, registries: [berth.local]}]\n")}
	got, err := h.transcript(t, req)
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got[len(got)-1:], []string{"SUCCESS"})
}

// TestInitCallsAreRateLimitedPerPeer: past the burst, a peer's calls are refused before the secret
// is looked at, and its rejections are logged sampled, not one line each.
func TestInitCallsAreRateLimitedPerPeer(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	fsys := afero.NewMemMapFs()
	sum := sha256.Sum256(secret)
	srv := New(zap.New(core), nodelock.New(), staticHash(sum[:]), &fakeInit{}, nodestate.NewStore(fsys, "/s"))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	defer func() { cancel(); <-done }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := initproto.NewInitServiceClient(conn)
	codesSeen := map[codes.Code]int{}
	const calls = 200
	for i := range calls {
		stream, err := client.Init(ctx, &initproto.InitRequest{InitSecret: []byte(fmt.Sprintf("guess %d", i))})
		if err == nil {
			_, err = stream.Recv()
		}
		st := status.Convert(err)
		switch {
		case st.Code() == codes.PermissionDenied && st.Message() == "init request rejected":
		case st.Code() == codes.ResourceExhausted && st.Message() == "too many init requests: retry later":
		default:
			t.Fatalf("call %d: %v, want the generic rejection or the rate limit", i, err)
		}
		codesSeen[st.Code()]++
	}
	// The burst of 5, plus at most what one token a second refilled while the calls ran.
	if n := codesSeen[codes.PermissionDenied]; n < DefaultLimits.PerPeerBurst || n > DefaultLimits.PerPeerBurst+5 {
		t.Errorf("%d of %d guesses reached the secret check, want about the burst of %d", n, calls, DefaultLimits.PerPeerBurst)
	}
	if n := logs.FilterMessageSnippet("init request").Len(); n > 2 {
		t.Errorf("%d log lines for %d rejected calls of one peer, want at most 2 (sampled)", n, calls)
	}
	if n := logs.FilterMessage("init request rejected").Len(); n != 1 {
		t.Errorf("the first rejection was logged %d times, want once", n)
	}
}

func TestRejectLogSamplesPerPeer(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	now := time.Unix(1000, 0)
	r := newRejectLog(zap.New(core), func() time.Time { return now })
	for range 50 {
		r.note("198.51.100.7", reasonWrongSecret)
		r.note("198.51.100.8", reasonRateLimited)
	}
	if logs.Len() != 2 {
		t.Fatalf("%d lines for two peers' first rejections, want 2", logs.Len())
	}
	now = now.Add(rejectLogInterval)
	r.note("198.51.100.7", reasonRateLimited)
	lines := logs.FilterMessage("init requests rejected").All()
	if len(lines) != 1 {
		t.Fatalf("%d summary lines, want 1", len(lines))
	}
	f := lines[0].ContextMap()
	if f["peer"] != "198.51.100.7" || f["wrongSecret"] != int64(49) || f["rateLimited"] != int64(1) {
		t.Fatalf("summary = %v, want 49 wrong secrets and 1 rate-limited call of 198.51.100.7", f)
	}
	// The table of peers stays bounded.
	for i := range 3 * maxRejectPeers {
		r.note(fmt.Sprintf("10.0.%d.%d", i/256, i%256), reasonWrongSecret)
	}
	if len(r.peers) > maxRejectPeers {
		t.Fatalf("%d peers remembered, want at most %d", len(r.peers), maxRejectPeers)
	}
}

// testCAPEM returns a self-signed CA certificate in PEM, as a policy's trust root.
func testCAPEM(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test EK CA"}, IsCA: true,
		BasicConstraintsValid: true, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return prefix + strings.Join(lines, "\n"+prefix) + "\n"
}

// TestWrongSecretsLeaveTheRightOneIn: wrong secrets use up their own budget (Limits.Global) and
// nothing the right secret needs: past it they are answered RESOURCE_EXHAUSTED, and init with the
// right secret still runs.
func TestWrongSecretsLeaveTheRightOneIn(t *testing.T) {
	h := newHarness(t, &fakeInit{}, WithLimits(atls.Limits{PerPeer: 1000, PerPeerBurst: 1000, Global: 0.001, GlobalBurst: 2}))
	seen := map[codes.Code]int{}
	for i := range 10 {
		stream, err := h.client.Init(context.Background(), &initproto.InitRequest{InitSecret: []byte(fmt.Sprintf("guess %d", i))})
		if err == nil {
			_, err = stream.Recv()
		}
		seen[status.Code(err)]++
	}
	if seen[codes.PermissionDenied] != 2 || seen[codes.ResourceExhausted] != 8 {
		t.Fatalf("answers to 10 wrong secrets: %v, want 2 rejected and 8 rate-limited", seen)
	}
	got, err := h.transcript(t, request(1))
	if err != nil {
		t.Fatalf("init with the right secret after the wrong ones: %v", err)
	}
	equal(t, got[len(got)-1:], []string{"SUCCESS"})
}
