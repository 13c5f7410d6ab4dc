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
	"path"
	"slices"
	"strings"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	coordinationv1ac "k8s.io/client-go/applyconfigurations/coordination/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// ErrNoJoinServiceImage is returned when Config names no joinservice image.
var ErrNoJoinServiceImage = errors.New("no joinservice image configured")

const (
	controlPlaneLabel = "node-role.kubernetes.io/control-plane"
	// joinServiceRole names the joinservice's Role and RoleBinding.
	joinServiceRole = "berth:joinservice"
	// clusterConfigRole names the joinservice's Role and RoleBinding in the cluster configuration's
	// namespace.
	clusterConfigRole = "berth:joinservice:cluster-config"
	// csrApproverRole names the ClusterRole and binding of the joinservice's kubelet serving CSR
	// approver.
	csrApproverRole = "berth:joinservice:kubelet-serving-approver"
	// spreadRole names the ClusterRole and binding that let the joinservice see which nodes could
	// run the webhook (joinservice/spread).
	spreadRole = "berth:joinservice:webhook-spread"
	pkiDir     = "/etc/kubernetes/pki"
	// envHostIP is the joinservice's node address (status.hostIP), for its --metrics-listen.
	envHostIP = "HOST_IP"
)

// The joinservice's resources: it idles at a few MiB and a join costs a few milliseconds of CPU;
// under a flood of joins its memory stays bounded by its rate limits. Its CPU is limited too
// (JoinServiceCPUs): it shares the control plane with kube-apiserver and etcd, and a flood from the
// network must not take their CPU. One core carries its rate limits with room to spare (its load
// test and the attack suite run it with as many cores; Go sizes GOMAXPROCS to the limit).
const (
	joinServiceCPURequest    = "50m"
	joinServiceMemoryRequest = "64Mi"
)

// JoinServiceCPUs is the joinservice's CPU limit, in cores.
const JoinServiceCPUs = 1

// JoinServiceMemoryLimitBytes is the joinservice's memory limit (512 MiB).
const JoinServiceMemoryLimitBytes = 512 << 20

// Config is how the components are deployed.
type Config struct {
	// JoinServiceImage is the joinservice's container image.
	JoinServiceImage string
	// ImagePullPolicy for Berth's images; empty means IfNotPresent ("Never" when images are
	// pre-imported).
	ImagePullPolicy string
	// JoinServiceEnv is passed to the joinservice container (metadata provider, attestation variant).
	// Its BERTH_ATTESTATION is the control plane's attestation variant, which decides what else the
	// joinservice gets (see JoinServiceDaemonSet); on tdx, BERTH_TPM is left out.
	JoinServiceEnv map[string]string
	// JoinServiceHostPaths are host paths (the TPM's socket directory or device) mounted into the
	// joinservice at the same path, so it can attest with its node's TPM. A TDX control plane's
	// joinservice gets none of them.
	JoinServiceHostPaths []string
	// TDXGuest is the TD guest interface a TDX control plane's joinservice quotes through; empty means
	// TDXConfigfsTSM. Setting it for another variant is an error.
	TDXGuest TDXGuestInterface
	// GuardImages are the images besides the joinservice's that may run in berth-system (the webhook's).
	GuardImages []string
}

// Cluster is what init decided about the cluster.
type Cluster struct {
	Secrets joinconfig.ClusterSecrets
	Join    joinconfig.Config
}

