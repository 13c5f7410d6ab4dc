//go:build e2e

package e2e

import (
	"path/filepath"
	"testing"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// adminClient is a client of the cluster's API server with the operator's admin.conf.
func (c *cluster) adminClient(t testing.TB) kubernetes.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(c.dir, "admin.conf"))
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return client
}
