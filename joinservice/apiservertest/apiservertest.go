// Package apiservertest runs a real etcd and kube-apiserver as processes on loopback for tests of the
// joinservice against a real API server.
//
// The binaries come from scripts/build-k8s.sh's cache: BERTH_KUBE_BIN and BERTH_ETCD_BIN name the bin
// dirs (mk/joinservice.mk sets them); without them the newest complete (stamped) dirs under
// ${BERTH_CACHE:-/var/cache/berth} are used. When neither is there, Start skips the test at once.
//
// The API server runs with RBAC authorization and static token authentication: Admin is a
// system:masters user, and User returns a client for any other user and groups, so tests can check
// the RBAC rules Berth installs. Its serving certificate is the self-signed one kube-apiserver
// generates into its cert dir.
package apiservertest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/afero"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/bootstrapper/components"
	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// Env is a running etcd + kube-apiserver pair.
type Env struct {
	dir     string
	url     string
	caData  []byte
	tokens  map[string]string // user -> token
	procs   []*exec.Cmd
	waiters []chan struct{}
}

// Users with static tokens. Tokens are random per Env.
const (
	// AdminUser is in system:masters.
	AdminUser = "berth-test-admin"
	// JoinServiceUser is the joinservice's ServiceAccount name as an RBAC subject.
	JoinServiceUser = "system:serviceaccount:berth-system:berth-joinservice"
)

// binDirs finds the kube and etcd bin dirs, or reports why not.
func binDirs() (kube, etcd string, err error) {
	kube, etcd = os.Getenv("BERTH_KUBE_BIN"), os.Getenv("BERTH_ETCD_BIN")
	cache := os.Getenv("BERTH_CACHE")
	if cache == "" {
		cache = "/var/cache/berth"
	}
	if kube == "" {
		kube = newestStamped(filepath.Join(cache, "k8s-v1.34.2-*"))
	}
	if etcd == "" {
		etcd = newestStamped(filepath.Join(cache, "etcd-3.6.5-*"))
	}
	for _, p := range []string{filepath.Join(kube, "kube-apiserver"), filepath.Join(etcd, "etcd")} {
		if kube == "" || etcd == "" {
			break
		}
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("no %s", p)
		}
	}
	if kube == "" || etcd == "" {
		return "", "", errors.New("kube-apiserver v1.34.2 and etcd 3.6.5 are not built: run `scripts/build-k8s.sh k8s etcd` or set BERTH_KUBE_BIN and BERTH_ETCD_BIN")
	}
	return kube, etcd, nil
}

func newestStamped(pattern string) string {
	dirs, _ := filepath.Glob(pattern)
	type cand struct {
		dir string
		mod time.Time
	}
	var cs []cand
	for _, d := range dirs {
		st, err := os.Stat(filepath.Join(d, "stamp"))
		if err == nil {
			cs = append(cs, cand{filepath.Join(d, "bin"), st.ModTime()})
		}
	}
	if len(cs) == 0 {
		return ""
	}
	sort.Slice(cs, func(i, j int) bool { return cs[i].mod.After(cs[j].mod) })
	return cs[0].dir
}

var (
	sharedOnce sync.Once
	shared     *Env
	sharedErr  error
	skipReason string
)

// Shared returns one Env per test binary, started on first use; Stop it from TestMain with StopShared.
// It skips t when the binaries are missing.
func Shared(t testing.TB) *Env {
	t.Helper()
	sharedOnce.Do(func() {
		kube, etcd, err := binDirs()
		if err != nil {
			skipReason = err.Error()
			return
		}
		shared, sharedErr = start(kube, etcd)
	})
	if skipReason != "" {
		t.Skip(skipReason)
	}
	if sharedErr != nil {
		t.Fatalf("starting API server: %v", sharedErr)
	}
	return shared
}

// StopShared stops the Env Shared started, if any.
func StopShared() {
	if shared != nil {
		shared.Stop()
	}
}