// Objects returns every object Berth keeps in berth-system, in the order they must be applied: the
// namespace with its Pod Security labels, the RuntimeClass of the joinservice's pods, the image guard,
// the RuntimeClass guard and the revocation policy of removed nodes, the cluster Secret, the join
// ConfigMap, the CustomResourceDefinitions of the record API (internal/records), the join ledger and the
// control-plane slot's Lease (created here, so that the joinservice needs no right to create
// ConfigMaps or Leases), then the joinservice. It fails when the control plane's attestation variant
// and the attestation policy's differ (ErrMixedVariants) or the DaemonSet cannot be built for the variant.
func Objects(cfg Config, c Cluster) ([]*unstructured.Unstructured, error) {
	if cfg.JoinServiceImage == "" {
		return nil, ErrNoJoinServiceImage
	}
	policy, binding := Guard(append([]string{cfg.JoinServiceImage}, cfg.GuardImages...))
	hostPolicy, hostBinding := HostRuntimeGuard(cfg.JoinServiceImage)
	ds, err := JoinServiceDaemonSet(cfg, c.Join.AttestationPolicy)
	if err != nil {
		return nil, fmt.Errorf("building berth-system's objects: %w", err)
	}
	revocation, revocationBinding := Revocation()
	typed := []any{Namespace(c.Join.KubernetesVersion), RuntimeClass(), policy, binding, hostPolicy, hostBinding, revocation, revocationBinding}
	typed = append(typed, clusterData(c)...)
	for _, crd := range records.CRDs() {
		typed = append(typed, crd)
	}
	typed = append(typed, joinService(ds)...)
	out := make([]*unstructured.Unstructured, len(typed))
	for n, ac := range typed {
		obj, err := apply.Unstructured(ac)
		if err != nil {
			return nil, fmt.Errorf("building berth-system's objects: %w", err)
		}
		// A CustomResourceDefinition built as a typed object carries an empty status, which is the
		// API server's to write.
		unstructured.RemoveNestedField(obj.Object, "status")
		unstructured.RemoveNestedField(obj.Object, "metadata", "creationTimestamp")
		out[n] = obj
	}
	return out, nil
}

