package configmapkey

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

// TestUpdateOnAPIServer: concurrent writers on a real API server (its resourceVersion conflicts and
// create races) never lose each other's changes.
func TestUpdateOnAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	admin := env.Client(t, apiservertest.AdminUser)
	ctx := context.Background()
	ref := ref
	ref.Namespace = "configmapkey"
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ref.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	backoff := wait.Backoff{Duration: 10 * time.Millisecond, Factor: 1.5, Jitter: 0.5, Steps: 50}
	const writers, each = 4, 10
	var g errgroup.Group
	for w := range writers {
		g.Go(func() error {
			for i := range each {
				if _, err := Update(ctx, admin, ref, backoff, appendLine(fmt.Sprintf("%d-%d", w, i))); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatalf("Update: %v", err)
	}
	cm, err := admin.CoreV1().ConfigMaps(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(cm.Data[ref.Key], "\n"); lines != writers*each {
		t.Fatalf("the ConfigMap holds %d lines, want %d", lines, writers*each)
	}
}
