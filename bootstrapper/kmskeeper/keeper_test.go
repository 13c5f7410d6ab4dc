package kmskeeper

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/afero"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/etcdscan"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kmsrotate"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/internal/secretload"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testPlugin is the plugin process as the keeper sees it, served in this process: the key sets go
// to a real kmsplugin.Service on a real socket, and it remembers the last Encrypt's key ID as the
// Supervisor does from the plugin's events.
type testPlugin struct {
	svc     *kmsplugin.Service
	mu      sync.Mutex
	encrypt string
}

func newTestPlugin() *testPlugin {
	p := &testPlugin{}
	p.svc = kmsplugin.NewService(p)
	return p
}

func (p *testPlugin) SetKeys(set kmsplugin.KeySet) error { return p.svc.SetKeys(set) }
func (p *testPlugin) EncryptKeyID() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.encrypt
}

func (p *testPlugin) Request(method, keyID string, err error, _ time.Duration) {
	if method == kmsplugin.MethodEncrypt && err == nil {
		p.mu.Lock()
		p.encrypt = keyID
		p.mu.Unlock()
	}
}
func (p *testPlugin) Health(bool, string) {}

// cluster is a real API server and etcd that encrypt Secrets through a keeper's plugin.
type cluster struct {
	env    *apiservertest.Env
	client kubernetes.Interface
	etcd   *clientv3.Client
	keys   *clusterkeys.Keys
	fs     afero.Fs
	plugin *testPlugin
	keeper *Keeper
	sock   string
}

func shortDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "kmsk")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func newKeeper(c *cluster, log *zap.Logger) *Keeper {
	k := New(Config{StateDir: "/state", KubernetesDir: "/etc/kubernetes", Socket: c.sock}, c.fs, log, c.plugin,
		func(context.Context) (string, string, error) { return "cp1", "127.0.0.1", nil })
	k.connect = func(string) (*rest.Config, error) { return c.env.Config(apiservertest.AdminUser), nil }
	k.etcd = func(context.Context) (clientv3.KV, func(), error) { return c.etcd, func() {}, nil }
	return k
}

