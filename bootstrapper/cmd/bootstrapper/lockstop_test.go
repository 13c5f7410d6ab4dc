package main

import (
	"bufio"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/bootstrapper/podstop/podstoptest"
)

// startProc starts a real process, waits until its script said ready (its traps are set) and
// returns it with a pid file naming it.
func startProc(t *testing.T, script string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command("sh", "-c", script)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("the process did not get ready: %q, %v", line, err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	path := filepath.Join(t.TempDir(), "runtime.pid")
	if err := os.WriteFile(path, []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return cmd, path
}

// TestPidFileRuntimeStops: the runtime named by the pid file gets SIGTERM and Stop returns once it
// ended.
func TestPidFileRuntimeStops(t *testing.T) {
	cmd, path := startProc(t, "echo ready; exec sleep 60")
	if err := (pidFileRuntime{path: path, timeout: 30 * time.Second}).Stop(t.Context()); err != nil {
		t.Fatalf("Stop() = %v", err)
	}
	// The process has ended (a zombie until reaped): Wait returns at once with the signal.
	if err := cmd.Wait(); err == nil || cmd.ProcessState.String() != "signal: terminated" {
		t.Errorf("runtime ended with %v, want signal: terminated", err)
	}
}

// TestPidFileRuntimeRefuses: a runtime that ignores SIGTERM is reported, named, once the bound ends.
func TestPidFileRuntimeRefuses(t *testing.T) {
	_, path := startProc(t, `trap "" TERM; echo ready; exec sleep 60`)
	err := (pidFileRuntime{path: path, timeout: 300 * time.Millisecond}).Stop(t.Context())
	if !errors.Is(err, ErrRuntimeStillRunning) {
		t.Fatalf("Stop() = %v; want ErrRuntimeStillRunning", err)
	}
}

// TestPidFileRuntimeNone: no pid file, no runtime to stop; a file without a process ID is an error.
func TestPidFileRuntimeNone(t *testing.T) {
	dir := t.TempDir()
	if err := (pidFileRuntime{path: filepath.Join(dir, "absent.pid")}).Stop(t.Context()); err != nil {
		t.Errorf("Stop() without a pid file = %v", err)
	}
	bad := filepath.Join(dir, "bad.pid")
	if err := os.WriteFile(bad, []byte("1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := (pidFileRuntime{path: bad}).Stop(t.Context()); err == nil {
		t.Error("Stop() with pid 1 in the file succeeded")
	}
}

type recStep struct {
	name  string
	err   error
	steps *[]string
}

func (r recStep) Stop(context.Context) error { *r.steps = append(*r.steps, r.name); return r.err }

// TestLockStop: the kubelet, the sandboxes, the kubelet's log and the runtime are stopped in that
// order; a sandbox that refuses to stop ends it with the error, the runtime left running.
func TestLockStop(t *testing.T) {
	for name, tc := range map[string]struct {
		refuse, kubeletFails bool
		want                 []string
		cri                  []string
	}{
		"all stop":              {want: []string{"kubelet", "log", "runtime"}, cri: []string{"stop sb1", "remove sb1"}},
		"sandbox refuses":       {refuse: true, want: []string{"kubelet"}, cri: []string{"stop sb1"}},
		"kubelet does not stop": {kubeletFails: true, want: []string{"kubelet"}},
	} {
		t.Run(name, func(t *testing.T) {
			var steps []string
			cri := &podstoptest.Runtime{Sandboxes: []string{"sb1"}, Refuse: map[string]bool{"sb1": tc.refuse}}
			kubelet := recStep{name: "kubelet", steps: &steps}
			if tc.kubeletFails {
				kubelet.err = errors.New("kubelet still running")
			}
			l := &lockStop{log: zap.NewNop(), kubelet: kubelet, criSocket: podstoptest.Serve(t, cri),
				closeLog: func() error { steps = append(steps, "log"); return nil }, runtime: recStep{name: "runtime", steps: &steps}}
			err := l.Stop(t.Context())
			if fails := tc.refuse || tc.kubeletFails; fails != (err != nil) {
				t.Errorf("Stop() = %v", err)
			}
			if !slices.Equal(steps, tc.want) || !slices.Equal(cri.Calls(), tc.cri) {
				t.Errorf("steps %q, CRI calls %q; want %q, %q", steps, cri.Calls(), tc.want, tc.cri)
			}
		})
	}
}
