package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// This test runs the real binaries: the bootstrapper daemon with the real InitServer on loopback,
// driven by the real `berth init`, with a recording stand-in for kubeadm and a stand-in API server.

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "berth-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := func() int {
		defer os.RemoveAll(dir)
		build := exec.Command("go", "build", "-o", dir+"/",
			"github.com/berth-k8s/berth/bootstrapper/cmd/bootstrapper",
			"github.com/berth-k8s/berth/cmd/berth",
			"./testdata/fakekubeadm")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "building binaries: %v\n%s", err, out)
			return 1
		}
		return m.Run()
	}()
	os.Exit(code)
}

// apiServer stands in for kube-apiserver: /readyz answers ok, server-side apply echoes the object.
type apiServer struct {
	*httptest.Server
	mu      sync.Mutex
	applied []string
}

func newAPIServer(t *testing.T) *apiServer {
	a := &apiServer{}
	a.Server = httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if doc, ok := discovery[r.URL.Path]; ok && r.Method == http.MethodGet {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(doc)
			return
		}
		switch {
		case r.URL.Path == "/readyz":
			fmt.Fprint(w, "ok")
		case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, crdPath):
			// The bootstrapper waits for its CustomResourceDefinitions to be established.
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(map[string]any{
				"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
				"metadata": map[string]any{"name": strings.TrimPrefix(r.URL.Path, crdPath)},
				"status": map[string]any{"conditions": []map[string]any{
					{"type": "Established", "status": "True"}, {"type": "NamesAccepted", "status": "True"}}},
			})
		case r.Method == http.MethodPatch && r.Header.Get("Content-Type") == "application/apply-patch+yaml":
			body, _ := io.ReadAll(r.Body)
			a.mu.Lock()
			a.applied = append(a.applied, r.URL.Path)
			a.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(body)
		default:
			http.Error(w, "not found", http.StatusNotFound)
		}
	}))
	t.Cleanup(a.Close)
	return a
}

// crdPath is where the stand-in API server answers for a CustomResourceDefinition by name.
const crdPath = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"

// discovery is what the stand-in API server tells client-go's discovery (legacy, unaggregated): the
// kinds the bootstrapper applies.
var discovery = func() map[string]any {
	res := func(name, kind string, namespaced bool) metav1.APIResource {
		return metav1.APIResource{Name: name, Kind: kind, Namespaced: namespaced, Verbs: metav1.Verbs{"get", "list", "create", "update", "patch", "delete"}}
	}
	groups := map[string][]metav1.APIResource{
		"apps/v1": {res("daemonsets", "DaemonSet", true), res("deployments", "Deployment", true)},
		"rbac.authorization.k8s.io/v1": {res("roles", "Role", true), res("rolebindings", "RoleBinding", true),
			res("clusterroles", "ClusterRole", false), res("clusterrolebindings", "ClusterRoleBinding", false)},
		"admissionregistration.k8s.io/v1": {res("validatingadmissionpolicies", "ValidatingAdmissionPolicy", false),
			res("validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding", false),
			res("validatingwebhookconfigurations", "ValidatingWebhookConfiguration", false)},
		"policy/v1":               {res("poddisruptionbudgets", "PodDisruptionBudget", true)},
		"node.k8s.io/v1":          {res("runtimeclasses", "RuntimeClass", false)},
		"coordination.k8s.io/v1":  {res("leases", "Lease", true)},
		"apiextensions.k8s.io/v1": {res("customresourcedefinitions", "CustomResourceDefinition", false)},
	}
	docs := map[string]any{
		"/api": metav1.APIVersions{TypeMeta: metav1.TypeMeta{Kind: "APIVersions"}, Versions: []string{"v1"},
			ServerAddressByClientCIDRs: []metav1.ServerAddressByClientCIDR{{ClientCIDR: "0.0.0.0/0", ServerAddress: "127.0.0.1"}}},
		"/api/v1": metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"}, GroupVersion: "v1",
			APIResources: []metav1.APIResource{res("namespaces", "Namespace", false), res("secrets", "Secret", true),
				res("configmaps", "ConfigMap", true), res("serviceaccounts", "ServiceAccount", true), res("services", "Service", true)}},
	}
	list := metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"}}
	for gv, resources := range groups {
		group, version, _ := strings.Cut(gv, "/")
		v := metav1.GroupVersionForDiscovery{GroupVersion: gv, Version: version}
		list.Groups = append(list.Groups, metav1.APIGroup{Name: group, Versions: []metav1.GroupVersionForDiscovery{v}, PreferredVersion: v})
		docs["/apis/"+gv] = metav1.APIResourceList{TypeMeta: metav1.TypeMeta{Kind: "APIResourceList", APIVersion: "v1"}, GroupVersion: gv, APIResources: resources}
	}
	docs["/apis"] = list
	return docs
}()

