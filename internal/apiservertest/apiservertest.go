// Package apiservertest runs a real etcd and kube-apiserver as processes on loopback, for tests of
// anything that talks to the Kubernetes API: the joinservice, the objects Berth installs and their
// RBAC, the image-policy webhook's admission path.
//
// The binaries come from scripts/build-k8s.sh's cache: BERTH_KUBE_BIN and BERTH_ETCD_BIN name the bin
// dirs (the make targets set them); without them the newest complete (stamped) dirs under
// ${BERTH_CACHE:-/var/cache/berth} are used. When neither is there, Start and Shared skip the test at
// once; Available says why.
//
// The API server runs with RBAC authorization and static token authentication for two users:
// AdminUser, in system:masters, and JoinServiceUser, the joinservice's ServiceAccount as an RBAC
// subject, so tests can check the rules Berth installs (InstallBerth). Its serving certificate is the
// self-signed one kube-apiserver generates into its cert dir.
//
// Start gives a test its own Env. Shared gives every test of a test binary the same one, started on
// first use; such a binary's TestMain stops it after the tests, before goleak looks for leftover
// goroutines:
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }
package apiservertest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/prereq"
	"github.com/berth-k8s/berth/internal/proctest"
)

// Users with static tokens. Tokens are random per Env.
const (
	// AdminUser is in system:masters.
	AdminUser = "berth-test-admin"
	// JoinServiceUser is the joinservice's ServiceAccount as an RBAC subject.
	JoinServiceUser = "system:serviceaccount:" + joinconfig.Namespace + ":" + joinconfig.ServiceAccountName
)

// The cache dirs of the default release's binaries (scripts/build-k8s.sh, k8sversion.Default).
var (
	kubeDirGlob = "k8s-" + k8sversion.Default().Kubernetes + "-*"
	etcdDirGlob = "etcd-" + k8sversion.Default().Etcd + "-*"
)

// How long the processes get to become ready, and how often readiness is probed.
const (
	readyTimeout  = 90 * time.Second
	readyInterval = 200 * time.Millisecond
)

// Option changes how an Env's API server runs.
type Option func(*options)

type options struct {
	advertiseAddress string
	extraArgs        []string
	keepDir          bool
	nodes            []string
}

// NodeUser is the user name of node name's kubelet credentials.
func NodeUser(name string) string { return "system:node:" + name }

// Nodes adds a kubelet user (NodeUser, in group system:nodes) for each name, and makes the API
// server authorize as a cluster does: the Node authorizer before RBAC, and the NodeRestriction
// admission plugin.
func Nodes(names ...string) Option {
	return func(o *options) { o.nodes = append(o.nodes, names...) }
}

// AdvertiseAddress sets the address the API server advertises as the kubernetes Service's endpoint
// (127.0.0.1 without it).
func AdvertiseAddress(ip string) Option { return func(o *options) { o.advertiseAddress = ip } }

// APIServerArgs adds kube-apiserver flags, for example --enable-aggregator-routing=true for a test
// that plays the endpoints of a webhook Service.
func APIServerArgs(args ...string) Option {
	return func(o *options) { o.extraArgs = append(o.extraArgs, args...) }
}

// KeepDir leaves the Env's directory (process logs, etcd data, Dir's contents) after Stop, for
// inspection.
func KeepDir(keep bool) Option { return func(o *options) { o.keepDir = keep } }

func resolve(opts []Option) options {
	o := options{advertiseAddress: "127.0.0.1"}
	for _, f := range opts {
		f(&o)
	}
	return o
}

// Env is a running etcd + kube-apiserver pair.
type Env struct {
	opts    options
	dir     string
	certDir string
	url     string
	etcdURL string
	caData  []byte
	tokens  map[string]string // user -> token
	cmds    []proctest.Cmd    // etcd, kube-apiserver: what Restart starts again
	procs   []*proctest.Process
}

// Available reports why the binaries cannot be found, or nil when they can.
func Available() error {
	_, _, err := binDirs()
	return err
}

// EtcdBinary returns the etcd binary the API server runs on (for tests that run etcd members of their
// own), or why there is none.
func EtcdBinary() (string, error) {
	_, etcd, err := binDirs()
	if err != nil {
		return "", err
	}
	return filepath.Join(etcd, "etcd"), nil
}

// binDirs finds the kube and etcd bin dirs, or reports why not.
func binDirs() (kube, etcd string, err error) {
	kube, etcd = os.Getenv("BERTH_KUBE_BIN"), os.Getenv("BERTH_ETCD_BIN")
	cache := os.Getenv("BERTH_CACHE")
	if cache == "" {
		cache = "/var/cache/berth"
	}
	if kube == "" {
		kube = newestStamped(filepath.Join(cache, kubeDirGlob))
	}
	if etcd == "" {
		etcd = newestStamped(filepath.Join(cache, etcdDirGlob))
	}
	if kube == "" || etcd == "" {
		return "", "", fmt.Errorf("kube-apiserver %s and etcd %s are not built: run `scripts/build-k8s.sh k8s etcd` or set BERTH_KUBE_BIN and BERTH_ETCD_BIN",
			k8sversion.Default().Kubernetes, k8sversion.Default().Etcd)
	}
	for _, p := range []string{filepath.Join(kube, "kube-apiserver"), filepath.Join(etcd, "etcd")} {
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("no %s: run `scripts/build-k8s.sh k8s etcd`", p)
		}
	}
	return kube, etcd, nil
}

