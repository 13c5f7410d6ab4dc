package apiservertest

import (
	"bytes"
	"context"
	"fmt"

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
// there are no nodes.
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
	return nil
}
