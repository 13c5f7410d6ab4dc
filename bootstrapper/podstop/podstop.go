// Package podstop stops and removes every pod sandbox on this node through the container
// runtime's CRI, so that nothing the kubelet started keeps files open on the node's state disk
// once the kubelet itself has stopped (a node locked after a REVOKED check-in).
package podstop

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Runtime is the part of the CRI runtime service this package uses; runtimeapi's
// RuntimeServiceClient satisfies it.
type Runtime interface {
	ListPodSandbox(ctx context.Context, in *runtimeapi.ListPodSandboxRequest, opts ...grpc.CallOption) (*runtimeapi.ListPodSandboxResponse, error)
	StopPodSandbox(ctx context.Context, in *runtimeapi.StopPodSandboxRequest, opts ...grpc.CallOption) (*runtimeapi.StopPodSandboxResponse, error)
	RemovePodSandbox(ctx context.Context, in *runtimeapi.RemovePodSandboxRequest, opts ...grpc.CallOption) (*runtimeapi.RemovePodSandboxResponse, error)
}

// ErrNotUnix is returned by Dial for an endpoint that is not a unix socket.
var ErrNotUnix = errors.New("the container runtime endpoint is not a unix socket")

// Dial returns a CRI runtime client of the runtime at endpoint ("unix:///run/containerd/containerd.sock"
// or a plain socket path). The connection is made lazily; close it when done.
func Dial(endpoint string) (Runtime, func() error, error) {
	path, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok {
		if strings.Contains(endpoint, "://") {
			return nil, nil, fmt.Errorf("dialing %q: %w", endpoint, ErrNotUnix)
		}
		path = endpoint
	}
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to the container runtime: %w", err)
	}
	return runtimeapi.NewRuntimeServiceClient(conn), conn.Close, nil
}

// StopAll stops and then removes every pod sandbox the runtime lists (their containers with them),
// going on past a sandbox that fails so that as few as possible keep running. It returns how many
// sandboxes it removed and an error naming each sandbox that could not be stopped or removed. A
// sandbox that refuses to stop is not removed. Bound ctx: the runtime may not answer.
func StopAll(ctx context.Context, rt Runtime, log *zap.Logger) (int, error) {
	list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return 0, fmt.Errorf("listing the pod sandboxes: %w", err)
	}
	var errs []error
	removed := 0
	for _, sb := range list.GetItems() {
		id := sb.GetId()
		fields := []zap.Field{zap.String("sandbox", id), zap.String("pod", podName(sb))}
		if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
			log.Error("stopping a pod sandbox failed", append(fields, zap.Error(err))...)
			errs = append(errs, fmt.Errorf("stopping pod sandbox %s: %w", id, err))
			continue
		}
		if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
			log.Error("removing a pod sandbox failed", append(fields, zap.Error(err))...)
			errs = append(errs, fmt.Errorf("removing pod sandbox %s: %w", id, err))
			continue
		}
		removed++
		log.Info("pod sandbox stopped and removed", fields...)
	}
	if len(errs) > 0 {
		return removed, fmt.Errorf("%d of %d pod sandboxes still there: %w", len(errs), len(list.GetItems()), errors.Join(errs...))
	}
	return removed, nil
}

func podName(sb *runtimeapi.PodSandbox) string {
	m := sb.GetMetadata()
	if m == nil {
		return ""
	}
	return m.GetNamespace() + "/" + m.GetName()
}
