// Package berthsystem builds the objects Berth keeps in its berth-system namespace: the namespace
// itself and its image guard, the cluster Secret, the join ConfigMap, and the joinservice with its
// ServiceAccount, RBAC and DaemonSet. The names, ports and data encodings are joinconfig's; this
// package only assembles them into objects, so the bootstrapper installs exactly what a test harness
// installs.
//
// Every object is built with client-go's typed apply configurations
// (k8s.io/client-go/applyconfigurations) and handed out as the unstructured objects internal/apply
// applies.
package berthsystem

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// ErrNoJoinServiceImage is returned when Config names no joinservice image.
var ErrNoJoinServiceImage = errors.New("no joinservice image configured")

const (
	controlPlaneLabel = "node-role.kubernetes.io/control-plane"
	// joinServiceRole names the joinservice's Role and RoleBinding.
	joinServiceRole = "berth:joinservice"
	// csrApproverRole names the ClusterRole and binding of the joinservice's kubelet serving CSR
	// approver.
	csrApproverRole = "berth:joinservice:kubelet-serving-approver"
	pkiDir          = "/etc/kubernetes/pki"
	partOfLabel     = "app.kubernetes.io/part-of"
	nameLabel       = "app.kubernetes.io/name"
)

// Config is how the components are deployed.
type Config struct {
	// JoinServiceImage is the joinservice's container image.
	JoinServiceImage string
	// ImagePullPolicy for Berth's images; empty means IfNotPresent ("Never" when images are
	// pre-imported).
	ImagePullPolicy string
	// JoinServiceEnv is passed to the joinservice container (metadata provider, attestation variant).
	JoinServiceEnv map[string]string
	// JoinServiceHostPaths are host paths (the TPM's socket directory or device) mounted into the
	// joinservice at the same path, so it can attest with its node's TPM.
	JoinServiceHostPaths []string
	// GuardImages are the images besides the joinservice's that may run in berth-system (the webhook's).
	GuardImages []string
}

// Cluster is what init decided about the cluster.
type Cluster struct {
	Secrets joinconfig.ClusterSecrets
	Join    joinconfig.Config
}

// Objects returns every object of berth-system in the order they must be applied: the namespace, its
// guard, the cluster Secret, the join ConfigMap, then the joinservice.
func Objects(cfg Config, c Cluster) ([]*unstructured.Unstructured, error) {
	if cfg.JoinServiceImage == "" {
		return nil, ErrNoJoinServiceImage
	}
	policy, binding := Guard(append([]string{cfg.JoinServiceImage}, cfg.GuardImages...))
	typed := []any{Namespace(), policy, binding}
	typed = append(typed, clusterData(c)...)
	typed = append(typed, joinService(cfg)...)
	out := make([]*unstructured.Unstructured, len(typed))
	for n, ac := range typed {
		obj, err := apply.Unstructured(ac)
		if err != nil {
			return nil, fmt.Errorf("building berth-system's objects: %w", err)
		}
		out[n] = obj
	}
	return out, nil
}

// Namespace returns the berth-system namespace.
func Namespace() *corev1ac.NamespaceApplyConfiguration {
	return corev1ac.Namespace(joinconfig.Namespace).WithLabels(map[string]string{partOfLabel: "berth"})
}

// clusterData returns the cluster Secret and the join ConfigMap.
func clusterData(c Cluster) []any {
	return []any{
		corev1ac.Secret(joinconfig.SecretName, joinconfig.Namespace).
			WithType(corev1.SecretTypeOpaque).
			WithData(c.Secrets.Data()),
		corev1ac.ConfigMap(joinconfig.JoinConfigName, joinconfig.Namespace).
			WithData(c.Join.Data()),
	}
}

// joinService returns the joinservice's ServiceAccount, Role, RoleBinding and DaemonSet.
func joinService(cfg Config) []any {
	ns := joinconfig.Namespace
	return []any{
		corev1ac.ServiceAccount(joinconfig.ServiceAccountName, ns),
		// Everything the joinservice touches is in berth-system: a Role, not a ClusterRole.
		rbacv1ac.Role(joinServiceRole, ns).WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("secrets").
				WithResourceNames(joinconfig.SecretName).WithVerbs("get"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithVerbs("get", "list", "watch", "create"),
			// The join ledger is the one ConfigMap the joinservice rewrites.
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.JoinLedgerName).WithVerbs("update"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("events").WithVerbs("create", "patch"),
			rbacv1ac.PolicyRule().WithAPIGroups("coordination.k8s.io").WithResources("leases").
				WithVerbs("create", "get", "update", "delete"),
		),
		rbacv1ac.RoleBinding(joinServiceRole, ns).
			WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup("rbac.authorization.k8s.io").WithKind("Role").WithName(joinServiceRole)).
			WithSubjects(rbacv1ac.Subject().WithKind("ServiceAccount").WithName(joinconfig.ServiceAccountName).WithNamespace(ns)),
		// The certificate keeper's kubelet serving CSR approver (joinservice/certkeeper): it reads
		// the kubelet serving requests and Nodes, and approves or denies for that signer only.
		rbacv1ac.ClusterRole(csrApproverRole).WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups("certificates.k8s.io").WithResources("certificatesigningrequests").
				WithVerbs("get", "list", "watch"),
			rbacv1ac.PolicyRule().WithAPIGroups("certificates.k8s.io").WithResources("certificatesigningrequests/approval").
				WithVerbs("update"),
			rbacv1ac.PolicyRule().WithAPIGroups("certificates.k8s.io").WithResources("signers").
				WithResourceNames(certificatesv1.KubeletServingSignerName).WithVerbs("approve"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("nodes").WithVerbs("get"),
		),
		rbacv1ac.ClusterRoleBinding(csrApproverRole).
			WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup("rbac.authorization.k8s.io").WithKind("ClusterRole").WithName(csrApproverRole)).
			WithSubjects(rbacv1ac.Subject().WithKind("ServiceAccount").WithName(joinconfig.ServiceAccountName).WithNamespace(ns)),
		joinServiceDaemonSet(cfg),
	}
}

