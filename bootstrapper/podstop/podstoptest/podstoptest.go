// Package podstoptest serves a fake CRI runtime service on a real unix socket for the tests of
// podstop and of its callers: it lists the pod sandboxes it was given, refuses to stop the ones
// named in Refuse, removes only stopped sandboxes and records every stop and remove in order. For
// tests only.
package podstoptest

import (
	"context"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Runtime is the fake runtime service. Set Sandboxes and Refuse before Serve; read the state through
// Left and Calls.
type Runtime struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	// Sandboxes are the IDs of the pod sandboxes the runtime lists, in order.
	Sandboxes []string
	// Refuse names the sandboxes whose stop fails with codes.Internal.
	Refuse map[string]bool

	mu      sync.Mutex
	stopped []string
	calls   []string
}

// ListPodSandbox lists the sandboxes not yet removed, each named pod-<id> in namespace default.
func (r *Runtime) ListPodSandbox(context.Context, *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	resp := &runtimeapi.ListPodSandboxResponse{}
	for _, id := range r.Sandboxes {
		resp.Items = append(resp.Items, &runtimeapi.PodSandbox{Id: id, Metadata: &runtimeapi.PodSandboxMetadata{Name: "pod-" + id, Namespace: "default"}})
	}
	return resp, nil
}

// StopPodSandbox records the call and stops the sandbox, or fails for one named in Refuse.
func (r *Runtime) StopPodSandbox(_ context.Context, req *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "stop "+req.PodSandboxId)
	if r.Refuse[req.PodSandboxId] {
		return nil, status.Error(codes.Internal, "shim does not answer")
	}
	r.stopped = append(r.stopped, req.PodSandboxId)
	return &runtimeapi.StopPodSandboxResponse{}, nil
}

// RemovePodSandbox records the call and removes a stopped sandbox; a running one is
// codes.FailedPrecondition.
func (r *Runtime) RemovePodSandbox(_ context.Context, req *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "remove "+req.PodSandboxId)
	if !slices.Contains(r.stopped, req.PodSandboxId) {
		return nil, status.Error(codes.FailedPrecondition, "sandbox still running")
	}
	r.Sandboxes = slices.DeleteFunc(r.Sandboxes, func(id string) bool { return id == req.PodSandboxId })
	return &runtimeapi.RemovePodSandboxResponse{}, nil
}

// Left returns the sandboxes not removed.
func (r *Runtime) Left() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.Sandboxes)
}

// Calls returns the stop and remove calls so far, in order, as "stop <id>" and "remove <id>".
func (r *Runtime) Calls() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// Serve serves r on a unix socket in a temporary directory until the test ends and returns the
// socket's endpoint, unix://<path>.
func Serve(t *testing.T, r *Runtime) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "cri.sock")
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, r)
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
