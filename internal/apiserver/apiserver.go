// Package apiserver waits for a Kubernetes API server to become ready.
package apiserver

import (
	"context"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/kubeclient"
)

// Waiter polls an API server's /readyz.
type Waiter struct {
	// Interval between polls (default 500 ms).
	Interval time.Duration
}

// WaitReady returns once the API server named by the kubeconfig at path answers /readyz with 200.
// A kubeconfig that does not exist yet is waited for too. On ctx's end it returns the last error.
func (w Waiter) WaitReady(ctx context.Context, kubeconfigPath string) error {
	interval := w.Interval
	if interval == 0 {
		interval = 500 * time.Millisecond
	}
	var last error
	if err := wait.PollUntilContextCancel(ctx, interval, true, func(ctx context.Context) (bool, error) {
		last = probe(ctx, kubeconfigPath)
		return last == nil, nil
	}); err != nil {
		if last == nil {
			return fmt.Errorf("waiting for the API server: %w", err)
		}
		return fmt.Errorf("%w (last error: %w)", err, last)
	}
	return nil
}

func probe(ctx context.Context, kubeconfigPath string) error {
	cfg, err := kubeclient.FromFile(kubeconfigPath)
	if err != nil {
		return fmt.Errorf("loading kubeconfig: %w", err)
	}
	cfg.Timeout = 5 * time.Second
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("creating client: %w", err)
	}
	body, err := client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("querying /readyz: %w", err)
	}
	if string(body) != "ok" {
		return fmt.Errorf("/readyz answered %q", body)
	}
	return nil
}
