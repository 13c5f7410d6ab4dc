//go:build e2e

package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/etcdscan"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/mini"
	"github.com/berth-k8s/berth/internal/secretload"
)

// masterKeys reads the cluster's master secret from the operator's master-secret.json.
func masterKeys(t testing.TB, dir string) (master []byte, keys *clusterkeys.Keys) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "master-secret.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ms struct{ MasterSecret, Salt string }
	if err := json.Unmarshal(b, &ms); err != nil {
		t.Fatal(err)
	}
	master, _ = base64.StdEncoding.DecodeString(ms.MasterSecret)
	salt, _ := base64.StdEncoding.DecodeString(ms.Salt)
	keys, err = clusterkeys.New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	return master, keys
}

// encodings are the ways a secret may show up in a file.
func encodings(name string, s []byte) map[string][]byte {
	return map[string][]byte{
		name + " (raw)":       s,
		name + " (hex)":       []byte(hex.EncodeToString(s)),
		name + " (HEX)":       []byte(strings.ToUpper(hex.EncodeToString(s))),
		name + " (base64)":    []byte(base64.StdEncoding.EncodeToString(s)),
		name + " (base64url)": []byte(base64.RawURLEncoding.EncodeToString(s)),
	}
}

// nodeProc is the PID of node's daemon name, as the cluster's state file records it now.
func nodeProc(t testing.TB, dir, node, name string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st mini.State
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	pid := 0
	for _, p := range st.Procs[node] {
		if p.Name == name {
			pid = p.PID // the last one started
		}
	}
	if pid == 0 {
		t.Fatalf("no %s recorded for %s", name, node)
	}
	return pid
}

// pluginPID finds the KMS plugin among the children of cp1's bootstrapper (0: none runs).
func pluginPID(t testing.TB, dir string) int {
	t.Helper()
	parent := nodeProc(t, dir, "cp1", "bootstrapper")
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", parent))
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			cmdline, _ := os.ReadFile("/proc/" + c + "/cmdline")
			if strings.Contains(string(cmdline), "\x00kms-plugin\x00") {
				pid, _ := strconv.Atoi(c)
				return pid
			}
		}
	}
	return 0
}