// newestStamped returns the bin dir of the newest dir matching pattern that has a stamp (a complete
// build), or "".
func newestStamped(pattern string) string {
	dirs, _ := filepath.Glob(pattern)
	var newest string
	var newestMod time.Time
	for _, d := range dirs {
		st, err := os.Stat(filepath.Join(d, "stamp"))
		if err == nil && (newest == "" || st.ModTime().After(newestMod)) {
			newest, newestMod = filepath.Join(d, "bin"), st.ModTime()
		}
	}
	return newest
}

var shared struct {
	once sync.Once
	opts options
	env  *Env
	err  error
}

// Require ends t when the binaries are missing: it skips, or fails under CI=true (prereq.Missing).
func Require(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		prereq.Missing(t, "%v", err)
	}
}

// Shared returns the test binary's Env, started on first use with opts; every call must pass the
// same options. Without the binaries it ends t as Require does. TestMain stops it with
// StoppingShared.
func Shared(t testing.TB, opts ...Option) *Env {
	t.Helper()
	Require(t)
	o := resolve(opts)
	shared.once.Do(func() {
		shared.opts = o
		shared.env, shared.err = start(o)
	})
	if !reflect.DeepEqual(o, shared.opts) {
		t.Fatal("apiservertest.Shared: called with other options than the first call")
	}
	if shared.err != nil {
		t.Fatalf("starting the API server: %v", shared.err)
	}
	return shared.env
}

type stoppingShared struct{ m proctest.Runner }

func (s stoppingShared) Run() int {
	code := s.m.Run()
	if shared.env != nil {
		shared.env.Stop()
	}
	return code
}

// StoppingShared wraps m so that the Env Shared started is stopped when the tests are done, before
// goleak looks for leftover goroutines: goleak.VerifyTestMain(apiservertest.StoppingShared(m)).
func StoppingShared(m proctest.Runner) proctest.Runner { return stoppingShared{m} }

// Start runs a fresh Env for t and stops it at cleanup. Without the binaries it ends t as Require
// does.
func Start(t testing.TB, opts ...Option) *Env {
	t.Helper()
	Require(t)
	e, err := start(resolve(opts))
	if err != nil {
		t.Fatalf("starting the API server: %v", err)
	}
	t.Cleanup(e.Stop)
	return e
}

func randomToken() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return fmt.Sprintf("%x", b), nil
}

func start(o options) (e *Env, err error) {
	kubeBin, etcdBin, err := binDirs()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "berth-apiservertest-")
	if err != nil {
		return nil, err
	}
	e = &Env{opts: o, dir: dir, certDir: filepath.Join(dir, "certs"), tokens: map[string]string{}}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, e.logTail())
			e.Stop()
			e = nil
		}
	}()
	var ports [3]int
	for i := range ports {
		if ports[i], err = proctest.FreePort(); err != nil {
			return e, err
		}
	}
	clientURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	e.etcdURL = clientURL
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	saKey, saPub, err := writeServiceAccountKey(dir)
	if err != nil {
		return e, err
	}
	tokenFile, err := e.writeTokens()
	if err != nil {
		return e, err
	}
	e.url = fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	var reconciler []string
	if ip, err := netip.ParseAddr(o.advertiseAddress); err == nil && ip.IsLoopback() {
		// kube-apiserver refuses a loopback advertise address (v1.37 and later) unless no endpoint
		// reconciler publishes it as the kubernetes Service's endpoint.
		reconciler = []string{"--endpoint-reconciler-type=none"}
	}
	e.cmds = []proctest.Cmd{{
		Name: "etcd", Path: filepath.Join(etcdBin, "etcd"), LogFile: filepath.Join(dir, "etcd.log"),
		Args: []string{"--name=default", "--data-dir=" + filepath.Join(dir, "etcd"),
			"--listen-client-urls=" + clientURL, "--advertise-client-urls=" + clientURL,
			"--listen-peer-urls=" + peerURL, "--initial-advertise-peer-urls=" + peerURL,
			"--initial-cluster=default=" + peerURL, "--unsafe-no-fsync=true", "--log-level=warn"},
	}, {
		Name: "kube-apiserver", Path: filepath.Join(kubeBin, "kube-apiserver"), LogFile: filepath.Join(dir, "kube-apiserver.log"),
		Args: append([]string{"--etcd-servers=" + clientURL, "--bind-address=127.0.0.1", "--advertise-address=" + o.advertiseAddress,
			"--secure-port=" + strconv.Itoa(ports[2]), "--cert-dir=" + e.certDir,
			"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file=" + saPub,
			"--service-account-signing-key-file=" + saKey, "--service-cluster-ip-range=10.96.0.0/16",
			"--token-auth-file=" + tokenFile, "--authorization-mode=" + authorization(o),
			// No flow control: load tests measure their own path, not APF queueing.
			"--enable-priority-and-fairness=false",
			"--v=0",
		}, append(append(admission(o), reconciler...), o.extraArgs...)...),
	}}
	return e, e.startProcesses(context.Background())
}