// Namespace returns the berth-system namespace of a cluster of kubernetesVersion, enforcing the Pod
// Security Standard "restricted" of that version (see podsecurity.go).
func Namespace(kubernetesVersion string) *corev1ac.NamespaceApplyConfiguration {
	labels := podSecurityLabels(kubernetesVersion)
	labels[joinconfig.PartOfLabel] = joinconfig.PartOf
	return corev1ac.Namespace(joinconfig.Namespace).WithLabels(labels)
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

// joinService returns the objects the joinservice writes to (the join ledger, empty, and the
// control-plane slot's and the certificate keeper's Leases, unheld), its ServiceAccount, Role, RoleBinding and DaemonSet. Applying
// them again leaves what the joinservice wrote: the applier owns no field of the ledger's data or
// the Lease's spec.
func joinService(ds *appsv1ac.DaemonSetApplyConfiguration) []any {
	ns := joinconfig.Namespace
	joinServiceLabels := map[string]string{joinconfig.NameLabel: joinconfig.JoinServiceName, joinconfig.PartOfLabel: joinconfig.PartOf}
	return []any{
		corev1ac.ConfigMap(joinconfig.JoinLedgerName, ns).WithLabels(joinServiceLabels),
		corev1ac.ConfigMap(joinconfig.MachinesName, ns).WithLabels(joinServiceLabels),
		coordinationv1ac.Lease(joinconfig.ControlPlaneSlotLease, ns).WithLabels(joinServiceLabels),
		coordinationv1ac.Lease(joinconfig.CertKeeperLease, ns).WithLabels(joinServiceLabels),
		corev1ac.ConfigMap(joinconfig.BackupName, ns).WithLabels(joinServiceLabels),
		coordinationv1ac.Lease(joinconfig.BackupName, ns).WithLabels(joinServiceLabels),
		corev1ac.ServiceAccount(joinconfig.ServiceAccountName, ns),
		// Everything the joinservice writes is in berth-system: a Role, not a ClusterRole, and in it
		// only the objects it reads or writes, by name. Creating cannot be limited to a name, so the
		// ledger and the Lease are created with the joinservice (above), and the joinservice creates
		// nothing but Events and the record API's objects.
		rbacv1ac.Role(joinServiceRole, ns).WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("secrets").
				WithResourceNames(joinconfig.SecretName).WithVerbs("get"),
			// The object store of the etcd snapshots, when the operator named one (internal/backup).
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("secrets").
				WithResourceNames(joinconfig.BackupStoreSecretName).WithVerbs("get"),
			// The backup schedule's status, and the requests of berth backup now in it.
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.BackupName).WithVerbs("get", "patch"),
			// The policy watcher lists and watches the join ConfigMap by name (a metadata.name field
			// selector, which RBAC checks against resourceNames).
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.JoinConfigName).WithVerbs("get", "list", "watch"),
			// The join ledger and the machine record are the ConfigMaps the joinservice rewrites; it
			// watches the machine record by name (joinservice/registry).
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.JoinLedgerName).WithVerbs("get", "update"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.MachinesName).WithVerbs("get", "list", "watch", "update"),
			// The control planes' KMS key spec, which control-plane join tickets carry.
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.KMSConfigName).WithVerbs("get"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("events").WithVerbs("create", "patch"),
			rbacv1ac.PolicyRule().WithAPIGroups("events.k8s.io").WithResources("events").WithVerbs("create", "patch"),
			// The record API: one Machine per admitted machine and one JoinRecord per refused machine or
			// peer and reason, so the joinservice creates them (records.ClassQuota bounds the
			// JoinRecords) and deletes the ones past their retention.
			rbacv1ac.PolicyRule().WithAPIGroups(records.Group).WithResources(records.MachinePlural, records.JoinRecordPlural).
				WithVerbs("get", "list", "watch", "create", "update", "patch", "delete"),
			// The control-plane slot (internal/cpslot), which every replica watches for joins to end,
			// and the certificate keeper's leader election.
			rbacv1ac.PolicyRule().WithAPIGroups("coordination.k8s.io").WithResources("leases").
				WithResourceNames(joinconfig.ControlPlaneSlotLease).WithVerbs("get", "list", "watch", "update"),
			rbacv1ac.PolicyRule().WithAPIGroups("coordination.k8s.io").WithResources("leases").
				WithResourceNames(joinconfig.CertKeeperLease).WithVerbs("get", "update"),
			rbacv1ac.PolicyRule().WithAPIGroups("coordination.k8s.io").WithResources("leases").
				WithResourceNames(joinconfig.BackupName).WithVerbs("get", "update"),
			// It keeps the webhook's replicas on different nodes (joinservice/spread): it reads the
			// Deployment and its pods and evicts one (the webhook's disruption budget decides).
			rbacv1ac.PolicyRule().WithAPIGroups("apps").WithResources("deployments").
				WithResourceNames(webhookconfig.Name).WithVerbs("get"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("pods").WithVerbs("get", "list"),
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("pods/eviction").WithVerbs("create"),
		),
		rbacv1ac.RoleBinding(joinServiceRole, ns).
			WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup("rbac.authorization.k8s.io").WithKind("Role").WithName(joinServiceRole)).
			WithSubjects(rbacv1ac.Subject().WithKind("ServiceAccount").WithName(joinconfig.ServiceAccountName).WithNamespace(ns)),
		// The configuration in force, whose files (admission configuration, audit policy, kubeadm
		// patches) a control-plane join ticket carries (internal/cpfiles): read only, by name.
		rbacv1ac.Role(clusterConfigRole, joinconfig.ClusterConfigNamespace).WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("configmaps").
				WithResourceNames(joinconfig.ClusterConfigName).WithVerbs("get"),
		),
		rbacv1ac.RoleBinding(clusterConfigRole, joinconfig.ClusterConfigNamespace).
			WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup("rbac.authorization.k8s.io").WithKind("Role").WithName(clusterConfigRole)).
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
		rbacv1ac.ClusterRole(spreadRole).WithRules(
			rbacv1ac.PolicyRule().WithAPIGroups("").WithResources("nodes").WithVerbs("get", "list"),
		),
		rbacv1ac.ClusterRoleBinding(spreadRole).
			WithRoleRef(rbacv1ac.RoleRef().WithAPIGroup("rbac.authorization.k8s.io").WithKind("ClusterRole").WithName(spreadRole)).
			WithSubjects(rbacv1ac.Subject().WithKind("ServiceAccount").WithName(joinconfig.ServiceAccountName).WithNamespace(ns)),
		ds,
	}
}

