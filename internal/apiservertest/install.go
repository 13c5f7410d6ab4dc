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
	"github.com/berth-k8s/berth/internal/k8sversion"
)

// The cluster InstallBerth installs: fixed secrets, so that tests can derive what the joinservice
// derives (ClusterID), and a control-plane endpoint from a documentation range.
const (
	installEndpoint         = "198.51.100.10:6443"
	installJoinServiceImage = "berth/joinservice:test"
)

var (
	installMasterSecret = bytes.Repeat([]byte{1}, 32)
	installSalt         = bytes.Repeat([]byte{2}, 32)
)

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
				KubernetesVersion: k8sversion.Default().Kubernetes,
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
// InstallBerth applies grants (and no other does).
func (e *Env) waitJoinServiceRBAC(ctx context.Context) error {
	js, err := kubernetes.NewForConfig(e.Config(JoinServiceUser))
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
		if err := WaitAllowed(ctx, js, c.attrs); err != nil {
			return fmt.Errorf("%s did not take effect: %s: %w", c.binding, JoinServiceUser, err)
		}
	}
	return nil
}

// WaitAllowed waits (up to rbacSettleTimeout) until the API server authorizes client's own user for
// attrs: the RBAC authorizer learns of new roles and bindings through informers, so for a moment
// after they are written their subjects are still refused.
func WaitAllowed(ctx context.Context, client kubernetes.Interface, attrs authorizationv1.ResourceAttributes) error {
	last := "no review yet"
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, rbacSettleTimeout, true, func(ctx context.Context) (bool, error) {
		review, err := client.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
			Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &attrs},
		}, metav1.CreateOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		last = fmt.Sprintf("allowed %v, reason %q, evaluation error %q", review.Status.Allowed, review.Status.Reason, review.Status.EvaluationError)
		return review.Status.Allowed, nil
	})
	if err != nil {
		what := attrs.Verb + " " + attrs.Resource
		if attrs.Group != "" {
			what += "." + attrs.Group
		}
		if attrs.Name != "" {
			what += " " + attrs.Name
		}
		if attrs.Namespace != "" {
			what += " in " + attrs.Namespace
		}
		return fmt.Errorf("may not %s (last review: %s): %w", what, last, err)
	}
	return nil
}
