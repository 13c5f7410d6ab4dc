package joincluster

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"math/big"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/command/commandtest"
	"github.com/berth-k8s/berth/internal/cpfiles"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// startCounter counts the kubelet's starts and stops; running says whether it runs now.
type startCounter struct {
	n, stops int
	running  bool
}

func (s *startCounter) Start(context.Context) error { s.n++; s.running = true; return nil }

func (s *startCounter) Stop(context.Context) error { s.stops++; s.running = false; return nil }

var self = metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}

func ticket() *joinproto.IssueJoinTicketResponse {
	return &joinproto.IssueJoinTicketResponse{
		NodeName:                   "worker-0",
		ApiServerEndpoint:          "198.51.100.10:6443",
		BootstrapToken:             "abcdef.0123456789abcdef",
		DiscoveryTokenCaCertHashes: []string{"sha256:0011"},
		KubeletCert:                []byte("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"),
		ClusterId:                  []byte{1, 2, 3},
	}
}

type fixture struct {
	j       *Joiner
	rec     *commandtest.Recorder
	fs      afero.Fs
	lock    *nodelock.Lock
	kubelet *startCounter
	state   *nodestate.Store
}

func newFixture(script map[string][]commandtest.Result) *fixture {
	f := &fixture{rec: &commandtest.Recorder{Script: script}, fs: afero.NewMemMapFs(), kubelet: &startCounter{}}
	f.lock = nodelock.New(nodelock.NewFileMarker(f.fs, "/state/bootstrapped"))
	f.state = nodestate.NewStore(f.fs, "/state/node-state.json")
	f.j = New(Config{StateDir: "/state", CRISocket: "unix:///c.sock"}, zap.NewNop(), f.fs, f.lock,
		&kubeadm.Runner{Path: "kubeadm", Exec: f.rec}, f.kubelet, f.state)
	return f
}

func key(t *testing.T) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestJoinSucceeds(t *testing.T) {
	f := newFixture(nil)
	if err := f.j.Join(context.Background(), self, ticket(), key(t)); err != nil {
		t.Fatal(err)
	}
	if got, want := f.rec.String(), "kubeadm join --config /state/kubeadm-join.yaml"; got != want {
		t.Fatalf("calls = %q, want %q", got, want)
	}
	if f.kubelet.n != 1 {
		t.Fatalf("kubelet started %d times, want 1", f.kubelet.n)
	}
	st, _ := f.state.Load()
	if st == nil || !st.Done || st.Role != nodestate.RoleJoin || st.NodeName != "worker-0" {
		t.Fatalf("state = %+v", st)
	}
	pem, err := afero.ReadFile(f.fs, "/var/lib/kubelet/pki/kubelet-client-current.pem")
	if err != nil || !strings.Contains(string(pem), "BEGIN CERTIFICATE") || !strings.Contains(string(pem), "BEGIN PRIVATE KEY") {
		t.Fatalf("kubelet client certificate = %q, %v", pem, err)
	}
	if ok, _ := afero.Exists(f.fs, "/state/kubeadm-join.yaml"); ok {
		t.Fatal("join config with the bootstrap token left on disk")
	}
	if ok, _ := afero.Exists(f.fs, "/etc/kubernetes/berth/admission.yaml"); ok {
		t.Fatal("a worker wrote the API server's admission configuration")
	}
}

// Join runs in a synctest bubble, so the retry delay passes in the bubble's time.
func TestJoinRetriesTransientFailures(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(map[string][]commandtest.Result{
			"kubeadm join": {
				{Output: "error: Get https://198.51.100.10:6443: connection refused", Err: errors.New("exit 1")},
				{Output: "error: TLS handshake timeout", Err: errors.New("exit 1")},
				{},
			},
		})
		start := time.Now()
		if err := f.j.Join(context.Background(), self, ticket(), key(t)); err != nil {
			t.Fatalf("Join() = %v", err)
		}
		if took, want := time.Since(start), 2*5*time.Second; took != want {
			t.Fatalf("two retries took %s, want %s (the default retry delay twice)", took, want)
		}
		want := strings.Join([]string{
			"kubeadm join --config /state/kubeadm-join.yaml",
			"kubeadm reset --force --cri-socket unix:///c.sock",
			"kubeadm join --config /state/kubeadm-join.yaml",
			"kubeadm reset --force --cri-socket unix:///c.sock",
			"kubeadm join --config /state/kubeadm-join.yaml",
		}, "\n")
		if got := f.rec.String(); got != want {
			t.Fatalf("calls:\n%s\nwant:\n%s", got, want)
		}
		if st, _ := f.state.Load(); st == nil || !st.Done {
			t.Fatalf("state after join = %+v, want done", st)
		}
		// Stopped before each reset, started again for each retry.
		if f.kubelet.stops != 2 || f.kubelet.n != 3 || !f.kubelet.running {
			t.Fatalf("kubelet stopped %d and started %d times (running %v), want 2, 3 and running", f.kubelet.stops, f.kubelet.n, f.kubelet.running)
		}
	})
}

func TestJoinStopsWhileWaitingToRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(map[string][]commandtest.Result{"kubeadm join": {{Output: "dial tcp: i/o timeout", Err: errors.New("exit 1")}}})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- f.j.Join(ctx, self, ticket(), key(t)) }()
		synctest.Wait() // Join failed once and waits to retry
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Join() = %v, want context.Canceled", err)
		}
		if got, want := f.rec.String(), "kubeadm join --config /state/kubeadm-join.yaml\nkubeadm reset --force --cri-socket unix:///c.sock"; got != want {
			t.Fatalf("calls:\n%s\nwant:\n%s", got, want)
		}
	})
}

func TestJoinGivesUp(t *testing.T) {
	for name, tc := range map[string]struct {
		output string
		want   error
		calls  int
	}{
		"permanent":         {"error: couldn't validate the identity of the API server: cluster CA found in cluster-info does not match", ErrJoinFailed, 1},
		"transient forever": {"dial tcp: i/o timeout", ErrJoinRetriesExhausted, 3},
	} {
		// In a synctest bubble: the retry delays pass in the bubble's time.
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(map[string][]commandtest.Result{"kubeadm join": {{Output: tc.output, Err: errors.New("exit 1")}}})
				err := f.j.Join(context.Background(), self, ticket(), key(t))
				if !errors.Is(err, tc.want) {
					t.Fatalf("Join() = %v, want %v", err, tc.want)
				}
				joins := 0
				for _, c := range f.rec.Calls() {
					if strings.HasPrefix(c, "kubeadm join") {
						joins++
					}
				}
				if joins != tc.calls {
					t.Fatalf("kubeadm join ran %d times, want %d", joins, tc.calls)
				}
				st, _ := f.state.Load()
				if st == nil || st.Done {
					t.Fatalf("state after failed join = %+v, want locked, not done", st)
				}
			})
		})
	}
}

func TestJoinRejectsBadTickets(t *testing.T) {
	for name, mutate := range map[string]func(*joinproto.IssueJoinTicketResponse){
		"other node":    func(t *joinproto.IssueJoinTicketResponse) { t.NodeName = "worker-1" },
		"no cluster id": func(t *joinproto.IssueJoinTicketResponse) { t.ClusterId = nil },
		"no CA pin":     func(t *joinproto.IssueJoinTicketResponse) { t.DiscoveryTokenCaCertHashes = nil },
		"escaping file": func(t *joinproto.IssueJoinTicketResponse) {
			t.ControlPlaneFiles = []*joinproto.File{{Path: "../../etc/shadow", Data: []byte("x")}}
		},
		"configuration file outside berth/": func(t *joinproto.IssueJoinTicketResponse) {
			t.ControlPlaneFiles = []*joinproto.File{{Path: "ca.crt", Data: []byte("x")},
				{Root: joinproto.FileRoot_FILE_ROOT_KUBERNETES, Path: "manifests/kube-apiserver.yaml", Data: []byte("x")}}
		},
		"configuration file escaping berth/": func(t *joinproto.IssueJoinTicketResponse) {
			t.ControlPlaneFiles = []*joinproto.File{{Root: joinproto.FileRoot_FILE_ROOT_KUBERNETES, Path: "berth/../admin.conf", Data: []byte("x")}}
		},
		"patch escaping its directory": func(t *joinproto.IssueJoinTicketResponse) {
			t.ControlPlaneFiles = []*joinproto.File{{Root: joinproto.FileRoot_FILE_ROOT_PATCHES, Path: "../node-state.json", Data: []byte("x")}}
		},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(nil)
			tk := ticket()
			mutate(tk)
			err := f.j.Join(context.Background(), self, tk, key(t))
			if !errors.Is(err, ErrInvalidTicket) {
				t.Fatalf("Join() = %v, want ErrInvalidTicket", err)
			}
			if len(f.rec.Calls()) != 0 {
				t.Fatalf("kubeadm ran for a bad ticket: %v", f.rec.Calls())
			}
			// Nothing of the ticket was written: no file, not even the ones with good paths.
			for _, dir := range []string{"/etc/kubernetes", "/state/kubeadm-patches"} {
				if ok, _ := afero.Exists(f.fs, dir); ok {
					t.Errorf("%s exists after a refused ticket", dir)
				}
			}
			if (strings.Contains(name, "escaping") || strings.Contains(name, "outside")) && !errors.Is(err, cpfiles.ErrUnsafePath) {
				t.Errorf("Join() = %v: a bad path must be cpfiles.ErrUnsafePath", err)
			}
		})
	}
}

