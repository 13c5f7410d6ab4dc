package berthsystem

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// GuardName names the ValidatingAdmissionPolicy (and its binding) that keeps berth-system to Berth's
// own images.
const GuardName = "berth-system-images"

// Guard returns the policy and binding that lock berth-system down to images. The image-policy
// webhook exempts that namespace so that its own pods can always start; without a guard, anyone
// allowed to create a pod there could run any image past the webhook. The guard is a
// ValidatingAdmissionPolicy: the API server evaluates its CEL itself, so it needs no backend and can
// never hold up a restart. A pod may only bring in images from the list; images a pod already runs
// stay allowed on UPDATE, so finalizers and labels of older pods can always be changed. Deleting the
// binding is the documented break-glass.
func Guard(images []string) []map[string]any {
	images = slices.Compact(slices.Sorted(slices.Values(images)))
	quoted := make([]string, len(images))
	for n, img := range images {
		quoted[n] = strconv.Quote(img)
	}
	podImages := func(o string) string {
		return o + ".spec.containers.map(c, c.image)" +
			" + (has(" + o + ".spec.initContainers) ? " + o + ".spec.initContainers.map(c, c.image) : [])" +
			" + (has(" + o + ".spec.ephemeralContainers) ? " + o + ".spec.ephemeralContainers.map(c, c.image) : [])"
	}
	labels := map[string]any{"app.kubernetes.io/part-of": "berth", "app.kubernetes.io/managed-by": "berth-bootstrapper"}
	return []map[string]any{
		{
			"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
			"metadata": map[string]any{"name": GuardName, "labels": labels},
			"spec": map[string]any{
				"failurePolicy": "Fail",
				"matchConstraints": map[string]any{
					"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": joinconfig.Namespace}},
					"resourceRules": []any{map[string]any{
						"apiGroups": []any{""}, "apiVersions": []any{"v1"},
						"operations": []any{"CREATE", "UPDATE"},
						"resources":  []any{"pods", "pods/ephemeralcontainers"},
					}},
				},
				"variables": []any{
					map[string]any{"name": "allowed", "expression": "[" + strings.Join(quoted, ", ") + "]"},
					map[string]any{"name": "images", "expression": podImages("object")},
					map[string]any{"name": "running", "expression": "oldObject == null ? [] : " + podImages("oldObject")},
				},
				"validations": []any{map[string]any{
					"expression": "variables.images.all(i, i in variables.allowed || i in variables.running)",
					"message": fmt.Sprintf("namespace %s is exempt from the image policy, so it runs only Berth's own images (%s); "+
						"policy %s enforces this", joinconfig.Namespace, strings.Join(images, ", "), GuardName),
					"reason": "Forbidden",
				}},
			},
		},
		{
			"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
			"metadata": map[string]any{"name": GuardName, "labels": labels},
			"spec": map[string]any{
				"policyName":        GuardName,
				"validationActions": []any{"Deny"},
			},
		},
	}
}
