package clustertest

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

const (
	innerEnv = "BERTH_WEBHOOK_CLUSTERTEST_NETNS"
	// apiserverIP is the API server's advertised address inside the namespace.
	apiserverIP = "198.51.100.1"
)

// skipReason is set when the environment cannot run these tests.
var skipReason string

func TestMain(m *testing.M) {
	if os.Getenv(innerEnv) != "1" {
		if reason := prerequisites(); reason != "" {
			skipReason = reason
			os.Exit(m.Run())
		}
		os.Exit(reexecInNetns())
	}
	if err := setupNetns(); err != nil {
		fmt.Fprintln(os.Stderr, "setting up the network namespace:", err)
		os.Exit(1)
	}
	goleak.VerifyTestMain(stopAfter{m},
		// client-go's and net/http's long-lived helpers that outlive one test binary's clients.
		goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("k8s.io/apimachinery/pkg/watch.(*Broadcaster).loop"),
	)
}

type stopAfter struct{ m *testing.M }

func (s stopAfter) Run() int {
	code := s.m.Run()
	stopShared()
	return code
}

// binDirs finds the kube and etcd bin dirs like joinservice/apiservertest does.
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
	if kube == "" || etcd == "" {
		return "", "", errors.New("kube-apiserver v1.34.2 and etcd 3.6.5 are not built: run `scripts/build-k8s.sh k8s etcd` or set BERTH_KUBE_BIN and BERTH_ETCD_BIN")
	}
	for _, p := range []string{filepath.Join(kube, "kube-apiserver"), filepath.Join(etcd, "etcd")} {
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("no %s: run `scripts/build-k8s.sh k8s etcd`", p)
		}
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
		if st, err := os.Stat(filepath.Join(d, "stamp")); err == nil {
			cs = append(cs, cand{filepath.Join(d, "bin"), st.ModTime()})
		}
	}
	if len(cs) == 0 {
		return ""
	}
	sort.Slice(cs, func(i, j int) bool { return cs[i].mod.After(cs[j].mod) })
	return cs[0].dir
}

func prerequisites() string {
	if os.Geteuid() != 0 {
		return "needs root (a private network namespace)"
	}
	if _, _, err := binDirs(); err != nil {
		return err.Error()
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return "needs ip (iproute2)"
	}
	if _, err := exec.LookPath("go"); err != nil && os.Getenv("BERTH_WEBHOOK_BIN") == "" {
		return "needs go to build cmd/berth-webhook, or BERTH_WEBHOOK_BIN"
	}
	return ""
}

// reexecInNetns runs this test binary again, with the same arguments, in a new network namespace; the
// namespace goes away with the last process in it.
func reexecInNetns() int {
	cmd := exec.Command(os.Args[0], os.Args[1:]...)
	cmd.Env = append(os.Environ(), innerEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		fmt.Fprintln(os.Stderr, "re-running the tests in a network namespace:", err)
		return 1
	}
	return 0
}

func ip(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func setupNetns() error {
	if err := ip("link", "set", "lo", "up"); err != nil {
		return err
	}
	return ip("addr", "add", apiserverIP+"/32", "dev", "lo")
}

// addAddress gives this namespace's loopback device one more address (a webhook pod's IP).
func addAddress(addr string) error { return ip("addr", "add", addr+"/32", "dev", "lo") }

// env is one etcd + kube-apiserver pair in the namespace, plus the webhook pod runner.
type env struct {
	dir     string
	specs   []procSpec
	url     string
	caData  []byte
	token   string
	procs   []*exec.Cmd
	waiters []chan struct{}
	kube    kubernetes.Interface
	dyn     dynamic.Interface
	runner  *podRunner
}

var (
	sharedOnce sync.Once
	shared     *env
	sharedErr  error
)

// sharedEnv returns the package's environment, started on first use; it skips tb when the
// environment cannot run the tests.
func sharedEnv(tb testing.TB) *env {
	tb.Helper()
	if skipReason != "" {
		tb.Skip(skipReason)
	}
	sharedOnce.Do(func() { shared, sharedErr = startEnv() })
	if sharedErr != nil {
		tb.Fatalf("starting the API server: %v", sharedErr)
	}
	return shared
}

func stopShared() {
	if shared != nil {
		shared.stop()
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startEnv() (e *env, err error) {
	kubeBin, etcdBin, err := binDirs()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "berth-webhook-clustertest-")
	if err != nil {
		return nil, err
	}
	e = &env{dir: dir}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, e.logTail())
			e.stop()
			e = nil
		}
	}()
	webhookBin, err := buildWebhook(dir)
	if err != nil {
		return e, err
	}
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
	saKey, saPub, err := writeServiceAccountKey(dir)
	if err != nil {
		return e, err
	}
	tok := make([]byte, 16)
	_, _ = rand.Read(tok)
	e.token = fmt.Sprintf("%x", tok)
	tokenFile := filepath.Join(dir, "tokens.csv")
	if err := os.WriteFile(tokenFile, []byte(e.token+",berth-test-admin,berth-test-admin,\"system:masters\"\n"), 0o600); err != nil {
		return e, err
	}
	certDir := filepath.Join(dir, "certs")
	e.url = fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	if err := e.run(filepath.Join(kubeBin, "kube-apiserver"), "kube-apiserver",
		"--etcd-servers="+clientURL, "--bind-address=127.0.0.1", "--advertise-address="+apiserverIP,
		"--secure-port="+fmt.Sprint(ports[2]), "--cert-dir="+certDir,
		"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file="+saPub,
		"--service-account-signing-key-file="+saKey, "--service-cluster-ip-range=10.96.0.0/16",
		"--token-auth-file="+tokenFile, "--authorization-mode=RBAC",
		// The API server dials webhook endpoints directly, as in the mini cluster; there is no kube-proxy.
		"--enable-aggregator-routing=true",
		// No flow control: the load test measures the webhook path, not APF queueing.
		"--enable-priority-and-fairness=false",
		"--v=0",
	); err != nil {
		return e, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if err := e.waitReady(ctx, filepath.Join(certDir, "apiserver.crt")); err != nil {
		return e, err
	}
	if e.kube, err = kubernetes.NewForConfig(e.config()); err != nil {
		return e, err
	}
	if e.dyn, err = dynamic.NewForConfig(e.config()); err != nil {
		return e, err
	}
	e.runner = newPodRunner(e.kube, webhookBin, filepath.Join(dir, "pods"))
	return e, nil
}

