package install

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/berth-k8s/berth/internal/webhookconfig"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func TestConfigurationShape(t *testing.T) {
	w := installer(t, time.Now())
	cfg := w.ValidatingWebhookConfiguration([]byte("CA"), false)
	hooks, _, _ := unstructured.NestedSlice(cfg.Object, "webhooks")
	if len(hooks) != 1 {
		t.Fatalf("%d webhooks", len(hooks))
	}
	h := hooks[0].(map[string]any)
	for k, v := range map[string]any{"failurePolicy": "Fail", "sideEffects": "None", "matchPolicy": "Equivalent", "timeoutSeconds": int64(5)} {
		if h[k] != v {
			t.Errorf("%s = %v, want %v", k, h[k], v)
		}
	}
	expr, _, _ := unstructured.NestedSlice(h, "namespaceSelector", "matchExpressions")
	sel := expr[0].(map[string]any)
	if sel["key"] != "kubernetes.io/metadata.name" || sel["operator"] != "NotIn" {
		t.Fatalf("namespaceSelector = %v", sel)
	}
	for _, ns := range []string{"kube-system", "kube-node-lease", "kube-public", "berth-system"} {
		if !strings.Contains(strings.Join(toStrings(sel["values"]), ","), ns) {
			t.Errorf("namespace %s is not exempt", ns)
		}
	}
	conds, _, _ := unstructured.NestedSlice(h, "matchConditions")
	var all []string
	for _, c := range conds {
		all = append(all, c.(map[string]any)["expression"].(string))
	}
	joined := strings.Join(all, " && ")
	for _, want := range []string{"oldObject == null || !has(oldObject.metadata.deletionTimestamp)", "'nodes'", "'leases'", "'certificatesigningrequests'", "system:nodes"} {
		if !strings.Contains(joined, want) {
			t.Errorf("matchConditions lack %s: %s", want, joined)
		}
	}
	rules, _, _ := unstructured.NestedSlice(h, "rules")
	for _, r := range rules {
		ops := toStrings(r.(map[string]any)["operations"])
		if strings.Join(ops, ",") != "CREATE,UPDATE" {
			t.Errorf("rule operations %v", ops)
		}
		for _, res := range toStrings(r.(map[string]any)["resources"]) {
			if strings.HasSuffix(res, "/status") || res == "*" {
				t.Errorf("rule matches %s", res)
			}
		}
	}
	canary := w.ValidatingWebhookConfiguration([]byte("CA"), true)
	cexpr, _, _ := unstructured.NestedSlice(canary.Object, "webhooks")
	csel, _, _ := unstructured.NestedSlice(cexpr[0].(map[string]any), "namespaceSelector", "matchExpressions")
	if csel[0].(map[string]any)["operator"] != "In" || toStrings(csel[0].(map[string]any)["values"])[0] != webhookconfig.CanaryNamespace {
		t.Fatalf("canary stage selector = %v", csel)
	}
}

func toStrings(v any) []string {
	var out []string
	for _, s := range v.([]any) {
		out = append(out, s.(string))
	}
	return out
}

// TestEndToEndRetriesWithinTheWindow: while the API server cannot call the webhook, the end-to-end
// check asks again every 500 ms until its window ends and then fails in that category; once the
// webhook denies the denied canary by a rule and admits the allowed one, it passes.
func TestEndToEndRetriesWithinTheWindow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cs := fake.NewClientset()
		var at []time.Duration
		start := time.Now()
		reachable := false
		cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
			pod := a.(k8stesting.CreateAction).GetObject().(*corev1.Pod)
			if pod.Spec.Containers[0].Image != canaryDeniedImage {
				return true, pod, nil
			}
			at = append(at, time.Since(start))
			if !reachable {
				return true, nil, errors.New(`Internal error occurred: failed calling webhook "` + webhookconfig.HookName + `": connection refused`)
			}
			return true, nil, errors.New(`admission webhook "` + webhookconfig.HookName + `" denied the request: image policy rule "default-deny"`)
		})
		var out strings.Builder
		w := New(Config{Image: "x", EndToEndWindow: 2200 * time.Millisecond}, cs, nil, &out)
		if err := w.endToEnd(t.Context()); !errors.Is(err, ErrCallFailed) {
			t.Fatalf("endToEnd with an unreachable webhook = %v, want ErrCallFailed", err)
		}
		want := []time.Duration{0, 500 * time.Millisecond, time.Second, 1500 * time.Millisecond, 2 * time.Second}
		if !slices.Equal(at, want) {
			t.Errorf("attempts at %v, want %v", at, want)
		}

		reachable = true
		if err := w.endToEnd(t.Context()); err != nil {
			t.Fatalf("endToEnd with an enforcing webhook = %v", err)
		}
		if !strings.Contains(out.String(), "end-to-end check passed") {
			t.Errorf("no progress line for the passed check: %q", out.String())
		}
	})
}
