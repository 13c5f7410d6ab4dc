package apiservertest

import (
	"bytes"
	"context"
	"fmt"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// The cluster InstallBerth installs: fixed secrets, so that tests can derive what the joinservice
// derives (ClusterID), and a control-plane endpoint from a documentation range.
const (
	installKubernetesVersion = "v1.34.2"
	installEndpoint          = "198.51.100.10:6443"
	installJoinServiceImage  = "berth/joinservice:test"
)

var (
	installMasterSecret = bytes.Repeat([]byte{1}, 32)
	installSalt         = bytes.Repeat([]byte{2}, 32)
)

// joinServiceGroups are the groups the API server gives JoinServiceUser: its token's (writeTokens)
// and system:authenticated, which it adds to every authenticated user.
var joinServiceGroups = []string{"system:serviceaccounts", "system:serviceaccounts:" + joinconfig.Namespace, "system:authenticated"}

// rbacSettleTimeout bounds the wait for the RBAC InstallBerth applies to take effect.
const rbacSettleTimeout = 30 * time.Second

// ClusterID is the ID of the cluster InstallBerth installs, which a joinservice bound to that cluster
// holds in its TPM's lock register.
func ClusterID() []byte { return ClusterKeys().ClusterID() }

// ClusterKeys are the keys of the cluster InstallBerth installs (its cluster Secret's master secret
// and salt).
func ClusterKeys() *clusterkeys.Keys {
	keys, err := clusterkeys.New(installMasterSecret, installSalt)
	if err != nil {
		panic(fmt.Sprintf("deriving the test cluster's keys: %v", err)) // fixed, valid input
	}
	return keys
}

// InstallBerth applies, as the admin, what berth init installs in berth-system
// (internal/berthsystem: the namespace and its image guard, the cluster Secret, the join ConfigMap
// with policyYAML, the joinservice's ServiceAccount, RBAC and DaemonSet). Nothing runs the DaemonSet:
// there are no nodes. It returns once the API server authorizes the joinservice by the RBAC it
// applied, so callers may act as JoinServiceUser at once.
func (e *Env) InstallBerth(ctx context.Context, policyYAML string) error {
	applier, err := apply.NewForConfig(e.Config(AdminUser))
	if err != nil {
		return err
	}
	objs, err := berthsystem.Objects(berthsystem.Config{JoinServiceImage: installJoinServiceImage, ImagePullPolicy: "Never"},
		berthsystem.Cluster{
			Secrets: joinconfig.ClusterSecrets{MasterSecret: installMasterSecret, Salt: installSalt},
			Join: joinconfig.Config{
				AttestationPolicy: []byte(policyYAML),
				MeasurementSalt:   installSalt,
				ClusterID:         ClusterID(),
				KubernetesVersion: installKubernetesVersion,
				APIServerEndpoint: installEndpoint,
			},
		})
	if err != nil {
		return fmt.Errorf("building berth-system's objects: %w", err)
	}
	if err := applier.Apply(ctx, objs...); err != nil {
		return fmt.Errorf("applying berth-system's objects: %w", err)
	}
	return e.waitJoinServiceRBAC(ctx)
}

// waitJoinServiceRBAC waits until the API server allows JoinServiceUser one thing each binding
// InstallBerth applies grants (and no other does): the RBAC authorizer learns of new bindings and
// roles through informers, so for a moment after they are written the joinservice is refused.
func (e *Env) waitJoinServiceRBAC(ctx context.Context) error {
	admin, err := kubernetes.NewForConfig(e.Config(AdminUser))
	if err != nil {
		return err
	}
	checks := []struct {
		binding string
		attrs   authorizationv1.ResourceAttributes
	}{
		{"the joinservice's RoleBinding", authorizationv1.ResourceAttributes{
			Namespace: joinconfig.Namespace, Verb: "get", Resource: "secrets", Name: joinconfig.SecretName}},
		{"the CSR approver's ClusterRoleBinding", authorizationv1.ResourceAttributes{
			Verb: "list", Group: "certificates.k8s.io", Resource: "certificatesigningrequests"}},
		// The approver's ClusterRole may only get nodes.
		{"the webhook spread's ClusterRoleBinding", authorizationv1.ResourceAttributes{
			Verb: "list", Resource: "nodes"}},
	}
	for _, c := range checks {
		last := "no review yet"
		a := c.attrs
		what := a.Verb + " " + a.Resource
		if a.Group != "" {
			what += "." + a.Group
		}
		if a.Name != "" {
			what += " " + a.Name
		}
		if a.Namespace != "" {
			what += " in " + a.Namespace
		}
		if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, rbacSettleTimeout, true, func(ctx context.Context) (bool, error) {
			review, err := admin.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
				Spec: authorizationv1.SubjectAccessReviewSpec{ResourceAttributes: &a, User: JoinServiceUser, Groups: joinServiceGroups},
			}, metav1.CreateOptions{})
			if err != nil {
				last = err.Error()
				return false, nil
			}
			last = fmt.Sprintf("allowed %v, reason %q, evaluation error %q", review.Status.Allowed, review.Status.Reason, review.Status.EvaluationError)
			return review.Status.Allowed, nil
		}); err != nil {
			return fmt.Errorf("%s did not take effect: %s may not %s (last review: %s): %w", c.binding, JoinServiceUser, what, last, err)
		}
	}
	return nil
}