// cp1Etcd connects to cp1's etcd from the host with the API server's etcd client certificate, read
// through the bootstrapper's view of cp1's file system (/proc/PID/root resolves in its mount
// namespace, where the state disk is mounted).
func cp1Etcd(t testing.TB, dir string) *clientv3.Client {
	t.Helper()
	root := fmt.Sprintf("/proc/%d/root/etc/kubernetes/pki", nodeProc(t, dir, "cp1", "bootstrapper"))
	cert, err := tls.LoadX509KeyPair(filepath.Join(root, "apiserver-etcd-client.crt"), filepath.Join(root, "apiserver-etcd-client.key"))
	if err != nil {
		t.Fatalf("reading cp1's etcd client certificate: %v", err)
	}
	ca, err := os.ReadFile(filepath.Join(root, "etcd", "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{"https://" + net.JoinHostPort(nodeIP(t, dir, "cp1"), "2379")},
		DialTimeout: 10 * time.Second, Logger: zap.NewNop(),
		TLS: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func secretsScan(t testing.TB, etcd *clientv3.Client) etcdscan.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := etcdscan.Scan(ctx, etcd, etcdscan.Options{Provider: kmsplugin.ProviderName, Prefixes: []string{etcdscan.ResourcePrefix("secrets")}})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// checkSecretsAtRest: the cluster Secret as etcd stores it is the KMS v2 prefix and a key ID, never
// the master secret; every Secret is encrypted under the key of generation gen; and cp1's etcd files,
// read through its mount namespace (the plaintext view of the state disk), hold no copy of the master
// secret or of a KMS key, while a marker in a ConfigMap (not encrypted) is there: the search sees
// plaintext.
func checkSecretsAtRest(t testing.TB, c *cluster, gen uint32) {
	t.Helper()
	master, keys := masterKeys(t, c.dir)
	etcd := cp1Etcd(t, c.dir)
	ctx := context.Background()
	resp, err := etcd.Get(ctx, "/registry/secrets/"+joinconfig.Namespace+"/"+joinconfig.SecretName)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("reading the cluster Secret from cp1's etcd: %v", err)
	}
	raw := resp.Kvs[0].Value
	t.Logf("berth-system/berth-cluster-secrets in etcd: %q... (%d bytes)", raw[:min(len(raw), 48)], len(raw))
	if !bytes.HasPrefix(raw, []byte("k8s:enc:kms:v2:berth:")) {
		t.Errorf("the cluster Secret in etcd does not start with the KMS v2 prefix: %q", raw[:min(len(raw), 48)])
	}
	for name, n := range encodings("master secret", master) {
		if bytes.Contains(raw, n) {
			t.Errorf("the cluster Secret in etcd holds the %s", name)
		}
	}
	wantID := kmsplugin.KeyID(gen, keys.KMSKey(gen))
	r := secretsScan(t, etcd)
	t.Logf("Secrets in etcd: %d, by key ID %v, unencrypted %d", r.Objects, r.ByKeyID, r.NotEncrypted)
	if r.Objects == 0 || r.ByKeyID[wantID] != r.Objects || r.NotEncrypted != 0 {
		t.Errorf("not every Secret is under %s", wantID)
	}

	marker := "berth-kms-marker-" + hex.EncodeToString(keys.LegacyDiskKey("kms-marker"))[:20]
	c.kube("create", "configmap", "kms-marker", "-n", "default", "--from-literal=m="+marker)
	needles := map[string][]byte{"marker": []byte(marker)}
	for name, n := range encodings("master secret", master) {
		needles[name] = n
	}
	for g := uint32(1); g <= gen; g++ {
		for name, n := range encodings(fmt.Sprintf("KMS key of generation %d", g), keys.KMSKey(g)) {
			needles[name] = n
		}
	}
	// etcd writes every request to its WAL before it answers: the marker is on disk now.
	hits, files, size := searchEtcdFiles(t, c, needles)
	t.Logf("cp1's etcd files: %d files, %d KiB searched for %d needles", files, size>>10, len(needles))
	if len(hits["marker"]) == 0 {
		t.Errorf("the ConfigMap marker is not in cp1's etcd files: the search cannot see plaintext")
	}
	for name := range needles {
		if name != "marker" && len(hits[name]) > 0 {
			t.Errorf("%s found in cp1's etcd files %v", name, hits[name])
		}
	}
	c.kube("delete", "configmap", "kms-marker", "-n", "default")
}

// searchEtcdFiles reads every file under cp1's /var/lib/etcd through its mount namespace (tar inside
// the namespace, read here) and returns, by needle, the files holding it, with the number of files
// and bytes read.
func searchEtcdFiles(t testing.TB, c *cluster, needles map[string][]byte) (map[string][]string, int, int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", "--mount="+filepath.Join(c.dir, "ns", "cp1.mnt"), "--", "tar", "-C", "/var/lib/etcd", "-cf", "-", ".")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	hits := map[string][]string{}
	files := 0
	var size int64
	tr := tar.NewReader(out)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("reading cp1's etcd files: %v", err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files++
		size += int64(len(b))
		for name, n := range needles {
			if bytes.Contains(b, n) {
				hits[name] = append(hits[name], h.Name)
			}
		}
	}
	// tar warns when etcd changes a file while it reads it: fine, the search read what was there.
	if err := cmd.Wait(); err != nil && files == 0 {
		t.Fatalf("tar of cp1's /var/lib/etcd: %v\n%s", err, stderr.String())
	}
	if files == 0 {
		t.Fatal("cp1's /var/lib/etcd holds no files")
	}
	return hits, files, size
}

// kmsProvidersHealthy is the API server's kms-providers readiness check.
func kmsProvidersHealthy(c *cluster) error {
	out, err := c.run(30*time.Second, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "get", "--raw", "/readyz/kms-providers")
	if err != nil {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(out))
	}
	return nil
}

// pluginMetric reads berth_kms_healthy from cp1's plugin.
func pluginMetric(c *cluster) (string, error) {
	hc := http.Client{Timeout: 3 * time.Second}
	resp, err := hc.Get("http://" + net.JoinHostPort(nodeIP(c.t, c.dir, "cp1"), strconv.Itoa(kmsplugin.MetricsPort)) + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "berth_kms_healthy ") {
			return l, nil
		}
	}
	return "", errors.New("no berth_kms_healthy in the metrics")
}

// checkPluginStopAndHeal stops cp1's KMS plugin (SIGSTOP: it holds its socket and answers nothing):
// the API server's kms-providers check goes red and berth status calls the plugin unhealthy. Then it
// kills it: the bootstrapper starts a new one with the keys it holds, and the check heals.
func checkPluginStopAndHeal(t testing.TB, c *cluster) {
	t.Helper()
	pid := pluginPID(t, c.dir)
	if pid == 0 {
		t.Fatal("no KMS plugin runs under cp1's bootstrapper")
	}
	if err := kmsProvidersHealthy(c); err != nil {
		t.Fatalf("kms-providers before the plugin stops: %v", err)
	}
	if m, err := pluginMetric(c); err != nil || m != "berth_kms_healthy 1" {
		t.Errorf("plugin metric before the stop: %q, %v", m, err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	killed := false
	defer func() { // never leave it stopped; once killed, the PID may belong to another process
		if !killed {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}()
	var health error
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, 90*time.Second, true, func(context.Context) (bool, error) {
		health = kmsProvidersHealthy(c)
		return health != nil, nil
	}); err != nil {
		t.Fatal("the API server's kms-providers check stays healthy with the plugin stopped")
	}
	t.Logf("plugin %d stopped: kms-providers failed after %.1fs: %v", pid, time.Since(stopped).Seconds(), health)
	var status string
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		status, _ = c.run(time.Minute, c.berth, "secrets", "status", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
		return strings.Contains(status, "UNHEALTHY") && strings.Contains(status, "the plugin does not answer"), nil
	}); err != nil {
		t.Errorf("berth secrets status does not show the stopped plugin:\n%s", status)
	}
	t.Logf("berth secrets status with the plugin stopped:\n%s", status)

	// Killed (a stopped process dies of SIGKILL too): the bootstrapper restarts it with its keys.
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed = true
	killedAt := time.Now()
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, 90*time.Second, true, func(context.Context) (bool, error) {
		health = kmsProvidersHealthy(c)
		return health == nil, nil
	}); err != nil {
		t.Fatalf("kms-providers does not heal after the plugin was restarted: %v", health)
	}
	t.Logf("plugin restarted (pid %d): kms-providers healthy again %.1fs after the kill", pluginPID(t, c.dir), time.Since(killedAt).Seconds())
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		status, _ = c.run(time.Minute, c.berth, "status", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
		return strings.Contains(status, "Encryption at rest (secrets through the KMS v2 plugin berth): healthy"), nil
	}); err != nil {
		t.Errorf("berth status does not show the plugin healthy again:\n%s", status)
	}
	if m, err := pluginMetric(c); err != nil || m != "berth_kms_healthy 1" {
		t.Errorf("plugin metric after the restart: %q, %v", m, err)
	}
}