// JoinServiceDaemonSet returns the joinservice's DaemonSet, as Objects applies it: one pod on every
// control plane, on the host's network, with the kubeadm PKI and what the control plane's attestation
// variant (cfg.JoinServiceEnv's BERTH_ATTESTATION) needs:
//
//   - tpm (or no variant): the TPM's host paths (cfg.JoinServiceHostPaths) and the environment as given;
//   - tdx: the TD guest interface cfg.TDXGuest (AddTDXGuest: configfs-tsm by default, the legacy device
//     where chosen) below TDXRoot, the attestation policy's tdx.collateralDir (an absolute path on the
//     host) mounted read-only at the same path, and no TPM: neither cfg.JoinServiceHostPaths nor
//     BERTH_TPM. The policy's collateralBundle and pcsURL need nothing from the host (the bundle is in
//     the policy, the PCS is reached on the host's network);
//   - insecure-none: the environment as given.
//
// attestationPolicy is the cluster's policy (the join ConfigMap's); its variant must be the control
// plane's (ErrMixedVariants otherwise).
func JoinServiceDaemonSet(cfg Config, attestationPolicy []byte) (*appsv1ac.DaemonSetApplyConfiguration, error) {
	att, err := attestationFor(cfg, attestationPolicy)
	if err != nil {
		return nil, err
	}
	tdxNode := att.variant == VariantTDX
	pull := corev1.PullPolicy(cfg.ImagePullPolicy)
	if pull == "" {
		pull = corev1.PullIfNotPresent
	}
	env := []*corev1ac.EnvVarApplyConfiguration{
		fieldEnv(joinconfig.EnvNodeName, "spec.nodeName"),
		fieldEnv(envHostIP, "status.hostIP"),
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.JoinServiceEnv)) {
		if tdxNode && k == joinconfig.EnvTPM {
			continue
		}
		env = append(env, corev1ac.EnvVar().WithName(k).WithValue(cfg.JoinServiceEnv[k]))
	}
	labels := map[string]string{joinconfig.NameLabel: joinconfig.JoinServiceName, joinconfig.PartOfLabel: joinconfig.PartOf}
	mounts := []*corev1ac.VolumeMountApplyConfiguration{
		corev1ac.VolumeMount().WithName("pki").WithMountPath(pkiDir).WithReadOnly(true),
		// The etcd snapshots the backup schedule keeps on the node's state disk.
		corev1ac.VolumeMount().WithName("backups").WithMountPath(joinconfig.BackupDir),
	}
	volumes := []*corev1ac.VolumeApplyConfiguration{
		corev1ac.Volume().WithName("pki").WithHostPath(corev1ac.HostPathVolumeSource().WithPath(pkiDir).WithType(corev1.HostPathDirectory)),
		corev1ac.Volume().WithName("backups").WithHostPath(corev1ac.HostPathVolumeSource().WithPath(joinconfig.BackupDir).WithType(corev1.HostPathDirectoryOrCreate)),
	}
	privileged := false
	hostPaths := cfg.JoinServiceHostPaths
	if tdxNode {
		hostPaths = nil // the TPM's
	}
	for n, p := range hostPaths {
		name := fmt.Sprintf("host-%d", n)
		mounts = append(mounts, corev1ac.VolumeMount().WithName(name).WithMountPath(p))
		volumes = append(volumes, corev1ac.Volume().WithName(name).WithHostPath(corev1ac.HostPathVolumeSource().WithPath(p)))
		if strings.HasPrefix(p, "/dev/") {
			privileged = true // a TPM character device needs device access
		}
	}
	if att.collateralDir != "" {
		mounts = append(mounts, corev1ac.VolumeMount().WithName(tdxCollateralVolume).WithMountPath(att.collateralDir).WithReadOnly(true))
		volumes = append(volumes, corev1ac.Volume().WithName(tdxCollateralVolume).
			WithHostPath(corev1ac.HostPathVolumeSource().WithPath(att.collateralDir).WithType(corev1.HostPathDirectory)))
	}
	container := corev1ac.Container().
		WithName("joinservice").
		WithImage(cfg.JoinServiceImage).
		WithImagePullPolicy(pull).
		WithArgs(
			fmt.Sprintf("--listen=:%d", joinconfig.JoinPort),
			"--pki-dir="+pkiDir,
			// The backup schedule is on in every cluster (internal/backup).
			"--backup-dir="+joinconfig.BackupDir,
			// Metrics and probes on the node's own address, not every interface.
			fmt.Sprintf("--metrics-listen=$(%s):%d", envHostIP, joinconfig.MetricsPort),
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
		WithResources(corev1ac.ResourceRequirements().
			WithRequests(corev1.ResourceList{
				corev1.ResourceCPU:    resource.MustParse(joinServiceCPURequest),
				corev1.ResourceMemory: resource.MustParse(joinServiceMemoryRequest),
			}).
			WithLimits(corev1.ResourceList{
				corev1.ResourceCPU:    *resource.NewQuantity(JoinServiceCPUs, resource.DecimalSI),
				corev1.ResourceMemory: *resource.NewQuantity(JoinServiceMemoryLimitBytes, resource.BinarySI),
			})).
		WithSecurityContext(joinServiceSecurityContext(privileged))
	ds := appsv1ac.DaemonSet(joinconfig.JoinServiceName, joinconfig.Namespace).
		WithLabels(labels).
		WithSpec(appsv1ac.DaemonSetSpec().
			WithSelector(metav1ac.LabelSelector().WithMatchLabels(map[string]string{joinconfig.NameLabel: joinconfig.JoinServiceName})).
			WithTemplate(corev1ac.PodTemplateSpec().
				WithLabels(labels).
				WithSpec(corev1ac.PodSpec().
					WithServiceAccountName(joinconfig.ServiceAccountName).
					WithHostNetwork(true).
					WithPriorityClassName("system-cluster-critical").
					// Exempt from berth-system's Pod Security "restricted" (podsecurity.go).
					WithRuntimeClassName(HostRuntimeClass).
					WithSecurityContext(corev1ac.PodSecurityContext().
						WithSeccompProfile(corev1ac.SeccompProfile().WithType(corev1.SeccompProfileTypeRuntimeDefault))).
					WithNodeSelector(map[string]string{controlPlaneLabel: ""}).
					WithTolerations(corev1ac.Toleration().WithOperator(corev1.TolerationOpExists)).
					WithContainers(container).
					WithVolumes(volumes...))))
	if tdxNode {
		iface := cfg.TDXGuest
		if iface == "" {
			iface = TDXConfigfsTSM
		}
		if err := AddTDXGuest(ds, iface); err != nil {
			return nil, err
		}
	}
	return ds, nil
}