func startCluster(t *testing.T) *cluster {
	t.Helper()
	if err := apiservertest.Available(); err != nil {
		t.Skip(err.Error())
	}
	keys, err := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	dir := shortDir(t)
	c := &cluster{keys: keys, fs: afero.NewMemMapFs(), plugin: newTestPlugin(), sock: filepath.Join(dir, "kms.sock")}
	_ = afero.WriteFile(c.fs, "/etc/kubernetes/admin.conf", []byte("stands in for kubeadm's"), 0o600)
	c.keeper = newKeeper(c, zaptest.NewLogger(t))
	// Init: generation 1 before the API server starts.
	if err := c.keeper.Install(context.Background(), kmsplugin.KeySet{Active: 1, Keys: []kmsplugin.Key{{Generation: 1, KEK: keys.KMSKey(1)}}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	lis, err := kmsplugin.Listen(ctx, c.sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- kmsplugin.Serve(ctx, lis, c.plugin.svc) }()
	t.Cleanup(func() { cancel(); <-served })
	cfg, err := afero.ReadFile(c.fs, EncryptionConfigPath("/etc/kubernetes"))
	if err != nil {
		t.Fatalf("Install wrote no encryption configuration: %v", err)
	}
	cfgPath := filepath.Join(dir, "encryption-config.yaml")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	c.env = apiservertest.Start(t, apiservertest.APIServerArgs("--encryption-provider-config="+cfgPath))
	c.client = c.env.Client(t, apiservertest.AdminUser)
	if c.etcd, err = clientv3.New(clientv3.Config{Endpoints: []string{c.env.EtcdURL()}, DialTimeout: 10 * time.Second, Logger: zap.NewNop()}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.etcd.Close() })

	bg := context.Background()
	for _, ns := range []string{joinconfig.Namespace, "apps"} {
		if _, err := c.client.CoreV1().Namespaces().Create(bg, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	secrets := joinconfig.ClusterSecrets{MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32)}
	if _, err := c.client.CoreV1().Secrets(joinconfig.Namespace).Create(bg, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: joinconfig.SecretName}, Data: secrets.Data()}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.client.CoreV1().Nodes().Create(bg, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cp1",
		Labels: map[string]string{kmsrotate.ControlPlaneLabel: ""}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		if _, err := c.client.CoreV1().Secrets("apps").Create(bg, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s%02d", i)},
			Data: map[string][]byte{"v": []byte(fmt.Sprint(i))}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

func (c *cluster) keyID(g uint32) string { return kmsplugin.KeyID(g, c.keys.KMSKey(g)) }

// scan reads every stored Secret.
func (c *cluster) scan(t *testing.T) etcdscan.Report {
	t.Helper()
	r, err := etcdscan.Scan(context.Background(), c.etcd, etcdscan.Options{Provider: kmsplugin.ProviderName,
		Prefixes: []string{etcdscan.ResourcePrefix("secrets")}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (c *cluster) runKeeper(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.keeper.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	})
}

func (c *cluster) waitReport(t *testing.T, what string, ok func(kmsstate.NodeStatus) bool) kmsstate.NodeStatus {
	t.Helper()
	var last kmsstate.NodeStatus
	if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		st, err := kmsstate.Read(ctx, c.client)
		if err != nil {
			return false, nil
		}
		last = st.Nodes["cp1"]
		return ok(last), nil
	}); err != nil {
		t.Fatalf("waiting for %s; last report %+v", what, last)
	}
	return last
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// The whole rotation against a real API server and etcd, with the keeper following the spec: under
// continuous Secret traffic, generation 1 to 2 with no failed request, every Secret under the new key
// afterwards and the old key gone from the plugin. Then a spec that skips the rotation's steps (a
// new active generation, the old one dropped at once): the keeper keeps the old generation because
// Secrets are stored under it, and the next rotation rewrites them and retires it.
func TestRotationUnderLoad(t *testing.T) {
	c := startCluster(t)
	c.runKeeper(t)
	ctx := context.Background()
	c.waitReport(t, "the first report", func(ns kmsstate.NodeStatus) bool {
		return ns.Healthy && ns.ActiveKeyID == c.keyID(1) && ns.EncryptKeyID == c.keyID(1)
	})
	if r := c.scan(t); r.ByKeyID[c.keyID(1)] != r.Objects || r.Objects < 41 {
		t.Fatalf("before the rotation: %+v", r)
	}

	l := &secretload.Load{}
	lctx, stop := context.WithCancel(ctx)
	loaded := make(chan struct{})
	go func() { defer close(loaded); l.Run(lctx, c.client.CoreV1().Secrets("apps")) }()
	res, err := kmsrotate.Rotate(ctx, c.client, kmsrotate.Options{Progress: testWriter{t}, Poll: 200 * time.Millisecond})
	stop()
	<-loaded
	if err != nil {
		t.Fatalf("Rotate: %v", err)
	}
	t.Logf("rotation 1 -> 2: %+v; load: %d requests, %d failed", res, l.Ops(), l.Failures())
	if l.Failures() != 0 || l.Ops() < 50 {
		t.Errorf("load during the rotation: %d requests, %d failed: %v", l.Ops(), l.Failures(), l.Errors())
	}
	if res.From != 1 || res.To != 2 || res.ToKeyID != c.keyID(2) || res.Rewritten < 41 || len(res.ControlPlanes) != 1 {
		t.Errorf("result = %+v", res)
	}
	r := c.scan(t)
	if r.ByKeyID[c.keyID(1)] != 0 || r.ByKeyID[c.keyID(2)] != r.Objects || r.NotEncrypted != 0 {
		t.Errorf("after the rotation: %+v, want every Secret under %s", r, c.keyID(2))
	}
	if set, _ := c.keeper.Keys(); set.Active != 2 || len(set.Keys) != 1 {
		t.Errorf("the keeper holds %v, want generation 2 only", set)
	}
	saved, _ := afero.ReadFile(c.fs, "/state/"+KeysFileName)
	if set, err := kmsplugin.UnmarshalKeySet(saved); err != nil || set.Active != 2 || len(set.Keys) != 1 {
		t.Errorf("saved key set = %v, %v", set, err)
	}
	list, err := c.client.CoreV1().Secrets("apps").List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) < 40 {
		t.Fatalf("listing Secrets after the rotation: %v", err)
	}
	for _, s := range list.Items {
		if _, err := c.client.CoreV1().Secrets("apps").Get(ctx, s.Name, metav1.GetOptions{}); err != nil {
			t.Errorf("reading %s after the rotation: %v", s.Name, err)
		}
	}

	// Skipping the steps: the keeper activates generation 3 and keeps 2, under which everything is.
	if err := kmsstate.ApplySpec(ctx, c.client, kmsstate.Spec{Generations: []uint32{3}, Active: 3}); err != nil {
		t.Fatal(err)
	}
	ns := c.waitReport(t, "generation 2 kept", func(ns kmsstate.NodeStatus) bool {
		return ns.Active == 3 && strings.Contains(ns.Message, "keeping generation 2")
	})
	if len(ns.Generations) != 2 || ns.Generations[0] != 2 {
		t.Errorf("report = %+v, want generations 2 and 3", ns)
	}
	if _, err := c.client.CoreV1().Secrets("apps").Get(ctx, "s00", metav1.GetOptions{}); err != nil {
		t.Errorf("reading a Secret stored under the kept generation: %v", err)
	}
	res, err = kmsrotate.Rotate(ctx, c.client, kmsrotate.Options{Progress: testWriter{t}, Poll: 200 * time.Millisecond})
	if err != nil {
		t.Fatalf("Rotate after the skipped steps: %v", err)
	}
	if res.To != 4 {
		t.Errorf("result = %+v, want generation 4", res)
	}
	r = c.scan(t)
	if r.ByKeyID[c.keyID(4)] != r.Objects {
		t.Errorf("after the second rotation: %+v, want every Secret under %s", r, c.keyID(4))
	}
	if set, _ := c.keeper.Keys(); set.Active != 4 || len(set.Keys) != 1 {
		t.Errorf("the keeper holds %v, want generation 4 only", set)
	}

	// A restarted daemon restores what the keeper saved.
	again := newKeeper(c, zap.NewNop())
	if ok, err := again.Restore(); !ok || err != nil {
		t.Fatalf("Restore = %v, %v", ok, err)
	}
	if set, _ := again.Keys(); set.Active != 4 {
		t.Errorf("restored %v", set)
	}
}

// Keys the cluster Secret does not derive (another cluster's master secret) are never mixed in: the
// keeper refuses to add generations and says why.
func TestKeeperRefusesAnotherClustersSecret(t *testing.T) {
	c := startCluster(t)
	ctx := context.Background()
	other := joinconfig.ClusterSecrets{MasterSecret: bytes.Repeat([]byte{9}, 32), Salt: bytes.Repeat([]byte{2}, 32)}
	if _, err := c.client.CoreV1().Secrets(joinconfig.Namespace).Update(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: joinconfig.SecretName}, Data: other.Data()}, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.runKeeper(t)
	if err := kmsstate.ApplySpec(ctx, c.client, kmsstate.Spec{Generations: []uint32{1, 2}, Active: 1}); err != nil {
		t.Fatal(err)
	}
	ns := c.waitReport(t, "the refusal", func(ns kmsstate.NodeStatus) bool {
		return strings.Contains(ns.Message, "does not derive this node's key of generation 1")
	})
	if len(ns.Generations) != 1 || !ns.Healthy {
		t.Errorf("report = %+v, want generation 1 only, healthy", ns)
	}
	st, err := kmsstate.Read(ctx, c.client)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range st.Nodes {
		if strings.Contains(fmt.Sprint(n), fmt.Sprintf("%x", c.keys.KMSKey(1))) {
			t.Error("a report shows a key")
		}
	}
	if _, err := c.client.CoreV1().ConfigMaps(joinconfig.Namespace).Get(ctx, kmsstate.ConfigMapName, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		t.Error("no ConfigMap")
	}
}
