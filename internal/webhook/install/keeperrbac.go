package install

import (
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// KeeperRole names the Roles, the ClusterRole and their bindings that let the keeper (run by the
// joinservice's certificate keeper, as the joinservice's ServiceAccount) do exactly what Keeper.Check
// does: read and update the TLS Secret, read the policy and the certificate settings, find and
// probe the endpoints, create dry-run canary pods, and read and update the configuration.
const KeeperRole = "berth:webhook-keeper"

// keeperRBAC returns the keeper's Roles, ClusterRole and bindings, bound to the joinservice's
// ServiceAccount.
func keeperRBAC() []*unstructured.Unstructured {
	subject := rbacv1ac.Subject().WithKind("ServiceAccount").WithName(joinconfig.ServiceAccountName).WithNamespace(namespace)
	roleRef := func(kind string) *rbacv1ac.RoleRefApplyConfiguration {
		return rbacv1ac.RoleRef().WithAPIGroup("rbac.authorization.k8s.io").WithKind(kind).WithName(KeeperRole)
	}
	rule := func(group string, resources, names []string, verbs ...string) *rbacv1ac.PolicyRuleApplyConfiguration {
		r := rbacv1ac.PolicyRule().WithAPIGroups(group).WithResources(resources...).WithVerbs(verbs...)
		if len(names) > 0 {
			r = r.WithResourceNames(names...)
		}
		return r
	}
	return []*unstructured.Unstructured{
		typed(rbacv1ac.Role(KeeperRole, namespace).WithLabels(ownLabels()).WithRules(
			rule("", []string{"secrets"}, []string{webhookconfig.TLSSecret}, "get", "update"),
			rule("", []string{"configmaps"}, []string{webhookconfig.PolicyConfigMap, webhookconfig.CertificatesConfigMap}, "get"),
			rule("", []string{"services"}, []string{webhookconfig.Name}, "get"),
			rule("discovery.k8s.io", []string{"endpointslices"}, nil, "list"),
		)),
		typed(rbacv1ac.RoleBinding(KeeperRole, namespace).WithLabels(ownLabels()).WithRoleRef(roleRef("Role")).WithSubjects(subject)),
		// The end-to-end check: server-side dry-run creates of canary pods (a dry run needs create).
		typed(rbacv1ac.Role(KeeperRole, webhookconfig.CanaryNamespace).WithLabels(ownLabels()).WithRules(
			rule("", []string{"pods"}, nil, "create"),
		)),
		typed(rbacv1ac.RoleBinding(KeeperRole, webhookconfig.CanaryNamespace).WithLabels(ownLabels()).WithRoleRef(roleRef("Role")).WithSubjects(subject)),
		typed(rbacv1ac.ClusterRole(KeeperRole).WithLabels(ownLabels()).WithRules(
			rule("admissionregistration.k8s.io", []string{"validatingwebhookconfigurations"}, []string{webhookconfig.ConfigName}, "get", "list", "watch", "update"),
		)),
		typed(rbacv1ac.ClusterRoleBinding(KeeperRole).WithLabels(ownLabels()).WithRoleRef(roleRef("ClusterRole")).WithSubjects(subject)),
	}
}
