package kubelet

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/command"
	"github.com/berth-k8s/berth/internal/command/commandtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestSystemdStart(t *testing.T) {
	rec := &commandtest.Recorder{}
	s := &Systemd{Exec: rec}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := rec.String(), "systemctl enable --now --no-block kubelet.service"; got != want {
		t.Fatalf("calls = %q, want %q", got, want)
	}
}

// startLog records when (in the bubble's time) each kubelet run wrote its first line.
type startLog struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	times []time.Time
}

func (l *startLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.times = append(l.times, time.Now())
	return l.buf.Write(p)
}

func (l *startLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *startLog) Times() []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.times)
}

// The supervisor runs in a synctest bubble: its poll and restart waits pass in the bubble's time,
// which stands still while a stand-in kubelet process runs, so the gaps between starts are exactly
// the restart backoff.
func TestSupervisorWaitsForConfigAndRestarts(t *testing.T) {
	dir := t.TempDir()
	kubeletDir := filepath.Join(dir, "var-lib-kubelet")
	k8sDir := filepath.Join(dir, "etc-kubernetes")
	for _, d := range []string{kubeletDir, k8sDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A stand-in kubelet that prints its arguments and exits, so the supervisor restarts it.
	fake := filepath.Join(dir, "kubelet")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho \"kubelet $*\"\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	synctest.Test(t, func(t *testing.T) {
		out := &startLog{}
		s := &Supervisor{Path: fake, KubeletDir: kubeletDir, KubernetesDir: k8sDir, Output: out,
			PollInterval: 10 * time.Millisecond, ExtraArgs: []string{"--cgroup-root=/node1"}}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()

		if err := s.Start(ctx); err != nil {
			t.Fatal(err)
		}
		// Let the supervisor poll for kubeadm's files for a while (in the bubble's time).
		time.Sleep(time.Second)
		if n := s.Starts(); n != 0 {
			t.Fatalf("kubelet started %d times before kubeadm wrote its config", n)
		}
		write := func(path, data string) {
			if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		write(filepath.Join(kubeletDir, "kubeadm-flags.env"), `KUBELET_KUBEADM_ARGS="--node-ip=198.51.100.10 --container-runtime-endpoint=unix:///run/c.sock"`+"\n")
		write(filepath.Join(kubeletDir, "config.yaml"), "kind: KubeletConfiguration\n")
		write(filepath.Join(k8sDir, "bootstrap-kubelet.conf"), "kind: Config\n")

		err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
			return len(out.Times()) >= 3, nil
		})
		cancel()
		if err != nil {
			t.Fatalf("waiting for two restarts: %v (starts: %d)", err, s.Starts())
		}
		if err := <-done; err != nil {
			t.Fatalf("Run() = %v", err)
		}
		times := out.Times()
		// Restarted after 1 s, then after 2 s (up to one poll interval later).
		for i, want := range []time.Duration{time.Second, 2 * time.Second} {
			if gap := times[i+1].Sub(times[i]); gap < want || gap > want+s.PollInterval {
				t.Errorf("restart %d came %s after the previous start, want %s", i+1, gap, want)
			}
		}
		first, _, _ := strings.Cut(out.String(), "\n")
		want := "kubelet --config=" + kubeletDir + "/config.yaml --kubeconfig=" + k8sDir + "/kubelet.conf --bootstrap-kubeconfig=" +
			k8sDir + "/bootstrap-kubelet.conf --node-ip=198.51.100.10 --container-runtime-endpoint=unix:///run/c.sock --cgroup-root=/node1"
		if first != want {
			t.Fatalf("kubelet argv:\n got %s\nwant %s", first, want)
		}
	})
}

func TestSupervisorStopsBeforeEnabled(t *testing.T) {
	s := &Supervisor{Path: "/nonexistent/kubelet"}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Run(ctx); err != nil {
		t.Fatalf("Run() on cancelled ctx = %v", err)
	}
}