func (a *apiServer) Applied() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.applied...)
}

func (a *apiServer) kubeconfig() string {
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: a.Certificate().Raw})
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: berth
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: admin
  user:
    token: fake-admin-token
contexts:
- name: admin@berth
  context: {cluster: berth, user: admin}
current-context: admin@berth
`, a.URL, base64.StdEncoding.EncodeToString(ca))
}

type node struct {
	dir, stateDir, k8sDir, kubeletDir, kubeadmLog, failOnce, addr string
	args, env                                                     []string
	cmd                                                           *exec.Cmd
	out                                                           *lockedBuffer
	done                                                          chan error
}

func freeAddr(t *testing.T) string {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	return lis.Addr().String()
}

func write(t *testing.T, path, data string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), mode); err != nil {
		t.Fatal(err)
	}
}

// startNode starts the bootstrapper for a control-plane node whose init secret is secretHex.
func startNode(t *testing.T, api *apiServer, secretHex string, failFirstInit bool, extraArgs ...string) *node {
	t.Helper()
	dir := t.TempDir()
	n := &node{dir: dir, stateDir: filepath.Join(dir, "state"), k8sDir: filepath.Join(dir, "etc-kubernetes"),
		kubeletDir: filepath.Join(dir, "var-lib-kubelet"), kubeadmLog: filepath.Join(dir, "kubeadm.log"), addr: freeAddr(t)}
	secret, _ := hex.DecodeString(secretHex)
	sum := sha256.Sum256(secret)
	write(t, filepath.Join(dir, "metadata.yaml"), fmt.Sprintf("self: {name: cp-0, role: control-plane, ips: [127.0.0.1]}\ninitSecretHash: %x\n", sum), 0o600)
	write(t, filepath.Join(dir, "admin.conf"), api.kubeconfig(), 0o600)
	write(t, filepath.Join(dir, "cri.sock"), "", 0o600)
	write(t, filepath.Join(dir, "kubelet"), "#!/bin/sh\necho $$ > \"$(dirname \"$0\")/kubelet.pid\"\nexec sleep 600\n", 0o755)
	if failFirstInit {
		n.failOnce = filepath.Join(dir, "fail-once")
		write(t, n.failOnce, "", 0o600)
	}
	n.args = []string{
		"--metadata=static", "--metadata-file=" + filepath.Join(dir, "metadata.yaml"),
		"--state-dir=" + n.stateDir, "--run-dir=" + filepath.Join(dir, "run"), "--init-listen=" + n.addr,
		"--kubelet=process", "--kubelet-path=" + filepath.Join(dir, "kubelet"),
		"--kubeadm-path=" + filepath.Join(binDir, "fakekubeadm"),
		"--kubernetes-dir=" + n.k8sDir, "--kubelet-dir=" + n.kubeletDir,
		"--cri-socket=unix://" + filepath.Join(dir, "cri.sock"),
		"--joinservice-image=berth.local/joinservice:test", "--never-pull",
		"--kms-socket=" + filepath.Join(dir, "kms", "kms.sock"), "--kms-metrics-listen="}
	if len(extraArgs) == 0 {
		extraArgs = []string{"--attestation=insecure-none"}
	}
	n.args = append(n.args, extraArgs...)
	n.env = append(os.Environ(),
		"FAKE_KUBEADM_LOG="+n.kubeadmLog, "FAKE_K8S_DIR="+n.k8sDir, "FAKE_KUBELET_DIR="+n.kubeletDir,
		"FAKE_ADMIN_CONF="+filepath.Join(dir, "admin.conf"), "FAKE_KUBEADM_FAIL_ONCE="+n.failOnce,
		"FAKE_KUBEADM_HANG_ONCE="+filepath.Join(dir, "hang-once"),
		"BERTH_LOG_LEVEL=debug")
	n.start(t)
	return n
}

// start starts the daemon (again) with the node's arguments and waits until it listens.
func (n *node) start(t *testing.T) {
	t.Helper()
	n.out = &lockedBuffer{}
	n.cmd = exec.Command(filepath.Join(binDir, "bootstrapper"), n.args...) //nolint:noctx // stopped by the test, by PID
	n.cmd.Env = n.env
	n.cmd.Stdout, n.cmd.Stderr = n.out, n.out
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	n.done = done
	cmd, out := n.cmd, n.out
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		err := <-done
		done <- err
		if t.Failed() {
			t.Logf("bootstrapper output:\n%s", out.String())
		}
	})
	var dialErr error
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		c, err := net.DialTimeout("tcp", n.addr, time.Second)
		if err != nil {
			dialErr = err
			return false, nil
		}
		c.Close()
		return true, nil
	})
	if err != nil {
		t.Fatalf("bootstrapper did not listen on %s: %v\n%s", n.addr, dialErr, n.out.String())
	}
}

// stop sends SIGTERM and expects a clean exit and no kubelet left behind.
func (n *node) stop(t *testing.T) {
	t.Helper()
	if err := n.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-n.done:
		n.done <- err
		if err != nil {
			t.Fatalf("bootstrapper exited with %v\n%s", err, n.out.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("bootstrapper did not stop on SIGTERM")
	}
	if pid, err := os.ReadFile(filepath.Join(n.dir, "kubelet.pid")); err == nil {
		var p int
		fmt.Sscan(string(pid), &p)
		if p > 0 && syscall.Kill(p, 0) == nil {
			t.Errorf("kubelet (pid %d) still running after the bootstrapper stopped", p)
		}
	}
}

// lockedBuffer collects the daemon's output, written by exec's copying goroutine.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

type result struct {
	code   int
	output string
}

func berthInit(t *testing.T, endpoint, config, workspace string, extraArgs ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if extraArgs == nil {
		extraArgs = []string{"--insecure-skip-attestation"}
	}
	args := append([]string{"init", "--endpoint", endpoint, "--config", config, "--workspace", workspace, "--connect-timeout", "20s"}, extraArgs...)
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "berth"), args...)
	out, err := cmd.CombinedOutput()
	code := 0
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		code = exitErr.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return result{code: code, output: string(out)}
}

func randomHex(t *testing.T) string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func phaseLines(output string) []string {
	var lines []string
	for _, l := range strings.Split(output, "\n") {
		if strings.HasPrefix(l, "[") {
			f := strings.Fields(l)
			if len(f) >= 3 {
				lines = append(lines, f[1]+" "+f[2])
			}
		}
	}
	return lines
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return info.Mode().Perm()
}

func TestBinaryInitFailsThenResumes(t *testing.T) {
	api := newAPIServer(t)
	secret := randomHex(t)
	n := startNode(t, api, secret, true)
	cfgDir := t.TempDir()
	config := filepath.Join(cfgDir, "cluster.yaml")
	write(t, config, "clusterName: mini\nkubernetesVersion: v1.37.2\ninitSecretFile: init-secret\n", 0o600)
	write(t, filepath.Join(cfgDir, "init-secret"), secret+"\n", 0o600)
	ws := filepath.Join(t.TempDir(), "ws")

	// A wrong init secret: rejected, generically, and nothing happens on the node.
	bad := filepath.Join(cfgDir, "bad.yaml")
	write(t, bad, "initSecret: "+randomHex(t)+"\n", 0o600)
	r := berthInit(t, n.addr, bad, filepath.Join(t.TempDir(), "ws-bad"))
	if r.code != 3 || !strings.Contains(r.output, "rejected the init request") {
		t.Fatalf("berth init with a wrong secret: exit %d\n%s", r.code, r.output)
	}
	if _, err := os.Stat(n.kubeadmLog); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("kubeadm ran for a request with a wrong init secret")
	}

	// First attempt: kubeadm init fails.
	r = berthInit(t, n.addr, config, ws)
	if r.code != 1 || !strings.Contains(r.output, "PHASE_FAILED: phase kubeadm-init failed") || !strings.Contains(r.output, "Run the same command again to resume") {
		t.Fatalf("first berth init: exit %d\n%s", r.code, r.output)
	}
	want := []string{"preflight started", "preflight done", "kubeadm-config started", "kubeadm-config done",
		"certs started", "certs done", "kms started", "kms done", "kubeadm-init started", "kubeadm-init FAILED"}
	if got := phaseLines(r.output); !slices.Equal(got, want) {
		t.Fatalf("first attempt phases:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if m := mode(t, filepath.Join(ws, "master-secret.json")); m != 0o600 {
		t.Fatalf("master-secret.json mode %v, want 0600", m)
	}

	// Second attempt with the same workspace resumes at kubeadm-init.
	r = berthInit(t, n.addr, config, ws)
	if r.code != 0 || !strings.Contains(r.output, "Resuming with the master secret") || !strings.Contains(r.output, "Cluster initialized") {
		t.Fatalf("second berth init: exit %d\n%s", r.code, r.output)
	}
	want = []string{"preflight skipped", "kubeadm-config skipped", "certs skipped", "kms skipped", "kubeadm-init started", "kubeadm-init done",
		"wait-apiserver started", "wait-apiserver done", "components started", "components done",
		"admin-kubeconfig started", "admin-kubeconfig done"}
	if got := phaseLines(r.output); !slices.Equal(got, want) {
		t.Fatalf("second attempt phases:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// The recorded kubeadm calls: the failed init is reset and redone from the certificates on.
	log, err := os.ReadFile(n.kubeadmLog)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(n.stateDir, "kubeadm-init.yaml")
	wantCalls := strings.Join([]string{
		"version -o short",
		"init phase certs all --config " + cfgPath,
		"init --config " + cfgPath + " --skip-token-print --skip-phases=certs",
		"reset --force --cri-socket unix://" + filepath.Join(n.dir, "cri.sock"),
		"init phase certs all --config " + cfgPath,
		"init --config " + cfgPath + " --skip-token-print --skip-phases=certs",
	}, "\n") + "\n"
	if string(log) != wantCalls {
		t.Fatalf("kubeadm calls:\n%s\nwant:\n%s", log, wantCalls)
	}
	kcfg, err := os.ReadFile(cfgPath)
	if err != nil || !strings.Contains(string(kcfg), "clusterName: mini") || !strings.Contains(string(kcfg), "name: cp-0") {
		t.Fatalf("kubeadm config:\n%s\n%v", kcfg, err)
	}

	// Files in the workspace.
	admin, err := os.ReadFile(filepath.Join(ws, "admin.conf"))
	if err != nil || string(admin) != api.kubeconfig() {
		t.Fatalf("admin.conf = %q, %v", admin, err)
	}
	if m := mode(t, filepath.Join(ws, "admin.conf")); m != 0o600 {
		t.Fatalf("admin.conf mode %v, want 0600", m)
	}
	if initLog, _ := os.ReadFile(filepath.Join(ws, "init.log")); !strings.Contains(string(initLog), "the control plane did not come up") {
		t.Fatalf("init.log lacks the node's output of the failed attempt:\n%s", initLog)
	}
	if strings.Contains(n.out.String(), secret) {
		t.Fatal("the init secret appears in the bootstrapper's log")
	}

	// The components went to the API server, the webhook-free part in order.
	applied := strings.Join(api.Applied(), "\n")
	for _, p := range []string{"/api/v1/namespaces/berth-system", "/api/v1/namespaces/berth-system/secrets/berth-cluster-secrets",
		"/api/v1/namespaces/berth-system/configmaps/berth-join-config", "/apis/apps/v1/namespaces/berth-system/daemonsets/berth-joinservice"} {
		if !strings.Contains(applied, p) {
			t.Errorf("not applied: %s\napplied:\n%s", p, applied)
		}
	}

	// The kubelet was started by the supervisor once kubeadm had written its config.
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		_, err := os.Stat(filepath.Join(n.dir, "kubelet.pid"))
		return err == nil, nil
	}); err != nil {
		t.Fatal("kubelet was never started")
	}

	// A finished workspace is never overwritten; a finished node says so.
	r = berthInit(t, n.addr, config, ws)
	if r.code != 2 || !strings.Contains(r.output, "already holds a cluster's admin.conf") {
		t.Fatalf("berth init on a finished workspace: exit %d\n%s", r.code, r.output)
	}
	r = berthInit(t, n.addr, config, filepath.Join(t.TempDir(), "ws2"))
	if r.code != 1 || !strings.Contains(r.output, "ALREADY_INITIALIZED") {
		t.Fatalf("berth init on a finished node: exit %d\n%s", r.code, r.output)
	}
	n.stop(t)
}