// Start runs a fresh Env for t and stops it at cleanup. It skips t when the binaries are missing.
func Start(t testing.TB) *Env {
	t.Helper()
	kube, etcd, err := binDirs()
	if err != nil {
		t.Skip(err.Error())
	}
	e, err := start(kube, etcd)
	if err != nil {
		t.Fatalf("starting API server: %v", err)
	}
	t.Cleanup(e.Stop)
	return e
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func randomToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%x", b)
}

func start(kubeBin, etcdBin string) (e *Env, err error) {
	dir, err := os.MkdirTemp("", "berth-apiservertest-")
	if err != nil {
		return nil, err
	}
	e = &Env{dir: dir, tokens: map[string]string{}}
	defer func() {
		if err != nil {
			if logs := e.logTail(); logs != "" {
				err = fmt.Errorf("%w\n%s", err, logs)
			}
			e.Stop()
			e = nil
		}
	}()
	var ports [3]int
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return e, err
		}
	}
	clientURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	if err := e.run(filepath.Join(etcdBin, "etcd"), "etcd",
		"--name=default", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+clientURL, "--advertise-client-urls="+clientURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=default="+peerURL, "--unsafe-no-fsync=true", "--log-level=warn",
	); err != nil {
		return e, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return e, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return e, err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return e, err
	}
	saKey, saPub := filepath.Join(dir, "sa.key"), filepath.Join(dir, "sa.pub")
	if err := os.WriteFile(saKey, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return e, err
	}
	if err := os.WriteFile(saPub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o600); err != nil {
		return e, err
	}
	e.tokens[AdminUser] = randomToken()
	lines := []string{fmt.Sprintf("%s,%s,%s,\"system:masters\"", e.tokens[AdminUser], AdminUser, AdminUser)}
	e.tokens[JoinServiceUser] = randomToken()
	lines = append(lines, fmt.Sprintf("%s,%s,%s,\"system:serviceaccounts,system:serviceaccounts:berth-system\"", e.tokens[JoinServiceUser], JoinServiceUser, JoinServiceUser))
	tokenFile := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokenFile, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		return e, err
	}
	certDir := filepath.Join(dir, "certs")
	e.url = fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	if err := e.run(filepath.Join(kubeBin, "kube-apiserver"), "kube-apiserver",
		"--etcd-servers="+clientURL, "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--secure-port="+strconv.Itoa(ports[2]), "--cert-dir="+certDir,
		"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file="+saPub,
		"--service-account-signing-key-file="+saKey, "--service-cluster-ip-range=10.96.0.0/16",
		"--token-auth-file="+tokenFile, "--authorization-mode=RBAC", "--enable-priority-and-fairness=false",
		"--v=0",
	); err != nil {
		return e, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if err := e.waitReady(ctx, filepath.Join(certDir, "apiserver.crt")); err != nil {
		return e, err
	}
	return e, nil
}