// TestControlPlaneConfigurationFilesWritten: a control-plane ticket's cluster configuration files
// (the operator's admission configuration, audit policy and patches) land where berth init wrote
// them on the first control plane, before kubeadm join runs, and kubeadm join gets the patches
// directory.
func TestControlPlaneConfigurationFilesWritten(t *testing.T) {
	f := newFixture(nil)
	cp := metadata.Instance{Name: "worker-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.11"}}
	c, _, err := clusterconfig.Parse([]byte(`apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
apiServer:
  audit: {policy: {rules: [{level: Metadata}]}}
  admission:
    plugins: [{name: EventRateLimit, configuration: {apiVersion: eventratelimit.admission.k8s.io/v1alpha1, kind: Configuration, limits: [{type: Server, qps: 5}]}}]
patches: [{target: kube-apiserver, type: merge, patch: "metadata: {annotations: {a: b}}"}]
`))
	if err != nil {
		t.Fatal(err)
	}
	files, err := cpfiles.Render(&c)
	if err != nil {
		t.Fatal(err)
	}
	// A stale patch of an earlier attempt or configuration must not apply.
	if err := afero.WriteFile(f.fs, "/state/kubeadm-patches/etcd000+strategic.yaml", []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	tk := ticket()
	tk.ControlPlaneFiles = append([]*joinproto.File{{Path: "ca.crt", Data: []byte("crt"), Mode: 0o644}}, files...)
	var joinCfg []byte
	var atJoin []string
	f.rec.Hook = func(argv []string) error {
		if argv[1] == "join" {
			joinCfg, _ = afero.ReadFile(f.fs, "/state/kubeadm-join.yaml")
			for _, p := range []string{"/etc/kubernetes/berth/admission.yaml", "/etc/kubernetes/berth/audit-policy.yaml", "/state/kubeadm-patches/kube-apiserver000+merge.yaml"} {
				if ok, _ := afero.Exists(f.fs, p); ok {
					atJoin = append(atJoin, p)
				}
			}
		}
		return nil
	}
	if err := f.j.Join(context.Background(), cp, tk, key(t)); err != nil {
		t.Fatal(err)
	}
	if len(atJoin) != 3 {
		t.Errorf("when kubeadm join ran, only %v existed", atJoin)
	}
	for _, file := range files {
		p, _ := cpfiles.Dirs{Kubernetes: "/etc/kubernetes", State: "/state"}.Path(file)
		got, err := afero.ReadFile(f.fs, p)
		if err != nil || string(got) != string(file.GetData()) {
			t.Errorf("%s = %q, %v; want the ticket's", p, got, err)
		}
	}
	if admission, _ := afero.ReadFile(f.fs, "/etc/kubernetes/berth/admission.yaml"); !strings.Contains(string(admission), "EventRateLimit") {
		t.Errorf("the admission configuration is not the ticket's:\n%s", admission)
	}
	if ok, _ := afero.Exists(f.fs, "/state/kubeadm-patches/etcd000+strategic.yaml"); ok {
		t.Error("a stale patch stayed in the patches directory")
	}
	if !strings.Contains(string(joinCfg), "patches:\n  directory: /state/kubeadm-patches") {
		t.Errorf("kubeadm join's configuration does not name the patches directory:\n%s", joinCfg)
	}
}

