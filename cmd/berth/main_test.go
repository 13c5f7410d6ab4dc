package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/prereq"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(removeBuild{m}) }

// removeBuild runs the tests, then removes the binary they built.
type removeBuild struct{ m *testing.M }

func (r removeBuild) Run() int {
	code := r.m.Run()
	if berthBinary.dir != "" {
		_ = os.RemoveAll(berthBinary.dir)
	}
	return code
}

// berthBinary is built once, with the ldflags `make build` uses.
var berthBinary struct {
	once sync.Once
	path string
	err  error
	dir  string
}

// repoRoot is the module's root directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// makeLDFlags is the -ldflags value of `make build`'s go build command.
var makeLDFlags = regexp.MustCompile(`-ldflags '([^']*)'`)

// build builds cmd/berth as `make build` does (its ldflags, read from make -n) into a directory
// removed when the test binary's tests are done (TestMain).
func build(t *testing.T) string {
	t.Helper()
	for _, tool := range []string{"make", "git"} {
		if _, err := exec.LookPath(tool); err != nil {
			prereq.Missing(t, "%s is needed to build berth as make build does", tool)
		}
	}
	root := repoRoot(t)
	berthBinary.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		plan, err := exec.CommandContext(ctx, "make", "-s", "-n", "-C", root, "build").Output()
		if err != nil {
			berthBinary.err = err
			return
		}
		m := makeLDFlags.FindSubmatch(plan)
		if m == nil {
			berthBinary.err = errors.New("make -n build shows no -ldflags '...': " + string(plan))
			return
		}
		if berthBinary.dir, err = os.MkdirTemp("", "berth-cli-test-"); err != nil {
			berthBinary.err = err
			return
		}
		berthBinary.path = filepath.Join(berthBinary.dir, "berth")
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", string(m[1]), "-o", berthBinary.path, ".")
		cmd.Dir = filepath.Join(root, "cmd", "berth")
		if out, err := cmd.CombinedOutput(); err != nil {
			berthBinary.err = errors.New(err.Error() + ": " + string(out))
		}
	})
	if berthBinary.err != nil {
		t.Fatalf("building berth: %v", berthBinary.err)
	}
	return berthBinary.path
}

type result struct {
	code           int
	stdout, stderr string
}

// run runs the binary with args and env (added to a clean environment: no KUBECONFIG, HOME as given).
func run(t *testing.T, bin string, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}, env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("running berth %v: %v", args, err)
	}
	return result{cmd.ProcessState.ExitCode(), out.String(), errOut.String()}
}

func writeKubeconfig(t *testing.T, path, server string) {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: server}
	cfg.AuthInfos["u"] = &clientcmdapi.AuthInfo{Token: "t"}
	cfg.Contexts["admin@c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "admin@c"
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
}

// fakeAPI is an httptest fake on loopback of the ledger GET berth status makes: 404, a cluster
// without a ledger yet.
func fakeAPI(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// unattestedEvidence writes a TPM policy and an evidence file whose certificate carries no
// attestation: policy check must reject it.
func unattestedEvidence(t *testing.T) (string, string) {
	t.Helper()
	dir := t.TempDir()
	ca, err := vtpmtest.NewCA("EK CA")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "ek-ca.pem"), ca.PEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	policy := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(policy, []byte("variant: tpm\nmeasurements:\n  15: {expected: "+strings.Repeat("00", 32)+"}\ntrustRoots:\n  - file: ek-ca.pem\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "x"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := json.Marshal(map[string]any{"version": 1, "endpoint": "198.51.100.10:9000", "capturedAt": time.Now().UTC(),
		"nonce": bytes.Repeat([]byte{1}, 32), "certificate": der})
	evidence := filepath.Join(dir, "node.evidence")
	if err := os.WriteFile(evidence, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return policy, evidence
}

// TestExitCodes runs the built binary for every exit code of the scheme in berth --help.
func TestExitCodes(t *testing.T) {
	bin := build(t)
	dir := t.TempDir()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := lis.Addr().String()
	_ = lis.Close()
	closed := filepath.Join(dir, "closed.conf")
	writeKubeconfig(t, closed, "http://"+closedAddr)
	policy, evidence := unattestedEvidence(t)

	for _, tc := range []struct {
		name string
		args []string
		code int
		in   string // in stderr
	}{
		{"help", []string{"--help"}, 0, ""},
		{"version", []string{"version"}, 0, ""},
		{"unknown command", []string{"stauts"}, 2, "Did you mean this?"},
		{"unknown flag", []string{"status", "--kubeconfg", "x"}, 2, "unknown flag: --kubeconfg"},
		{"wrong argument count", []string{"status", "w1", "w2"}, 2, "accepts at most 1 arg(s), received 2"},
		{"bad flag value", []string{"status", "--limit", "ten"}, 2, "invalid argument"},
		{"unknown output format", []string{"version", "-o", "xml"}, 2, "unknown output format"},
		{"required flag missing", []string{"init"}, 2, "required flag(s)"},
		{"no kubeconfig", []string{"status"}, 2, "no kubeconfig"},
		{"API server unreachable", []string{"status", "--kubeconfig", closed, "--timeout", "5s"}, 1, "connection refused"},
		{"evidence rejected", []string{"policy", "check", "--policy", policy, "--evidence", evidence}, 3, "node rejected"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := run(t, bin, nil, tc.args...)
			if r.code != tc.code || !strings.Contains(r.stderr, tc.in) {
				t.Fatalf("berth %s: exit %d, want %d; stderr %q", strings.Join(tc.args, " "), r.code, tc.code, r.stderr)
			}
			if tc.code == 2 && r.stdout != "" {
				t.Errorf("a usage error printed to stdout: %q", r.stdout)
			}
		})
	}
	help := run(t, bin, nil, "--help").stdout
	for _, want := range []string{"Exit codes:", "0    success", "1    failure", "2    usage", "3    rejected", "130  interrupted"} {
		if !strings.Contains(help, want) {
			t.Errorf("berth --help lacks %q", want)
		}
	}

	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run("interrupted by "+sig.String(), func(t *testing.T) { interrupted(t, bin, sig) })
	}
}

