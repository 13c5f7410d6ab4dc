package clustertest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"go.uber.org/goleak"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/prereq"
	"github.com/berth-k8s/berth/internal/proctest"
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
	// After the tests: the webhook pods end, then the built webhook binary goes, then the API server.
	goleak.VerifyTestMain(apiservertest.StoppingShared(proctest.Main(closingPods{m})),
		// client-go's and net/http's long-lived helpers that outlive one test binary's clients.
		goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("k8s.io/apimachinery/pkg/watch.(*Broadcaster).loop"),
	)
}

// closingPods stops the webhook pods after the tests.
type closingPods struct{ m *testing.M }

func (c closingPods) Run() int {
	code := c.m.Run()
	if shared != nil {
		shared.runner.close()
	}
	return code
}

func prerequisites() string {
	if os.Geteuid() != 0 {
		return "needs root (a private network namespace)"
	}
	if err := apiservertest.Available(); err != nil {
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

// env is the test binary's API server (apiservertest, inside the namespace) with the admin's clients
// and the webhook pod runner.
type env struct {
	*apiservertest.Env
	kube   kubernetes.Interface
	dyn    dynamic.Interface
	runner *podRunner
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
		prereq.Missing(tb, "%s", skipReason)
	}
	api := apiservertest.Shared(tb,
		apiservertest.AdvertiseAddress(apiserverIP),
		// The API server dials webhook endpoints directly, as in the mini cluster; there is no kube-proxy.
		apiservertest.APIServerArgs("--enable-aggregator-routing=true"),
		apiservertest.KeepDir(os.Getenv("BERTH_WEBHOOK_KEEP") != ""),
	)
	bin := webhookBinary(tb)
	sharedOnce.Do(func() { shared, sharedErr = newEnv(api, bin) })
	if sharedErr != nil {
		tb.Fatalf("starting the webhook pod runner: %v", sharedErr)
	}
	return shared
}

func newEnv(api *apiservertest.Env, webhookBin string) (*env, error) {
	e := &env{Env: api}
	var err error
	if e.kube, err = kubernetes.NewForConfig(e.config()); err != nil {
		return nil, err
	}
	if e.dyn, err = dynamic.NewForConfig(e.config()); err != nil {
		return nil, err
	}
	e.runner = newPodRunner(e.kube, webhookBin, filepath.Join(api.Dir(), "pods"))
	return e, nil
}

// webhookBinary builds cmd/berth-webhook (or takes BERTH_WEBHOOK_BIN).
func webhookBinary(tb testing.TB) string {
	if bin := os.Getenv("BERTH_WEBHOOK_BIN"); bin != "" {
		return bin
	}
	return proctest.Build(tb, "github.com/berth-k8s/berth/cmd/berth-webhook", "CGO_ENABLED=0")
}

// config is the admin's client config.
func (e *env) config() *rest.Config { return e.Config(apiservertest.AdminUser) }