// joinServiceDaemonSet returns the joinservice's DaemonSet: one pod on every control plane, on the
// host's network, with the kubeadm PKI and the node's TPM.
func joinServiceDaemonSet(cfg Config) *appsv1ac.DaemonSetApplyConfiguration {
	pull := corev1.PullPolicy(cfg.ImagePullPolicy)
	if pull == "" {
		pull = corev1.PullIfNotPresent
	}
	env := []*corev1ac.EnvVarApplyConfiguration{
		fieldEnv("NODE_NAME", "spec.nodeName"),
		fieldEnv("HOST_IP", "status.hostIP"),
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.JoinServiceEnv)) {
		env = append(env, corev1ac.EnvVar().WithName(k).WithValue(cfg.JoinServiceEnv[k]))
	}
	labels := map[string]string{nameLabel: joinconfig.JoinServiceName, partOfLabel: "berth"}
	mounts := []*corev1ac.VolumeMountApplyConfiguration{
		corev1ac.VolumeMount().WithName("pki").WithMountPath(pkiDir).WithReadOnly(true),
	}
	volumes := []*corev1ac.VolumeApplyConfiguration{
		corev1ac.Volume().WithName("pki").WithHostPath(corev1ac.HostPathVolumeSource().WithPath(pkiDir).WithType(corev1.HostPathDirectory)),
	}
	privileged := false
	for n, p := range cfg.JoinServiceHostPaths {
		name := fmt.Sprintf("host-%d", n)
		mounts = append(mounts, corev1ac.VolumeMount().WithName(name).WithMountPath(p))
		volumes = append(volumes, corev1ac.Volume().WithName(name).WithHostPath(corev1ac.HostPathVolumeSource().WithPath(p)))
		if strings.HasPrefix(p, "/dev/") {
			privileged = true // a TPM character device needs device access
		}
	}
	container := corev1ac.Container().
		WithName("joinservice").
		WithImage(cfg.JoinServiceImage).
		WithImagePullPolicy(pull).
		WithArgs(
			fmt.Sprintf("--listen=:%d", joinconfig.JoinPort),
			"--pki-dir="+pkiDir,
			// Metrics and probes on the node's own address, not every interface.
			fmt.Sprintf("--metrics-listen=$(HOST_IP):%d", joinconfig.MetricsPort),
		).
		WithPorts(
			corev1ac.ContainerPort().WithName("join").WithContainerPort(joinconfig.JoinPort).WithProtocol(corev1.ProtocolTCP),
			corev1ac.ContainerPort().WithName("metrics").WithContainerPort(joinconfig.MetricsPort).WithProtocol(corev1.ProtocolTCP),
		).
		WithLivenessProbe(corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/livez").WithPort(intstr.FromInt32(joinconfig.MetricsPort))).
			WithPeriodSeconds(10).WithFailureThreshold(6)).
		WithReadinessProbe(corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath("/readyz").WithPort(intstr.FromInt32(joinconfig.MetricsPort))).
			WithPeriodSeconds(5)).
		WithEnv(env...).
		WithVolumeMounts(mounts...).
		WithSecurityContext(corev1ac.SecurityContext().WithPrivileged(privileged))
	return appsv1ac.DaemonSet(joinconfig.JoinServiceName, joinconfig.Namespace).
		WithLabels(labels).
		WithSpec(appsv1ac.DaemonSetSpec().
			WithSelector(metav1ac.LabelSelector().WithMatchLabels(map[string]string{nameLabel: joinconfig.JoinServiceName})).
			WithTemplate(corev1ac.PodTemplateSpec().
				WithLabels(labels).
				WithSpec(corev1ac.PodSpec().
					WithServiceAccountName(joinconfig.ServiceAccountName).
					WithHostNetwork(true).
					WithPriorityClassName("system-cluster-critical").
					WithNodeSelector(map[string]string{controlPlaneLabel: ""}).
					WithTolerations(corev1ac.Toleration().WithOperator(corev1.TolerationOpExists)).
					WithContainers(container).
					WithVolumes(volumes...))))
}

// fieldEnv is an environment variable set from a field of the pod.
func fieldEnv(name, fieldPath string) *corev1ac.EnvVarApplyConfiguration {
	return corev1ac.EnvVar().WithName(name).
		WithValueFrom(corev1ac.EnvVarSource().WithFieldRef(corev1ac.ObjectFieldSelector().WithFieldPath(fieldPath)))
}