// joinServiceSecurityContext is the joinservice container's security context. It runs as root (the
// kubeadm CA key and the TPM's socket are root's), but root without any capability reads only what
// root owns, and that is all it needs; it never gains privileges and writes nothing to its image. A
// TPM character device needs a privileged container, which has every capability anyway.
func joinServiceSecurityContext(privileged bool) *corev1ac.SecurityContextApplyConfiguration {
	sc := corev1ac.SecurityContext().WithPrivileged(privileged).WithReadOnlyRootFilesystem(true)
	if !privileged {
		sc.WithAllowPrivilegeEscalation(false).WithCapabilities(corev1ac.Capabilities().WithDrop("ALL"))
	}
	return sc
}

// fieldEnv is an environment variable set from a field of the pod.
func fieldEnv(name, fieldPath string) *corev1ac.EnvVarApplyConfiguration {
	return corev1ac.EnvVar().WithName(name).
		WithValueFrom(corev1ac.EnvVarSource().WithFieldRef(corev1ac.ObjectFieldSelector().WithFieldPath(fieldPath)))
}

// TPMHostPaths returns the host paths the joinservice needs mounted to reach its node's TPM named by
// spec (a BERTH_TPM value): the directory of a unix socket, a device itself, nothing for TCP (the
// joinservice shares the host's network) or no TPM.
func TPMHostPaths(spec string) []string {
	switch {
	case spec == "" || strings.HasPrefix(spec, "tcp:"):
		return nil
	case strings.HasPrefix(spec, "unix:"):
		return []string{path.Dir(strings.TrimPrefix(spec, "unix:"))}
	default:
		return []string{spec}
	}
}