// buildWebhook builds cmd/berth-webhook (or takes BERTH_WEBHOOK_BIN).
func buildWebhook(dir string) (string, error) {
	if bin := os.Getenv("BERTH_WEBHOOK_BIN"); bin != "" {
		return bin, nil
	}
	out := filepath.Join(dir, "berth-webhook")
	cmd := exec.Command("go", "build", "-o", out, "github.com/berth-k8s/berth/cmd/berth-webhook")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building berth-webhook: %w: %s", err, b)
	}
	return out, nil
}

// procSpec is how a process was started, to start it again.
type procSpec struct {
	bin, name string
	args      []string
}

func (e *env) run(bin, name string, args ...string) error {
	e.specs = append(e.specs, procSpec{bin, name, args})
	return e.start(bin, name, args...)
}

func (e *env) start(bin, name string, args ...string) error {
	logf, err := os.OpenFile(filepath.Join(e.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
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

func (e *env) config() *rest.Config {
	return &rest.Config{
		Host: e.url, BearerToken: e.token,
		TLSClientConfig: rest.TLSClientConfig{CAData: e.caData},
		QPS:             -1, Timeout: 30 * time.Second,
	}
}

func (e *env) waitReady(ctx context.Context, certFile string) error {
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

func (e *env) probe(ctx context.Context) error {
	cs, err := kubernetes.NewForConfig(e.config())
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

func (e *env) logTail() string {
	var sb strings.Builder
	for _, name := range []string{"etcd", "kube-apiserver"} {
		b, err := os.ReadFile(filepath.Join(e.dir, name+".log"))
		if err != nil || len(b) == 0 {
			continue
		}
		if len(b) > 3000 {
			b = b[len(b)-3000:]
		}
		fmt.Fprintf(&sb, "--- %s log (tail)\n%s\n", name, b)
	}
	return sb.String()
}

// restartAPIServer stops kube-apiserver (SIGTERM, by PID) and etcd, and starts both again on the same
// data: a power cycle of the control plane.
func (e *env) restartAPIServer(ctx context.Context) error {
	for i := len(e.procs) - 1; i >= 0; i-- {
		_ = e.procs[i].Process.Signal(syscall.SIGTERM)
		select {
		case <-e.waiters[i]:
		case <-time.After(10 * time.Second):
			_ = e.procs[i].Process.Kill()
			<-e.waiters[i]
		}
	}
	e.procs, e.waiters = nil, nil
	for _, s := range e.specs {
		if err := e.start(s.bin, s.name, s.args...); err != nil {
			return err
		}
	}
	return e.waitReady(ctx, filepath.Join(e.dir, "certs", "apiserver.crt"))
}

// stop ends the webhook pods, then the API server and etcd (by PID), and removes the directory.
func (e *env) stop() {
	if e.runner != nil {
		e.runner.close()
	}
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
	if os.Getenv("BERTH_WEBHOOK_KEEP") == "" {
		_ = os.RemoveAll(e.dir)
	}
}
