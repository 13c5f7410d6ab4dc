package berthsystem

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	admissionv1ac "k8s.io/client-go/applyconfigurations/admissionregistration/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"

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
func Guard(images []string) (*admissionv1ac.ValidatingAdmissionPolicyApplyConfiguration, *admissionv1ac.ValidatingAdmissionPolicyBindingApplyConfiguration) {
	images = slices.Compact(slices.Sorted(slices.Values(images)))
	quoted := make([]string, len(images))
	for n, img := range images {
		quoted[n] = strconv.Quote(img)
	}
	labels := map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf, "app.kubernetes.io/managed-by": "berth-bootstrapper"}
	policy := admissionv1ac.ValidatingAdmissionPolicy(GuardName).
		WithLabels(labels).
		WithSpec(admissionv1ac.ValidatingAdmissionPolicySpec().
			WithFailurePolicy(admissionv1.Fail).
			WithMatchConstraints(admissionv1ac.MatchResources().
				WithNamespaceSelector(metav1ac.LabelSelector().WithMatchLabels(map[string]string{"kubernetes.io/metadata.name": joinconfig.Namespace})).
				WithResourceRules(admissionv1ac.NamedRuleWithOperations().
					WithAPIGroups("").WithAPIVersions("v1").
					WithOperations(admissionv1.Create, admissionv1.Update).
					WithResources("pods", "pods/ephemeralcontainers"))).
			WithVariables(
				admissionv1ac.Variable().WithName("allowed").WithExpression("["+strings.Join(quoted, ", ")+"]"),
				admissionv1ac.Variable().WithName("images").WithExpression(podImages("object")),
				admissionv1ac.Variable().WithName("running").WithExpression("oldObject == null ? [] : "+podImages("oldObject")),
			).
			WithValidations(admissionv1ac.Validation().
				WithExpression("variables.images.all(i, i in variables.allowed || i in variables.running)").
				WithMessage(fmt.Sprintf("namespace %s is exempt from the image policy, so it runs only Berth's own images (%s); "+
					"policy %s enforces this", joinconfig.Namespace, strings.Join(images, ", "), GuardName)).
				WithReason(metav1.StatusReasonForbidden)))
	binding := admissionv1ac.ValidatingAdmissionPolicyBinding(GuardName).
		WithLabels(labels).
		WithSpec(admissionv1ac.ValidatingAdmissionPolicyBindingSpec().
			WithPolicyName(GuardName).
			WithValidationActions(admissionv1.Deny))
	return policy, binding
}

// podImages is a CEL expression for the images of every container of the pod o (object or oldObject).
func podImages(o string) string {
	return o + ".spec.containers.map(c, c.image)" +
		" + (has(" + o + ".spec.initContainers) ? " + o + ".spec.initContainers.map(c, c.image) : [])" +
		" + (has(" + o + ".spec.ephemeralContainers) ? " + o + ".spec.ephemeralContainers.map(c, c.image) : [])"
}