// interrupted starts berth status against an API server that accepts and never answers, and
// signals it once the connection is there: exit 130.
func interrupted(t *testing.T, bin string, sig syscall.Signal) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := lis.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		_ = lis.Close()
		wg.Wait()
		select {
		case c := <-accepted:
			_ = c.Close()
		default:
		}
	})
	kc := filepath.Join(t.TempDir(), "hang.conf")
	writeKubeconfig(t, kc, "http://"+lis.Addr().String())
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "status", "--kubeconfig", kc, "--timeout", "10m")
	cmd.Env = []string{"HOME=" + t.TempDir()}
	var errOut bytes.Buffer
	cmd.Stderr = &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	select {
	case c := <-accepted:
		accepted <- c // closed in cleanup
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatal("berth status never connected")
	}
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code != 130 {
		t.Fatalf("berth status after %s: exit %d, want 130; stderr %q", sig, code, errOut.String())
	}
}

// TestKubeconfigAsPrinted: what mini-up.sh and berth mini up print works as printed: with
// KUBECONFIG exported (also as a list) or ~/.kube/config, berth status needs no flag.
func TestKubeconfigAsPrinted(t *testing.T) {
	bin := build(t)
	api := fakeAPI(t)
	dir := t.TempDir()
	admin := filepath.Join(dir, "admin.conf")
	writeKubeconfig(t, admin, api.URL)
	home := t.TempDir()
	writeKubeconfig(t, filepath.Join(home, ".kube", "config"), api.URL)
	for name, env := range map[string][]string{
		"KUBECONFIG":          {"KUBECONFIG=" + admin},
		"KUBECONFIG list":     {"KUBECONFIG=" + filepath.Join(dir, "missing.conf") + string(filepath.ListSeparator) + admin},
		"HOME/.kube/config":   {"HOME=" + home},
		"KUBECONFIG is empty": {"KUBECONFIG=", "HOME=" + home},
	} {
		t.Run(name, func(t *testing.T) {
			r := run(t, bin, env, "status", "-o", "json")
			var report struct {
				Namespace   string `json:"namespace"`
				LedgerFound *bool  `json:"ledgerFound"`
			}
			if r.code != 0 || json.Unmarshal([]byte(r.stdout), &report) != nil || report.LedgerFound == nil || *report.LedgerFound || report.Namespace != "berth-system" {
				t.Fatalf("berth status -o json with %v: exit %d\nstdout %q\nstderr %q", env, r.code, r.stdout, r.stderr)
			}
		})
	}
}

// TestVersionStamped: make build's ldflags reach berth version (a wrong -X name would be ignored
// silently by the linker).
func TestVersionStamped(t *testing.T) {
	bin := build(t)
	r := run(t, bin, nil, "version", "-o", "json")
	var v map[string]string
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &v) != nil {
		t.Fatalf("berth version -o json: exit %d, %q", r.code, r.stdout)
	}
	head, err := exec.CommandContext(t.Context(), "git", "-C", repoRoot(t), "rev-parse", "HEAD").Output()
	if err != nil {
		prereq.Missing(t, "not a git checkout: %v", err)
	}
	if !strings.HasPrefix(v["gitCommit"], strings.TrimSpace(string(head))) {
		t.Errorf("gitCommit %q, want HEAD %s", v["gitCommit"], head)
	}
	if _, err := time.Parse(time.RFC3339, v["buildDate"]); err != nil {
		t.Errorf("buildDate %q: %v", v["buildDate"], err)
	}
	if v["version"] == "dev" || v["version"] == "" || v["goVersion"] == "" || v["platform"] == "" {
		t.Errorf("berth version -o json: %v", v)
	}
}