func (e *Env) run(bin, name string, args ...string) error {
	logf, err := os.Create(filepath.Join(e.dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("starting %s: %w", name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	e.procs = append(e.procs, cmd)
	e.waiters = append(e.waiters, done)
	return nil
}

func (e *Env) waitReady(ctx context.Context, certFile string) error {
	var last error
	for {
		for i, done := range e.waiters {
			select {
			case <-done:
				return fmt.Errorf("%s exited early", filepath.Base(e.procs[i].Path))
			default:
			}
		}
		if e.caData == nil {
			if b, err := os.ReadFile(certFile); err == nil {
				e.caData = b
			}
		}
		if e.caData != nil {
			last = e.probe(ctx)
			if last == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for /readyz: %w (last: %v)", ctx.Err(), last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (e *Env) probe(ctx context.Context) error {
	cs, err := kubernetes.NewForConfig(e.Config(AdminUser))
	if err != nil {
		return err
	}
	body, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Raw()
	if err != nil {
		return err
	}
	if string(body) != "ok" {
		return fmt.Errorf("readyz: %s", body)
	}
	return nil
}

// Config returns a client config for user (AdminUser or JoinServiceUser).
func (e *Env) Config(user string) *rest.Config {
	return &rest.Config{
		Host:            e.url,
		BearerToken:     e.tokens[user],
		TLSClientConfig: rest.TLSClientConfig{CAData: e.caData},
		QPS:             -1, // no client-side throttling: tests measure the server
		Timeout:         30 * time.Second,
	}
}

// Client returns a clientset for user.
func (e *Env) Client(t testing.TB, user string) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(e.Config(user))
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// WriteKubeconfig writes a kubeconfig for user into the Env's directory and returns its path.
func (e *Env) WriteKubeconfig(user string) (string, error) {
	path := filepath.Join(e.dir, strings.NewReplacer(":", "-").Replace(user)+".kubeconfig")
	doc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: u
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: u}
current-context: test
`, e.url, base64.StdEncoding.EncodeToString(e.caData), e.tokens[user])
	return path, os.WriteFile(path, []byte(doc), 0o600)
}

// logTail returns the end of each process log, for failure messages.
func (e *Env) logTail() string {
	var sb strings.Builder
	for _, name := range []string{"etcd", "kube-apiserver"} {
		b, err := os.ReadFile(filepath.Join(e.dir, name+".log"))
		if err != nil || len(b) == 0 {
			continue
		}
		if len(b) > 2000 {
			b = b[len(b)-2000:]
		}
		fmt.Fprintf(&sb, "--- %s log (tail)\n%s\n", name, b)
	}
	return sb.String()
}

// Stop terminates the processes this Env started (by PID, API server first) and removes its directory.
func (e *Env) Stop() {
	for i := len(e.procs) - 1; i >= 0; i-- {
		p := e.procs[i].Process
		_ = p.Signal(syscall.SIGTERM)
		select {
		case <-e.waiters[i]:
		case <-time.After(10 * time.Second):
			_ = p.Kill()
			<-e.waiters[i]
		}
	}
	e.procs, e.waiters = nil, nil
	_ = os.RemoveAll(e.dir)
}

// Runner is what TestMain runs (*testing.M, or goleak's wrapper of it).
type Runner interface{ Run() int }

type stopAfter struct{ m Runner }

func (s stopAfter) Run() int {
	code := s.m.Run()
	StopShared()
	return code
}

// StoppingShared wraps m so that the Env Shared started is stopped when the tests are done, before
// goleak looks for leftover goroutines: goleak.VerifyTestMain(apiservertest.StoppingShared(m)).
func StoppingShared(m Runner) Runner { return stopAfter{m} }

// InstallBerth applies what berth init installs after kubeadm init (bootstrapper/components: the
// berth-system namespace, cluster secrets, berth-join-config with policyYAML, the joinservice's
// ServiceAccount, RBAC and DaemonSet), as the admin. Nothing runs the DaemonSet: there are no nodes.
func (e *Env) InstallBerth(ctx context.Context, policyYAML string) error {
	kubeconfig, err := e.WriteKubeconfig(AdminUser)
	if err != nil {
		return err
	}
	keys, err := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		return err
	}
	job := &initcluster.Job{
		Req: initcluster.Request{
			KubernetesVersion: "v1.34.2", Keys: keys, Salt: bytes.Repeat([]byte{2}, 32), AttestationPolicy: []byte(policyYAML),
		},
		Out:                  io.Discard,
		ControlPlaneEndpoint: "198.51.100.10:6443",
	}
	inst := components.New(components.Config{JoinServiceImage: "berth/joinservice:test", ImagePullPolicy: "Never"}, afero.NewOsFs())
	return inst.Install(ctx, kubeconfig, job)
}

// PIDs returns the process IDs of etcd and kube-apiserver, for harnesses that account their CPU time.
func (e *Env) PIDs() []int {
	var pids []int
	for _, p := range e.procs {
		pids = append(pids, p.Process.Pid)
	}
	return pids
}
