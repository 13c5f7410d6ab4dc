package proctest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// helperEnv makes the test binary act as the process under test (see helper).
const helperEnv = "BERTH_PROCTEST_HELPER"

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helper(mode))
	}
	goleak.VerifyTestMain(Main(m))
}

// helper is the process under test: it says hello, writes the file BERTH_PROCTEST_READY when asked
// to, then acts as mode says.
func helper(mode string) int {
	fmt.Println("hello from the helper")
	terms := make(chan os.Signal, 1)
	signal.Notify(terms, syscall.SIGTERM)
	if f := os.Getenv("BERTH_PROCTEST_READY"); f != "" {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			return 2
		}
	}
	switch mode {
	case "exit":
		fmt.Println("failing at once")
		return 3
	case "ignore-term":
		for range terms {
			fmt.Println("ignoring SIGTERM")
		}
	default: // "serve"
		<-terms
		fmt.Println("stopping on SIGTERM")
	}
	return 0
}

func helperCmd(mode string, env ...string) Cmd {
	return Cmd{Name: "helper-" + mode, Path: os.Args[0], Args: []string{"-test.run=^$"}, Env: append(env, helperEnv+"="+mode)}
}

func fileExists(path string) func(context.Context) error {
	return func(context.Context) error {
		_, err := os.Stat(path)
		return err
	}
}

func TestStartWaitStop(t *testing.T) {
	ready := filepath.Join(t.TempDir(), "ready")
	p := Start(t, helperCmd("serve", "BERTH_PROCTEST_READY="+ready))
	if err := WaitReady(context.Background(), 10*time.Millisecond, 30*time.Second, fileExists(ready), p); err != nil {
		t.Fatal(err)
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("Stop = %v, want a clean exit", err)
	}
	if !strings.Contains(p.Tail(1), "stopping on SIGTERM") {
		t.Fatalf("output ends with %q", p.Tail(1))
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("second Stop = %v", err)
	}
	select {
	case <-p.Done():
	default:
		t.Fatal("Done not closed after Stop")
	}
}

func TestStopKillsAfterGrace(t *testing.T) {
	ready := filepath.Join(t.TempDir(), "ready")
	c := helperCmd("ignore-term", "BERTH_PROCTEST_READY="+ready)
	c.Grace = 100 * time.Millisecond
	p := Start(t, c)
	if err := WaitReady(context.Background(), 10*time.Millisecond, 30*time.Second, fileExists(ready), p); err != nil {
		t.Fatal(err)
	}
	if err := p.Stop(); !errors.Is(err, ErrKilled) {
		t.Fatalf("Stop = %v, want ErrKilled", err)
	}
	var exit *exec.ExitError
	if err := p.Err(); !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("Err = %v, want killed by SIGKILL", err)
	}
}

func TestWaitReadyFailsWhenTheProcessExits(t *testing.T) {
	p := Start(t, helperCmd("exit"))
	err := WaitReady(context.Background(), 10*time.Millisecond, time.Minute, func(context.Context) error { return errors.New("not yet") }, p)
	if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "failing at once") {
		t.Fatalf("WaitReady = %v, want the exit and the output's tail", err)
	}
	var exit *exec.ExitError
	if !errors.As(p.Err(), &exit) || exit.ExitCode() != 3 {
		t.Fatalf("Err = %v, want exit status 3", p.Err())
	}
}

func TestWaitReadyTimeoutNamesLastError(t *testing.T) {
	err := WaitReady(context.Background(), 5*time.Millisecond, 50*time.Millisecond, func(context.Context) error { return errors.New("still warming up") })
	if err == nil || !strings.Contains(err.Error(), "still warming up") {
		t.Fatalf("WaitReady = %v, want the condition's last error", err)
	}
}

func TestSpawnNeedsLogFile(t *testing.T) {
	if _, err := Spawn(Cmd{Name: "x", Path: os.Args[0]}); err == nil {
		t.Fatal("Spawn without a log file succeeded")
	}
}

func TestBuildOnce(t *testing.T) {
	bin := Build(t, "./testdata/hello")
	st, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	if again := Build(t, "./testdata/hello"); again != bin {
		t.Fatalf("second Build = %s, want %s", again, bin)
	}
	if st2, err := os.Stat(bin); err != nil || !st2.ModTime().Equal(st.ModTime()) {
		t.Fatalf("the binary was built again (%v)", err)
	}
	if filepath.Base(bin) != "hello" {
		t.Fatalf("binary %s, want it named after the package", bin)
	}
	out, err := exec.Command(bin).Output()
	if err != nil || string(out) != "hello\n" {
		t.Fatalf("running the binary: %q %v", out, err)
	}
}

func TestFreeAddr(t *testing.T) {
	if a := FreeAddr(t); !strings.HasPrefix(a, "127.0.0.1:") {
		t.Fatalf("FreeAddr = %s", a)
	}
}

// TestHTTPOK: ready once the endpoint answers 200, not while it answers 503 or nothing listens.
func TestHTTPOK(t *testing.T) {
	var ready atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if !ready.Load() {
			http.Error(w, "not yet", http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	check := HTTPOK(srv.URL + "/readyz")
	if err := check(t.Context()); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("HTTPOK while the endpoint answers 503 = %v, want an error naming the status", err)
	}
	ready.Store(true)
	if err := check(t.Context()); err != nil {
		t.Errorf("HTTPOK while the endpoint answers 200 = %v", err)
	}
	srv.Close()
	if err := check(t.Context()); err == nil {
		t.Error("HTTPOK with nothing listening succeeded")
	}
}