// loadQPS bounds the Secret load of checkRotationUnderLoad: steady traffic well above an idle
// application's, which leaves the two cores room for the rotation itself.
const loadQPS = 50

// checkRotationUnderLoad runs berth secrets rotate-key while a client reads and writes Secrets
// continuously: no request fails, and afterwards etcd holds nothing under the old key.
func checkRotationUnderLoad(t testing.TB, c *cluster) {
	t.Helper()
	_, keys := masterKeys(t, c.dir)
	rc, err := clientcmd.BuildConfigFromFlags("", filepath.Join(c.dir, "admin.conf"))
	if err != nil {
		t.Fatal(err)
	}
	// The load's own pace, not client-go's default of 5 requests/s: with that, the request count
	// measured the rotation's duration (10 + 5/s), and a quick rotation failed the check below.
	rc.QPS, rc.Burst = loadQPS, loadQPS
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	c.kube("create", "namespace", "kms-load")
	for i := range 20 {
		c.kube("create", "secret", "generic", fmt.Sprintf("app-%d", i), "-n", "kms-load", fmt.Sprintf("--from-literal=v=%d", i))
	}
	l := &secretload.Load{}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); l.Run(ctx, cs.CoreV1().Secrets("kms-load")) }()
	start := time.Now()
	out, err := c.run(10*time.Minute, c.berth, "secrets", "rotate-key", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
	took := time.Since(start)
	stop()
	<-done
	t.Logf("berth secrets rotate-key (%.1fs):\n%s", took.Seconds(), out)
	if err != nil {
		t.Fatalf("berth secrets rotate-key: %v", err)
	}
	t.Logf("load during the rotation: %d requests in %.1fs, %d failed", l.Ops(), took.Seconds(), l.Failures())
	if l.Failures() != 0 || l.Ops() < 100 {
		t.Errorf("load during the rotation: %d requests, %d failed: %v", l.Ops(), l.Failures(), l.Errors())
	}
	r := secretsScan(t, cp1Etcd(t, c.dir))
	oldID, newID := kmsplugin.KeyID(1, keys.KMSKey(1)), kmsplugin.KeyID(2, keys.KMSKey(2))
	t.Logf("Secrets in etcd after the rotation: %d, by key ID %v", r.Objects, r.ByKeyID)
	if r.ByKeyID[oldID] != 0 || r.ByKeyID[newID] != r.Objects || r.NotEncrypted != 0 {
		t.Errorf("after the rotation objects remain under %s or outside %s", oldID, newID)
	}
	for i := range 20 {
		if got := c.kube("get", "secret", fmt.Sprintf("app-%d", i), "-n", "kms-load", "-o", "jsonpath={.data.v}"); got != base64.StdEncoding.EncodeToString([]byte(strconv.Itoa(i))) {
			t.Errorf("Secret app-%d after the rotation = %q", i, got)
		}
	}
	c.kube("delete", "namespace", "kms-load", "--wait=false")
}

// checkSecretsAfterRestart: after the power cut the API server decrypts again with the key generation
// cp1's plugin got back from its state disk.
func checkSecretsAfterRestart(t testing.TB, c *cluster, gen uint32) {
	t.Helper()
	master, keys := masterKeys(t, c.dir)
	got, ok := c.kubeEventually(2*time.Minute, base64.StdEncoding.EncodeToString(master), "get", "secret", "-n", joinconfig.Namespace,
		joinconfig.SecretName, "-o", "jsonpath={.data.masterSecret}")
	if !ok {
		t.Fatalf("the cluster Secret is not readable after the restart: %q", got)
	}
	want := kmsplugin.KeyID(gen, keys.KMSKey(gen))
	status, ok := c.kubeEventually(time.Minute, want, "get", "configmap", "-n", joinconfig.Namespace, "berth-kms", "-o", "jsonpath={.data.node\\.cp1}")
	if !ok {
		t.Errorf("cp1's keeper does not report key %s after the restart: %s", want, status)
	}
	t.Logf("after the restart the API server decrypts Secrets with %s", want)
}