// sleepingKubelet returns a supervisor of a stand-in kubelet that runs until it is killed, with
// kubeadm's files in place, and the path of its child record.
func sleepingKubelet(t *testing.T) (*Supervisor, string) {
	t.Helper()
	dir := t.TempDir()
	kubeletDir, k8sDir := filepath.Join(dir, "kubelet"), filepath.Join(dir, "kubernetes")
	for _, f := range []string{filepath.Join(kubeletDir, "config.yaml"), filepath.Join(k8sDir, "kubelet.conf")} {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	fake := filepath.Join(dir, "fake-kubelet")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nexec sleep 600\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	record := filepath.Join(dir, "children.json")
	s := &Supervisor{Path: fake, KubeletDir: kubeletDir, KubernetesDir: k8sDir, PollInterval: 10 * time.Millisecond,
		Children: command.NewChildren(record)}
	return s, record
}

// TestSupervisorRecordsTheKubelet: while the kubelet runs it is in the daemon's child record (so a
// restarted daemon can kill one a crashed daemon left), in a process group of its own; a stop
// removes it from the record.
func TestSupervisorRecordsTheKubelet(t *testing.T) {
	s, record := sleepingKubelet(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	var recorded []command.Child
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		b, err := os.ReadFile(record)
		return err == nil && json.Unmarshal(b, &recorded) == nil && len(recorded) == 1, nil
	}); err != nil {
		t.Fatalf("the running kubelet never appeared in the record: %v", err)
	}
	if recorded[0].Name != "fake-kubelet" || recorded[0].PID <= 1 {
		t.Fatalf("record = %+v", recorded)
	}
	pgid, err := syscall.Getpgid(recorded[0].PID)
	if err != nil || pgid != recorded[0].PID {
		t.Errorf("the kubelet's process group = %d (%v), want its own (%d)", pgid, err, recorded[0].PID)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v", err)
	}
	b, err := os.ReadFile(record)
	if err != nil || strings.TrimSpace(string(b)) != "[]" {
		t.Errorf("record after the stop = %q, %v; want []", b, err)
	}
}

// TestSupervisorStopAndStartAgain: Stop returns once the running kubelet has exited and keeps it
// stopped (no restart while disabled, even when kubeadm's files are there); Start runs it again.
func TestSupervisorStopAndStartAgain(t *testing.T) {
	s, record := sleepingKubelet(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	running := func() int {
		t.Helper()
		var recorded []command.Child
		if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			b, err := os.ReadFile(record)
			return err == nil && json.Unmarshal(b, &recorded) == nil && len(recorded) == 1, nil
		}); err != nil {
			t.Fatalf("no running kubelet in the record: %v", err)
		}
		return recorded[0].PID
	}
	// Stop before any start is a no-op.
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	first := running()
	if err := s.Stop(ctx); err != nil {
		t.Fatalf("Stop() = %v", err)
	}
	// Stop returned: the process is gone and reaped, and the record is empty.
	if err := syscall.Kill(first, 0); err == nil {
		t.Errorf("kubelet %d still runs after Stop", first)
	}
	if b, err := os.ReadFile(record); err != nil || strings.TrimSpace(string(b)) != "[]" {
		t.Errorf("record after Stop = %q, %v; want []", b, err)
	}
	if got := s.Starts(); got != 1 {
		t.Errorf("starts after Stop = %d, want 1 (a stopped kubelet is not restarted)", got)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if second := running(); second == first {
		t.Errorf("Start after Stop shows the old kubelet %d", first)
	}
	if got := s.Starts(); got != 2 {
		t.Errorf("starts = %d, want 2", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v", err)
	}
}

func TestSystemdStop(t *testing.T) {
	rec := &commandtest.Recorder{}
	s := &Systemd{Exec: rec}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := rec.String(), "systemctl stop kubelet.service"; got != want {
		t.Fatalf("calls = %q, want %q", got, want)
	}
}
