package install

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/berth-k8s/berth/internal/webhookconfig"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestKeeperEndToEndStopsWhenTheBundleChanges: while the API server fails calling the webhook, the
// keeper's end-to-end check retries for its window, unless the configuration stops publishing the
// bundle the pass checks (changed by hand meanwhile): then it fails at once, and the next pass (a
// change starts one) checks the new state.
func TestKeeperEndToEndStopsWhenTheBundleChanges(t *testing.T) {
	for name, live := range map[string][]byte{"bundle unchanged": []byte("checked"), "bundle changed": []byte("changed by hand")} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				cs := fake.NewClientset(&admissionregistrationv1.ValidatingWebhookConfiguration{
					ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.ConfigName},
					Webhooks:   []admissionregistrationv1.ValidatingWebhook{{Name: webhookconfig.HookName, ClientConfig: admissionregistrationv1.WebhookClientConfig{CABundle: live}}},
				})
				cs.PrependReactor("create", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, errors.New(`Internal error occurred: failed calling webhook "` + webhookconfig.HookName + `": tls: failed to verify certificate`)
				})
				w := New(Config{Image: "keeper", EndToEndWindow: 15 * time.Second}, cs, nil, io.Discard)
				w.keep, w.checking = true, []byte("checked")
				start := time.Now()
				err := w.endToEnd(context.Background())
				took := time.Since(start)
				if !errors.Is(err, ErrCallFailed) {
					t.Fatalf("endToEnd = %v, want ErrCallFailed", err)
				}
				changed := string(live) != "checked"
				if changed != strings.Contains(err.Error(), "caBundle changed during the check") || changed != (took < time.Second) {
					t.Fatalf("bundle changed=%v: endToEnd took %s: %v", changed, took, err)
				}
			})
		})
	}
}