func TestJoinAfterInitWonDoesNothing(t *testing.T) {
	f := newFixture(nil)
	if err := f.lock.TryLockOnce(context.Background(), "init", []byte{9}); err != nil {
		t.Fatal(err)
	}
	if err := f.j.Join(context.Background(), self, ticket(), key(t)); err != nil {
		t.Fatalf("Join() after init won = %v, want nil", err)
	}
	if len(f.rec.Calls()) != 0 || f.kubelet.n != 0 {
		t.Fatalf("joiner acted after losing the lock: calls %v, kubelet starts %d", f.rec.Calls(), f.kubelet.n)
	}
}

func TestControlPlaneFilesWritten(t *testing.T) {
	f := newFixture(nil)
	cp := metadata.Instance{Name: "worker-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.11"}}
	tk := ticket()
	tk.ControlPlaneFiles = []*joinproto.File{{Path: "etcd/ca.key", Data: []byte("key"), Mode: 0o600}, {Path: "ca.crt", Data: []byte("crt"), Mode: 0o644}}
	if err := f.j.Join(context.Background(), cp, tk, key(t)); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{"/etc/kubernetes/pki/etcd/ca.key": "key", "/etc/kubernetes/pki/ca.crt": "crt"} {
		got, err := afero.ReadFile(f.fs, p)
		if err != nil || string(got) != want {
			t.Errorf("%s = %q, %v; want %q", p, got, err, want)
		}
	}
	info, _ := f.fs.Stat("/etc/kubernetes/pki/etcd/ca.key")
	if info.Mode().Perm() != 0o600 {
		t.Errorf("etcd/ca.key mode = %v, want 0600", info.Mode().Perm())
	}
	// The cluster configuration kubeadm join reads points the API server at its admission configuration.
	if admission, err := afero.ReadFile(f.fs, "/etc/kubernetes/berth/admission.yaml"); err != nil || !strings.Contains(string(admission), "berth-host") {
		t.Errorf("admission configuration = %q, %v", admission, err)
	}
}

// testCA is a cluster CA that signs kubelet client certificates like the joinservice does.
type testCA struct {
	key  *ecdsa.PrivateKey
	cert *x509.Certificate
	pem  []byte
}

