package install

import (
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
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
	if csel[0].(map[string]any)["operator"] != "In" || toStrings(csel[0].(map[string]any)["values"])[0] != CanaryNamespace {
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
