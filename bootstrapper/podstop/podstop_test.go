package podstop

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// runtimeServer is a CRI runtime service over a real unix socket that knows sandboxes and refuses
// to stop the ones in refuse.
type runtimeServer struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	mu        sync.Mutex
	sandboxes []string
	stopped   []string
	refuse    map[string]bool
}

func (s *runtimeServer) ListPodSandbox(context.Context, *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &runtimeapi.ListPodSandboxResponse{}
	for _, id := range s.sandboxes {
		resp.Items = append(resp.Items, &runtimeapi.PodSandbox{Id: id, Metadata: &runtimeapi.PodSandboxMetadata{Name: "pod-" + id, Namespace: "default"}})
	}
	return resp, nil
}

func (s *runtimeServer) StopPodSandbox(_ context.Context, r *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refuse[r.PodSandboxId] {
		return nil, status.Error(codes.Internal, "shim does not answer")
	}
	s.stopped = append(s.stopped, r.PodSandboxId)
	return &runtimeapi.StopPodSandboxResponse{}, nil
}

func (s *runtimeServer) RemovePodSandbox(_ context.Context, r *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !slices.Contains(s.stopped, r.PodSandboxId) {
		return nil, status.Error(codes.FailedPrecondition, "sandbox still running")
	}
	s.sandboxes = slices.DeleteFunc(s.sandboxes, func(id string) bool { return id == r.PodSandboxId })
	return &runtimeapi.RemovePodSandboxResponse{}, nil
}

func serve(t *testing.T, s *runtimeServer) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cri.sock")
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, s)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return "unix://" + sock
}

func stopAll(t *testing.T, endpoint string) (int, *observer.ObservedLogs, error) {
	t.Helper()
	rt, closeConn, err := Dial(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = closeConn() }()
	core, logs := observer.New(zap.InfoLevel)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	n, err := StopAll(ctx, rt, zap.New(core))
	return n, logs, err
}

// TestStopAll stops and removes every sandbox a real gRPC CRI server lists, through Dial's client.
func TestStopAll(t *testing.T) {
	s := &runtimeServer{sandboxes: []string{"a", "b", "c"}}
	n, logs, err := stopAll(t, serve(t, s))
	if err != nil || n != 3 {
		t.Fatalf("StopAll = %d, %v; want 3, nil", n, err)
	}
	if len(s.sandboxes) != 0 {
		t.Errorf("sandboxes left: %v", s.sandboxes)
	}
	if got := logs.FilterMessage("pod sandbox stopped and removed").Len(); got != 3 {
		t.Errorf("%d sandboxes logged as removed, want 3", got)
	}
}

// TestStopAllRefused: a sandbox that refuses to stop is reported by ID, logged, not removed, and
// does not keep the others from being stopped and removed.
func TestStopAllRefused(t *testing.T) {
	s := &runtimeServer{sandboxes: []string{"a", "stuck", "c"}, refuse: map[string]bool{"stuck": true}}
	n, logs, err := stopAll(t, serve(t, s))
	if err == nil {
		t.Fatal("StopAll reported no error for a sandbox that refused to stop")
	}
	if n != 2 || !strings.Contains(err.Error(), "stopping pod sandbox stuck") || !strings.Contains(err.Error(), "1 of 3") {
		t.Errorf("StopAll = %d, %v; want 2 and an error naming sandbox stuck", n, err)
	}
	if !slices.Equal(s.sandboxes, []string{"stuck"}) {
		t.Errorf("sandboxes left: %v, want [stuck]", s.sandboxes)
	}
	if logs.FilterMessage("stopping a pod sandbox failed").Len() != 1 {
		t.Errorf("the refusal was not logged: %v", logs.All())
	}
}

// TestStopAllNoRuntime: a runtime that does not answer is an error, not zero sandboxes.
func TestStopAllNoRuntime(t *testing.T) {
	_, _, err := stopAll(t, "unix://"+filepath.Join(t.TempDir(), "absent.sock"))
	if err == nil || !strings.Contains(err.Error(), "listing the pod sandboxes") {
		t.Fatalf("StopAll without a runtime = %v, want a listing error", err)
	}
}

func TestDialNotUnix(t *testing.T) {
	if _, _, err := Dial("tcp://127.0.0.1:1"); !errors.Is(err, ErrNotUnix) {
		t.Fatalf("Dial(tcp) = %v, want ErrNotUnix", err)
	}
}
