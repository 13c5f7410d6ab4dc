package kubelet

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/berth-k8s/berth/internal/command/commandtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestSystemdStart(t *testing.T) {
	rec := &commandtest.Recorder{}
	s := &Systemd{Exec: rec}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := rec.String(), "systemctl enable --now kubelet.service"; got != want {
		t.Fatalf("calls = %q, want %q", got, want)
	}
}

// syncBuffer is a bytes.Buffer safe for the child's writer goroutine and the test.
type syncBuffer struct {
	mu  chan struct{}
	buf bytes.Buffer
}

func newSyncBuffer() *syncBuffer { return &syncBuffer{mu: make(chan struct{}, 1)} }
func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu <- struct{}{}
	defer func() { <-b.mu }()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu <- struct{}{}
	defer func() { <-b.mu }()
	return b.buf.String()
}

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
	out := newSyncBuffer()
	s := &Supervisor{Path: fake, KubeletDir: kubeletDir, KubernetesDir: k8sDir, Output: out,
		PollInterval: 10 * time.Millisecond, ExtraArgs: []string{"--cgroup-root=/node1"}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
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

	deadline := time.Now().Add(10 * time.Second)
	for s.Starts() < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if n := s.Starts(); n < 2 {
		t.Fatalf("kubelet started %d times, want a restart", n)
	}
	first, _, _ := strings.Cut(out.String(), "\n")
	want := "kubelet --config=" + kubeletDir + "/config.yaml --kubeconfig=" + k8sDir + "/kubelet.conf --bootstrap-kubeconfig=" +
		k8sDir + "/bootstrap-kubelet.conf --node-ip=198.51.100.10 --container-runtime-endpoint=unix:///run/c.sock --cgroup-root=/node1"
	if first != want {
		t.Fatalf("kubelet argv:\n got %s\nwant %s", first, want)
	}
}

func TestSupervisorStopsBeforeEnabled(t *testing.T) {
	s := &Supervisor{Path: "/nonexistent/kubelet"}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Run(ctx); err != nil {
		t.Fatalf("Run() on cancelled ctx = %v", err)
	}
}