func newTestCA(t *testing.T) *testCA {
	k := key(t)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{key: k, cert: cert, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

func (c *testCA) pin() string {
	sum := sha256.Sum256(c.cert.RawSubjectPublicKeyInfo)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func (c *testCA) sign(t *testing.T, cn string, pub any) []byte {
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: cn, Organization: []string{"system:nodes"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, pub, c.key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// workerTicket is a tokenless ticket for worker-0 and nodeKey, as the joinservice issues to workers.
func workerTicket(t *testing.T, ca *testCA, nodeKey *ecdsa.PrivateKey) *joinproto.IssueJoinTicketResponse {
	tk := ticket()
	tk.BootstrapToken = ""
	tk.DiscoveryTokenCaCertHashes = []string{ca.pin()}
	tk.ClusterCaCert = ca.pem
	tk.KubeletCert = ca.sign(t, "system:node:worker-0", nodeKey.Public())
	return tk
}

func TestTokenlessJoinUsesDiscoveryFile(t *testing.T) {
	f := newFixture(nil)
	ca, nodeKey := newTestCA(t), key(t)
	tk := workerTicket(t, ca, nodeKey)
	const discovery = "/state/" + DiscoveryFileName
	var joinCfg, kubeconfig []byte
	f.rec.Hook = func(argv []string) error {
		if argv[1] != "join" {
			return nil
		}
		info, err := f.fs.Stat(discovery)
		if err != nil {
			return err
		}
		if info.Mode().Perm() != 0o600 {
			t.Errorf("discovery file mode = %v, want 0600", info.Mode().Perm())
		}
		joinCfg, _ = afero.ReadFile(f.fs, "/state/kubeadm-join.yaml")
		kubeconfig, err = afero.ReadFile(f.fs, discovery)
		return err
	}
	if err := f.j.Join(context.Background(), self, tk, nodeKey); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(joinCfg), "kubeConfigPath: "+discovery) || strings.Contains(string(joinCfg), "token") {
		t.Errorf("join config is not tokenless file discovery:\n%s", joinCfg)
	}
	cfg, err := clientcmd.Load(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cur := cfg.Contexts[cfg.CurrentContext]
	cluster, user := cfg.Clusters[cur.Cluster], cfg.AuthInfos[cur.AuthInfo]
	if cluster.Server != "https://198.51.100.10:6443" || string(cluster.CertificateAuthorityData) != string(ca.pem) {
		t.Errorf("cluster = %s with CA %q", cluster.Server, cluster.CertificateAuthorityData)
	}
	if string(user.ClientCertificateData) != string(tk.KubeletCert) || !strings.Contains(string(user.ClientKeyData), "PRIVATE KEY") || user.Token != "" {
		t.Errorf("credentials are not the ticket's certificate and the node's key: %+v", user)
	}
	if ok, _ := afero.Exists(f.fs, discovery); ok {
		t.Error("discovery file with the node's key left on disk after the join")
	}
	if ok, _ := afero.Exists(f.fs, "/var/lib/kubelet/pki/kubelet-client-current.pem"); !ok {
		t.Error("kubelet client certificate not pre-placed")
	}
}

func TestTokenlessJoinRejectsBadTickets(t *testing.T) {
	ca, nodeKey := newTestCA(t), key(t)
	other := newTestCA(t)
	for name, mutate := range map[string]func(*joinproto.IssueJoinTicketResponse){
		"no CA":         func(tk *joinproto.IssueJoinTicketResponse) { tk.ClusterCaCert = nil },
		"CA not pinned": func(tk *joinproto.IssueJoinTicketResponse) { tk.DiscoveryTokenCaCertHashes = []string{other.pin()} },
		"no pin":        func(tk *joinproto.IssueJoinTicketResponse) { tk.DiscoveryTokenCaCertHashes = nil },
		"other node's CN": func(tk *joinproto.IssueJoinTicketResponse) {
			tk.KubeletCert = ca.sign(t, "system:node:worker-1", nodeKey.Public())
		},
		"other key": func(tk *joinproto.IssueJoinTicketResponse) {
			tk.KubeletCert = ca.sign(t, "system:node:worker-0", key(t).Public())
		},
		"signed by another": func(tk *joinproto.IssueJoinTicketResponse) {
			tk.KubeletCert = other.sign(t, "system:node:worker-0", nodeKey.Public())
		},
		"cert not PEM": func(tk *joinproto.IssueJoinTicketResponse) { tk.KubeletCert = []byte("garbage") },
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(nil)
			tk := workerTicket(t, ca, nodeKey)
			mutate(tk)
			if err := f.j.Join(context.Background(), self, tk, nodeKey); !errors.Is(err, ErrInvalidTicket) {
				t.Fatalf("Join() = %v, want ErrInvalidTicket", err)
			}
			if len(f.rec.Calls()) != 0 {
				t.Fatalf("kubeadm ran for a bad ticket: %v", f.rec.Calls())
			}
			if ok, _ := afero.Exists(f.fs, "/state/"+DiscoveryFileName); ok {
				t.Fatal("discovery file written for a bad ticket")
			}
			if locked, _ := f.lock.Locked(); locked {
				t.Fatal("node lock taken for a bad ticket")
			}
		})
	}
}

// diskRecorder records Bind calls and what the node had written by then.
type diskRecorder struct {
	fs      afero.Fs
	err     error
	calls   int
	key     []byte
	id      []byte
	binding []byte
	// stateBefore is whether node state existed when Bind ran.
	stateBefore bool
}

func (d *diskRecorder) Bind(_ context.Context, key, clusterID, binding []byte) error {
	d.calls++
	d.key, d.id, d.binding = key, clusterID, binding
	d.stateBefore, _ = afero.Exists(d.fs, "/state/node-state.json")
	return d.err
}

func TestJoinBindsStateDiskAfterLockBeforeAnyWrite(t *testing.T) {
	f := newFixture(nil)
	d := &diskRecorder{fs: f.fs}
	f.j.WithDisk(d)
	tk := ticket()
	tk.DiskKey, tk.DiskBinding = bytes.Repeat([]byte{7}, 32), []byte("binding")
	if err := f.j.Join(context.Background(), self, tk, key(t)); err != nil {
		t.Fatal(err)
	}
	if d.calls != 1 || !bytes.Equal(d.key, tk.DiskKey) || !bytes.Equal(d.id, tk.ClusterId) || string(d.binding) != "binding" {
		t.Fatalf("Bind calls=%d key/id/binding=%x/%x/%q", d.calls, d.key, d.id, d.binding)
	}
	if d.stateBefore {
		t.Fatal("node state was written before the state disk was bound")
	}
}

func TestJoinStopsWhenStateDiskCannotBeBound(t *testing.T) {
	f := newFixture(nil)
	f.j.WithDisk(&diskRecorder{fs: f.fs, err: errors.New("rekey failed")})
	err := f.j.Join(context.Background(), self, ticket(), key(t))
	if err == nil || !strings.Contains(err.Error(), "binding the state disk") {
		t.Fatalf("Join = %v, want a state disk error", err)
	}
	if f.rec.String() != "" {
		t.Fatalf("kubeadm ran after the disk could not be bound: %q", f.rec.String())
	}
}

// kmsRecorder records Install calls and whether kubeadm had run by then.
type kmsRecorder struct {
	rec   *commandtest.Recorder
	err   error
	sets  []kmsplugin.KeySet
	early bool // Install ran before any kubeadm command
}

func (k *kmsRecorder) Install(_ context.Context, set kmsplugin.KeySet) error {
	k.sets = append(k.sets, set)
	k.early = k.rec.String() == ""
	return k.err
}

func cpTicket() *joinproto.IssueJoinTicketResponse {
	tk := ticket()
	tk.ControlPlaneFiles = []*joinproto.File{{Path: "ca.crt", Data: []byte("crt"), Mode: 0o644}}
	tk.KmsKeys = []*joinproto.KMSKey{{Generation: 1, Key: bytes.Repeat([]byte{1}, 32)}, {Generation: 2, Key: bytes.Repeat([]byte{2}, 32)}}
	tk.KmsActiveGeneration = 2
	return tk
}

// A control plane installs the ticket's KMS keys before kubeadm join starts its API server; a worker
// installs none.
func TestJoinInstallsKMSKeysOfAControlPlane(t *testing.T) {
	cp := metadata.Instance{Name: "worker-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.11"}}
	f := newFixture(nil)
	k := &kmsRecorder{rec: f.rec}
	f.j.WithKMS(k)
	if err := f.j.Join(context.Background(), cp, cpTicket(), key(t)); err != nil {
		t.Fatal(err)
	}
	if len(k.sets) != 1 || !k.early {
		t.Fatalf("Install calls = %d, before kubeadm: %v", len(k.sets), k.early)
	}
	want := kmsplugin.KeySet{Active: 2, Keys: []kmsplugin.Key{{Generation: 1, KEK: bytes.Repeat([]byte{1}, 32)}, {Generation: 2, KEK: bytes.Repeat([]byte{2}, 32)}}}
	if !k.sets[0].Equal(want) {
		t.Errorf("installed %v, want %v", k.sets[0], want)
	}

	w := newFixture(nil)
	wk := &kmsRecorder{rec: w.rec}
	w.j.WithKMS(wk)
	if err := w.j.Join(context.Background(), self, ticket(), key(t)); err != nil {
		t.Fatal(err)
	}
	if len(wk.sets) != 0 {
		t.Error("a worker installed KMS keys")
	}
}

// A control-plane ticket without a usable key set, a worker ticket with keys, or keys that cannot be
// installed stop the join before kubeadm runs.
func TestJoinRefusesBadKMSKeys(t *testing.T) {
	cp := metadata.Instance{Name: "worker-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.11"}}
	noKeys := cpTicket()
	noKeys.KmsKeys = nil
	badActive := cpTicket()
	badActive.KmsActiveGeneration = 3
	shortKey := cpTicket()
	shortKey.KmsKeys[0].Key = []byte("short")
	workerWithKeys := ticket()
	workerWithKeys.KmsKeys = cpTicket().KmsKeys
	for name, c := range map[string]struct {
		self   metadata.Instance
		ticket *joinproto.IssueJoinTicketResponse
		err    error
		want   string
	}{
		"control plane without keys": {cp, noKeys, nil, "invalid KMS key set"},
		"active generation not held": {cp, badActive, nil, "active generation 3"},
		"short key":                  {cp, shortKey, nil, "has 5 bytes"},
		"worker with keys":           {self, workerWithKeys, nil, "worker's ticket carries KMS keys"},
		"keys that do not install":   {cp, cpTicket(), errors.New("disk full"), "installing the KMS keys: disk full"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(nil)
			f.j.WithKMS(&kmsRecorder{rec: f.rec, err: c.err})
			err := f.j.Join(context.Background(), c.self, c.ticket, key(t))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Join = %v, want %q", err, c.want)
			}
			if f.rec.String() != "" {
				t.Fatalf("kubeadm ran: %q", f.rec.String())
			}
		})
	}
}
