// Package proctest starts and stops processes for tests: it builds a main package once per test
// binary, starts a command with its output in a file, waits until the process is ready by polling a
// condition, and stops it with SIGTERM, then SIGKILL after a grace period.
//
// Every process is waited for (reaped) by the goroutine that Start or Spawn begins for it, so no
// zombie is left behind even where PID 1 does not reap orphans, and every process gets SIGKILL when
// the test binary dies. A process started with Start belongs to one test and is stopped in that
// test's cleanup; when the test failed, the end of its output goes to the test log. A process a test
// binary shares between tests (an API server) is started with Spawn and stopped by its owner.
//
// Binaries built with Build live in one directory per test binary, removed after the tests when
// TestMain runs them through Main:
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(proctest.Main(m)) }
package proctest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// DefaultGrace is how long Stop waits after SIGTERM before it sends SIGKILL, unless Cmd.Grace says.
const DefaultGrace = 10 * time.Second

// How much of a process's output goes into the test log when its test failed, and into the error
// when it exited before it was ready.
const (
	logTailLines  = 200
	exitTailLines = 30
)

// ErrKilled is what Stop returns when the process did not exit within the grace period after
// SIGTERM and was killed.
var ErrKilled = errors.New("killed: not stopped within the grace period after SIGTERM")

// Cmd is a process to start.
type Cmd struct {
	// Name names the process in messages and its default log file.
	Name string
	// Path is the binary.
	Path string
	// Args are the arguments after the binary's name.
	Args []string
	// Env is added to this process's environment.
	Env []string
	// LogFile receives stdout and stderr, appended. Start defaults it to a file in the test's
	// temporary directory; Spawn needs it.
	LogFile string
	// Grace is the time between SIGTERM and SIGKILL in Stop; zero means DefaultGrace.
	Grace time.Duration
}

// Process is a started process.
type Process struct {
	name    string
	logFile string
	grace   time.Duration
	proc    *os.Process
	done    chan struct{}
	err     error // how the process ended; written before done is closed
}

// Start starts c for t and stops it in t's cleanup, logging the end of its output when t failed.
func Start(t testing.TB, c Cmd) *Process {
	t.Helper()
	if c.LogFile == "" {
		c.LogFile = filepath.Join(t.TempDir(), c.Name+".log")
	}
	p, err := Spawn(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		err := p.Stop()
		if t.Failed() {
			t.Logf("%s ended: %v; its output (tail):\n%s", p.name, err, p.Tail(logTailLines))
		}
	})
	return p
}

// Spawn starts c without tying it to a test; the caller stops it with Stop.
func Spawn(c Cmd) (*Process, error) {
	if c.LogFile == "" {
		return nil, fmt.Errorf("starting %s: no log file", c.Name)
	}
	logf, err := os.OpenFile(c.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", c.Name, err)
	}
	// Not CommandContext: the process outlives the call that starts it, and Stop ends it in order
	// (SIGTERM, then SIGKILL after a grace period) instead of a context's bare kill.
	cmd := exec.Command(c.Path, c.Args...) //nolint:noctx // see above
	if c.Env != nil {
		cmd.Env = append(os.Environ(), c.Env...)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group: a terminal's ^C reaches only the test binary, which stops it in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", c.Name, err)
	}
	grace := c.Grace
	if grace == 0 {
		grace = DefaultGrace
	}
	p := &Process{name: c.Name, logFile: c.LogFile, grace: grace, proc: cmd.Process, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// Name is the process's name from its Cmd.
func (p *Process) Name() string { return p.name }

// PID is the process's ID, for harnesses that account its CPU time.
func (p *Process) PID() int { return p.proc.Pid }

// Done is closed once the process has exited and was reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is how the process ended (nil for exit status 0); valid once Done is closed.
func (p *Process) Err() error {
	<-p.done
	return p.err
}

// Stop sends SIGTERM, sends SIGKILL when the process has not exited after the grace period, and
// returns once it is gone: how it ended, or ErrKilled. Calling it again returns the same.
func (p *Process) Stop() error {
	select {
	case <-p.done:
		return p.err
	default:
	}
	_ = p.proc.Signal(syscall.SIGTERM)
	timer := time.NewTimer(p.grace)
	defer timer.Stop()
	select {
	case <-p.done:
		return p.err
	case <-timer.C:
		_ = p.proc.Kill()
		<-p.done
		return fmt.Errorf("stopping %s: %w", p.name, ErrKilled)
	}
}

// Tail returns the last n lines of the process's output.
func (p *Process) Tail(n int) string {
	b, err := os.ReadFile(p.logFile)
	if err != nil {
		return fmt.Sprintf("(reading %s: %v)", p.logFile, err)
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// WaitReady calls ready every interval until it returns nil. It fails when timeout passes or ctx
// ends first, naming ready's last error, or as soon as one of procs has exited.
func WaitReady(ctx context.Context, interval, timeout time.Duration, ready func(context.Context) error, procs ...*Process) error {
	var last, exited error
	err := wait.PollUntilContextTimeout(ctx, interval, timeout, true, func(ctx context.Context) (bool, error) {
		for _, p := range procs {
			select {
			case <-p.done:
				exited = fmt.Errorf("%s exited before it was ready: %w; its output (tail):\n%s", p.name, p.err, p.Tail(exitTailLines))
				return false, exited
			default:
			}
		}
		last = ready(ctx)
		return last == nil, nil
	})
	if err != nil && exited == nil && last != nil {
		return fmt.Errorf("waiting until ready: %w (last: %w)", err, last)
	}
	return err
}

// HTTPOK returns a readiness condition for WaitReady: a GET of url answers 200 OK (a health
// endpoint such as /readyz).
func HTTPOK(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return nil
	}
}

// FreePort returns a loopback TCP port that was free a moment ago, for a process to listen on.
func FreePort() (int, error) {
	l, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// FreeAddr returns a loopback host:port that was free a moment ago.
func FreeAddr(t testing.TB) string {
	t.Helper()
	port, err := FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}
