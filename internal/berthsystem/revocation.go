package berthsystem

import (
	"strconv"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	admissionv1ac "k8s.io/client-go/applyconfigurations/admissionregistration/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// RevocationName names the ValidatingAdmissionPolicy (and its binding) that refuses every write of
// a removed node's credentials.
const RevocationName = "berth-node-revocation"

// NodeUserPrefix is the user name prefix of a kubelet's credentials (system:node:NAME).
const NodeUserPrefix = "system:node:"

// Revocation returns the policy and binding that make the API server refuse every create, update
// (and patch) and delete made with the credentials of a node whose machine `berth node remove`
// revoked: the Node's registration, its status and Lease, pod status, Events, certificate signing
// requests (so its client certificate is never renewed) and ServiceAccount tokens.
//
// The list of revoked node names is the key joinconfig.MachinesRevokedNodesKey of the machine record (internal/machines),
// ConfigMap berth-system/berth-machines, the policy's parameter: every writer of the record writes
// the list in the same write as the record, so `berth node remove` revokes at the API server in the
// same step that makes the joinservice refuse the machine, and `berth node readmit` lifts both. The
// API server watches the parameter, so a change takes effect on every API server within seconds.
//
// Like the image guard it is a ValidatingAdmissionPolicy: the API server evaluates its CEL itself,
// so no backend can be down or deadlock a restart. A match condition limits it to node credentials;
// a missing parameter (a cluster whose record was never written) revokes nothing. Reads are not
// admission's business: `berth node remove` deletes the Node and every pod bound to it, after which
// the API server's Node authorizer lets that node's credentials read no Secret, ConfigMap or volume
// claim at all. Deleting the binding is the break-glass.
func Revocation() (*admissionv1ac.ValidatingAdmissionPolicyApplyConfiguration, *admissionv1ac.ValidatingAdmissionPolicyBindingApplyConfiguration) {
	labels := map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf, "app.kubernetes.io/managed-by": "berth-bootstrapper"}
	listed := "has(params.data) && '" + joinconfig.MachinesRevokedNodesKey + "' in params.data && " +
		"variables.node in params.data['" + joinconfig.MachinesRevokedNodesKey + "'].split(' ')"
	policy := admissionv1ac.ValidatingAdmissionPolicy(RevocationName).
		WithLabels(labels).
		WithSpec(admissionv1ac.ValidatingAdmissionPolicySpec().
			WithFailurePolicy(admissionv1.Fail).
			WithParamKind(admissionv1ac.ParamKind().WithAPIVersion("v1").WithKind("ConfigMap")).
			WithMatchConstraints(admissionv1ac.MatchResources().
				WithResourceRules(admissionv1ac.NamedRuleWithOperations().
					WithAPIGroups("*").WithAPIVersions("*").
					WithOperations(admissionv1.Create, admissionv1.Update, admissionv1.Delete).
					WithResources("*/*").
					WithScope(admissionv1.AllScopes))).
			WithMatchConditions(admissionv1ac.MatchCondition().
				WithName("node-credentials").
				WithExpression("request.userInfo.username.startsWith('" + NodeUserPrefix + "')")).
			WithVariables(admissionv1ac.Variable().WithName("node").
				WithExpression("request.userInfo.username.substring(" + strconv.Itoa(len(NodeUserPrefix)) + ")")).
			WithValidations(admissionv1ac.Validation().
				WithExpression("!(" + listed + ")").
				WithMessageExpression("'node ' + variables.node + ' was removed from the cluster (berth node remove): " +
					"the API server refuses every write of its credentials until berth node readmit " + "(policy " + RevocationName + ")'").
				WithReason(metav1.StatusReasonForbidden)))
	binding := admissionv1ac.ValidatingAdmissionPolicyBinding(RevocationName).
		WithLabels(labels).
		WithSpec(admissionv1ac.ValidatingAdmissionPolicyBindingSpec().
			WithPolicyName(RevocationName).
			WithParamRef(admissionv1ac.ParamRef().
				WithName(joinconfig.MachinesName).
				WithNamespace(joinconfig.Namespace).
				WithParameterNotFoundAction(admissionv1.AllowAction)).
			WithValidationActions(admissionv1.Deny))
	return policy, binding
}
