package kmsplugin

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/etcdscan"
)

// servePlugin serves svc on a fresh socket until the returned stop is called.
func servePlugin(t testing.TB, sock string, svc *Service) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	lis, err := Listen(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, lis, svc) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve = %v", err)
		}
	}
	t.Cleanup(stop)
	return stop
}

// startEncryptingAPIServer runs a real kube-apiserver and etcd that encrypt Secrets through svc on
// a unix socket, as a control plane's does.
func startEncryptingAPIServer(t testing.TB, svc *Service) (env *apiservertest.Env, sock string, stopPlugin func()) {
	t.Helper()
	apiservertest.Require(t)
	dir := shortTempDir(t)
	sock = filepath.Join(dir, "kms.sock")
	stopPlugin = servePlugin(t, sock, svc)
	cfg, err := EncryptionConfig(sock)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "encryption-config.yaml")
	if err := os.WriteFile(cfgPath, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	env = apiservertest.Start(t, apiservertest.APIServerArgs("--encryption-provider-config="+cfgPath))
	return env, sock, stopPlugin
}

func etcdClient(t testing.TB, env *apiservertest.Env) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func rawValue(t *testing.T, c *clientv3.Client, key string) []byte {
	t.Helper()
	resp, err := c.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 {
		t.Fatalf("etcd has no %s", key)
	}
	return resp.Kvs[0].Value
}

// kmsHealth is the API server's kms-providers readiness check: nil when it passes.
func kmsHealth(ctx context.Context, cs kubernetes.Interface) error {
	_, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz/kms-providers").DoRaw(ctx)
	return err
}

// A real API server stores Secrets through the plugin: in etcd a Secret is the KMS v2 prefix and the
// plugin's key ID, never its data, while a ConfigMap stays readable (the control: the raw read can
// see plaintext). When the plugin stops, the API server's kms-providers check fails; served again,
// it passes.
func TestAPIServerEncryptsThroughThePlugin(t *testing.T) {
	svc := NewService(nil)
	set := KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}
	if err := svc.SetKeys(set); err != nil {
		t.Fatal(err)
	}
	env, sock, stopPlugin := startEncryptingAPIServer(t, svc)
	cs := env.Client(t, apiservertest.AdminUser)
	etcd := etcdClient(t, env)
	ctx := context.Background()
	marker := "berth-kms-test-marker-3f9a1c"
	if _, err := cs.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "s1"}, Data: map[string][]byte{"k": []byte(marker)},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "c1"}, Data: map[string]string{"k": marker},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	raw := rawValue(t, etcd, "/registry/secrets/default/s1")
	if !bytes.HasPrefix(raw, []byte(StoragePrefix)) || bytes.Contains(raw, []byte(marker)) {
		t.Fatalf("stored Secret = %q..., want the KMS v2 prefix and no plaintext", raw[:min(len(raw), 40)])
	}
	if id, err := etcdscan.KeyIDOf(raw, ProviderName); err != nil || id != set.ActiveKeyID() {
		t.Errorf("key ID of the stored Secret = %q, %v; want %q", id, err, set.ActiveKeyID())
	}
	if cm := rawValue(t, etcd, "/registry/configmaps/default/c1"); !bytes.Contains(cm, []byte(marker)) {
		t.Error("the ConfigMap's marker is not in etcd: the raw read cannot see plaintext")
	}
	got, err := cs.CoreV1().Secrets("default").Get(ctx, "s1", metav1.GetOptions{})
	if err != nil || string(got.Data["k"]) != marker {
		t.Fatalf("reading the Secret back = %v, %v", got, err)
	}
	rep, err := etcdscan.Scan(ctx, etcd, etcdscan.Options{Provider: ProviderName,
		Prefixes: []string{etcdscan.ResourcePrefix("secrets")}, Keep: []string{set.ActiveKeyID()}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Objects == 0 || rep.ByKeyID[set.ActiveKeyID()] != rep.Objects || len(rep.Listed) != 0 || rep.NotEncrypted != 0 {
		t.Errorf("scan of the Secrets = %+v, want every one under %s", rep, set.ActiveKeyID())
	}

	// The plugin stops: the health check fails once its last good answer is older than its 20 s TTL.
	if err := kmsHealth(ctx, cs); err != nil {
		t.Fatalf("kms-providers with the plugin running: %v", err)
	}
	stopPlugin()
	start := time.Now()
	if err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return kmsHealth(ctx, cs) != nil, nil
	}); err != nil {
		t.Fatal("kms-providers stays healthy with the plugin stopped")
	}
	t.Logf("kms-providers failed %.1fs after the plugin stopped", time.Since(start).Seconds())
	// The Secret is still readable: the API server keeps the data-encryption key it decrypted.
	if _, err := cs.CoreV1().Secrets("default").Get(ctx, "s1", metav1.GetOptions{}); err != nil {
		t.Errorf("reading a Secret with the plugin stopped: %v", err)
	}
	servePlugin(t, sock, svc)
	start = time.Now()
	if err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return kmsHealth(ctx, cs) == nil, nil
	}); err != nil {
		t.Fatalf("kms-providers does not heal with the plugin back: %v", kmsHealth(ctx, cs))
	}
	t.Logf("kms-providers healthy %.1fs after the plugin came back", time.Since(start).Seconds())
}