// authorization is the API server's --authorization-mode: with node users, as kubeadm sets it.
func authorization(o options) string {
	if len(o.nodes) > 0 {
		return "Node,RBAC"
	}
	return "RBAC"
}

// admission enables, with node users, the NodeRestriction admission plugin beside the defaults.
func admission(o options) []string {
	if len(o.nodes) > 0 {
		return []string{"--enable-admission-plugins=NodeRestriction"}
	}
	return nil
}

// writeServiceAccountKey writes the key pair the API server signs and verifies ServiceAccount tokens
// with.
func writeServiceAccountKey(dir string) (keyPath, pubPath string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return "", "", err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", err
	}
	keyPath, pubPath = filepath.Join(dir, "sa.key"), filepath.Join(dir, "sa.pub")
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return "", "", err
	}
	return keyPath, pubPath, os.WriteFile(pubPath, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o600)
}

// writeTokens makes the users' tokens and writes the API server's token file.
func (e *Env) writeTokens() (string, error) {
	users := []struct{ name, groups string }{
		{AdminUser, "system:masters"},
		{JoinServiceUser, "system:serviceaccounts,system:serviceaccounts:" + joinconfig.Namespace},
	}
	for _, n := range e.opts.nodes {
		users = append(users, struct{ name, groups string }{NodeUser(n), "system:nodes"})
	}
	var lines []string
	for _, u := range users {
		tok, err := randomToken()
		if err != nil {
			return "", err
		}
		e.tokens[u.name] = tok
		lines = append(lines, fmt.Sprintf("%s,%s,%s,%q", tok, u.name, u.name, u.groups))
	}
	path := filepath.Join(e.dir, "tokens.csv")
	return path, os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600)
}

// startProcesses starts etcd and kube-apiserver and waits until the API server is ready.
func (e *Env) startProcesses(ctx context.Context) error {
	for _, c := range e.cmds {
		p, err := proctest.Spawn(c)
		if err != nil {
			return err
		}
		e.procs = append(e.procs, p)
	}
	return proctest.WaitReady(ctx, readyInterval, readyTimeout, e.probe, e.procs...)
}

// probe reports whether the API server answers /readyz, once its serving certificate exists.
func (e *Env) probe(ctx context.Context) error {
	if e.caData == nil {
		b, err := os.ReadFile(filepath.Join(e.certDir, "apiserver.crt"))
		if err != nil {
			return err
		}
		e.caData = b
	}
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

// Config returns a client config for user (AdminUser, JoinServiceUser or a NodeUser of Nodes).
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

// EtcdURL is the client URL of the Env's etcd (plain HTTP on loopback), for tests that read what the
// API server stored, as it is stored.
func (e *Env) EtcdURL() string { return e.etcdURL }

// Dir is the Env's directory, for files a test keeps beside the API server's (removed with it).
func (e *Env) Dir() string { return e.dir }

// PIDs returns the process IDs of etcd and kube-apiserver, for harnesses that account their CPU time.
func (e *Env) PIDs() []int {
	var pids []int
	for _, p := range e.procs {
		pids = append(pids, p.PID())
	}
	return pids
}

// logTail returns the end of each process's log, for failure messages.
func (e *Env) logTail() string {
	var sb strings.Builder
	for _, p := range e.procs {
		fmt.Fprintf(&sb, "--- %s log (tail)\n%s\n", p.Name(), p.Tail(30))
	}
	return sb.String()
}

// stopProcesses stops the API server, then etcd.
func (e *Env) stopProcesses() {
	for _, p := range slices.Backward(e.procs) {
		_ = p.Stop()
	}
	e.procs = nil
}

// Restart stops kube-apiserver and etcd and starts both again on the same data, like a power cycle
// of the control plane, and waits until the API server is ready.
func (e *Env) Restart(ctx context.Context) error {
	e.stopProcesses()
	if err := e.startProcesses(ctx); err != nil {
		return fmt.Errorf("restarting the API server: %w\n%s", err, e.logTail())
	}
	return nil
}

// Stop terminates the processes (API server first) and removes the Env's directory.
func (e *Env) Stop() {
	e.stopProcesses()
	if !e.opts.keepDir {
		_ = os.RemoveAll(e.dir)
	}
}
