package install

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	policyv1ac "k8s.io/client-go/applyconfigurations/policy/v1"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// The backend: the objects the webhook runs on, applied only where the live object differs.

const (
	namespace         = joinconfig.Namespace
	servingPort       = 8443
	probePort         = 8081
	shutdownDelay     = 10 * time.Second
	managedByLabel    = "app.kubernetes.io/managed-by"
	controlPlaneLabel = "node-role.kubernetes.io/control-plane"
)

// The webhook's resources: it holds the policy and one certificate, and answers a review in
// microseconds. No CPU limit: throttling would turn into admission latency for the whole cluster.
const (
	cpuRequest    = "50m"
	memoryRequest = "32Mi"
	memoryLimit   = "256Mi"
)

// get returns the live object, or nil when it does not exist.
func (w *Installer) get(ctx context.Context, obj *unstructured.Unstructured) (*unstructured.Unstructured, error) {
	res, err := w.objects.Resource(obj)
	if err != nil {
		return nil, fmt.Errorf("reading %s %s: %w", obj.GetKind(), obj.GetName(), err)
	}
	live, err := res.Get(ctx, obj.GetName(), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s %s: %w", obj.GetKind(), obj.GetName(), err)
	}
	return live, nil
}

// ensure applies obj unless the live object already holds every field of it (observe, diff, apply).
func (w *Installer) ensure(ctx context.Context, obj *unstructured.Unstructured) error {
	live, err := w.get(ctx, obj)
	if err != nil {
		return failure(ErrApply, "check the API server and retry", "%v", err)
	}
	if live != nil && contains(live.Object, obj.Object) {
		return nil
	}
	if err := w.objects.Apply(ctx, obj); err != nil {
		return failure(ErrApply, "check the API server and the object, then retry", "%v", err)
	}
	w.result.Writes = append(w.result.Writes, "apply "+obj.GetKind()+" "+qualifiedName(obj))
	w.say("applied %s %s", obj.GetKind(), qualifiedName(obj))
	return nil
}

// contains reports whether every field of want is in have with the same value (lists element-wise,
// same length); fields only in have (defaults, status) do not matter.
func contains(have, want any) bool {
	switch wv := want.(type) {
	case map[string]any:
		hv, ok := have.(map[string]any)
		if !ok {
			return false
		}
		for k, v := range wv {
			h, ok := hv[k]
			if !ok || !contains(h, v) {
				return false
			}
		}
		return true
	case []any:
		hv, ok := have.([]any)
		if !ok || len(hv) != len(wv) {
			return false
		}
		for n := range wv {
			if !contains(hv[n], wv[n]) {
				return false
			}
		}
		return true
	default:
		return reflect.DeepEqual(have, want)
	}
}

func (w *Installer) ensureBackend(ctx context.Context) ([]byte, error) {
	ns := typed(corev1ac.Namespace(namespace).WithLabels(map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf}))
	if live, err := w.get(ctx, ns); err != nil {
		return nil, failure(ErrApply, "check the API server and retry", "%v", err)
	} else if live == nil {
		if err := w.ensure(ctx, ns); err != nil {
			return nil, err
		}
	}
	if err := w.waitNotTerminating(ctx, webhookconfig.CanaryNamespace); err != nil {
		return nil, err
	}
	secret, caPEM, err := w.tlsSecret(ctx)
	if err != nil {
		return nil, err
	}
	objs := []*unstructured.Unstructured{
		w.canaryNamespace(), w.canaryServiceAccount(),
		w.serviceAccount(), w.policyConfigMap(), secret, w.service(), w.deployment(), w.pdb(),
	}
	objs = append(objs, keeperRBAC()...)
	for _, o := range objs {
		if err := w.ensure(ctx, o); err != nil {
			return nil, err
		}
	}
	return caPEM, nil
}

// Objects returns the webhook's objects as an install of cfg applies them, for an operator to read
// or diff (berth manifests): the canary namespace and its ServiceAccount, the webhook's
// ServiceAccount, policy ConfigMap, Service, Deployment and PodDisruptionBudget, and the armed
// ValidatingWebhookConfiguration with caPEM as its CA bundle. The TLS Secret is not among them: the
// installer makes its CA and keys in the cluster, and keeps them there. berth-system itself is
// internal/berthsystem's.
func Objects(cfg Config, caPEM []byte) ([]*unstructured.Unstructured, error) {
	if cfg.Image == "" {
		return nil, failure(ErrInvalidConfiguration, "name the berth-webhook image", "no image")
	}
	cfg.defaults()
	w := &Installer{cfg: cfg}
	return []*unstructured.Unstructured{
		w.canaryNamespace(), w.canaryServiceAccount(), w.serviceAccount(), w.policyConfigMap(),
		w.service(), w.deployment(), w.pdb(), w.ValidatingWebhookConfiguration(caPEM, false),
	}, nil
}

// waitNotTerminating waits until the namespace is not being deleted (a previous uninstall's canary
// namespace still terminating), so that it can be created again.
func (w *Installer) waitNotTerminating(ctx context.Context, name string) error {
	err := retry(ctx, w.cfg.MaxBackoff, func() (bool, error) {
		ns, err := w.kube.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, err
		}
		if ns.DeletionTimestamp == nil {
			return true, nil
		}
		return false, fmt.Errorf("namespace %s is still terminating", name)
	})
	if err != nil {
		return failure(ErrApply, "check what keeps the namespace from being deleted (kubectl get namespace "+name+" -o yaml)", "%v", err)
	}
	return nil
}

func ownLabels() map[string]string {
	return map[string]string{joinconfig.NameLabel: webhookconfig.Name, joinconfig.PartOfLabel: joinconfig.PartOf, managedByLabel: apply.FieldManager}
}

// selector selects the webhook's pods.
func selector() *metav1ac.LabelSelectorApplyConfiguration {
	return metav1ac.LabelSelector().WithMatchLabels(map[string]string{joinconfig.NameLabel: webhookconfig.Name})
}

// typed turns one of the installer's typed apply configurations into the object apply takes.
func typed(ac any) *unstructured.Unstructured {
	obj, err := apply.Unstructured(ac)
	if err != nil {
		// Every configuration here is built in this file with a kind and a name; encoding one cannot fail.
		panic(fmt.Sprintf("building the webhook's objects: %v", err))
	}
	return obj
}

func (w *Installer) canaryNamespace() *unstructured.Unstructured {
	return typed(corev1ac.Namespace(webhookconfig.CanaryNamespace).WithLabels(ownLabels()))
}

func (w *Installer) canaryServiceAccount() *unstructured.Unstructured {
	return typed(corev1ac.ServiceAccount("berth-webhook-canary", webhookconfig.CanaryNamespace).
		WithLabels(ownLabels()).WithAutomountServiceAccountToken(false))
}

func (w *Installer) serviceAccount() *unstructured.Unstructured {
	return typed(corev1ac.ServiceAccount(webhookconfig.Name, namespace).WithLabels(ownLabels()).WithAutomountServiceAccountToken(false))
}

func (w *Installer) policyConfigMap() *unstructured.Unstructured {
	return typed(corev1ac.ConfigMap(webhookconfig.PolicyConfigMap, namespace).
		WithLabels(ownLabels()).
		WithData(map[string]string{"policy.yaml": string(w.cfg.Policy)}))
}

func (w *Installer) service() *unstructured.Unstructured {
	return typed(corev1ac.Service(webhookconfig.Name, namespace).
		WithLabels(ownLabels()).
		WithSpec(corev1ac.ServiceSpec().
			WithSelector(map[string]string{joinconfig.NameLabel: webhookconfig.Name}).
			WithPorts(corev1ac.ServicePort().WithName("https").WithPort(443).
				WithTargetPort(intstr.FromInt32(servingPort)).WithProtocol(corev1.ProtocolTCP))))
}

func (w *Installer) exemptNamespaces() []string {
	ns := []string{"kube-system", "kube-node-lease", "kube-public", namespace}
	for _, n := range w.cfg.ExemptNamespaces {
		if !slices.Contains(ns, n) {
			ns = append(ns, n)
		}
	}
	return ns
}

func (w *Installer) deployment() *unstructured.Unstructured {
	labels := ownLabels()
	// The handler answers one second before the API server would give up.
	handlerDeadline := time.Duration(w.cfg.TimeoutSeconds-1) * time.Second
	if w.cfg.TimeoutSeconds <= 1 {
		handlerDeadline = 500 * time.Millisecond
	}
	grace := int64((shutdownDelay + time.Duration(w.cfg.TimeoutSeconds)*time.Second).Seconds()) + 15
	httpProbe := func(path string, period, failures int32) *corev1ac.ProbeApplyConfiguration {
		return corev1ac.Probe().
			WithHTTPGet(corev1ac.HTTPGetAction().WithPath(path).WithPort(intstr.FromInt32(probePort)).WithScheme(corev1.URISchemeHTTP)).
			WithPeriodSeconds(period).WithTimeoutSeconds(2).WithFailureThreshold(failures).WithSuccessThreshold(1)
	}
	container := corev1ac.Container().
		WithName("webhook").
		WithImage(w.cfg.Image).
		WithImagePullPolicy(corev1.PullPolicy(w.cfg.ImagePullPolicy)).
		WithArgs(
			fmt.Sprintf("--listen=:%d", servingPort),
			fmt.Sprintf("--probe-listen=:%d", probePort),
			"--cert-file=/etc/berth-webhook/tls/tls.crt",
			"--key-file=/etc/berth-webhook/tls/tls.key",
			"--policy-file=/etc/berth-webhook/policy/policy.yaml",
			"--shutdown-delay="+shutdownDelay.String(),
			"--handler-deadline="+handlerDeadline.String(),
			"--exempt-namespaces="+strings.Join(w.exemptNamespaces(), ","),
		).
		WithEnv(corev1ac.EnvVar().WithName("POD_NAMESPACE").
			WithValueFrom(corev1ac.EnvVarSource().WithFieldRef(corev1ac.ObjectFieldSelector().WithFieldPath("metadata.namespace")))).
		WithPorts(
			corev1ac.ContainerPort().WithName("https").WithContainerPort(servingPort).WithProtocol(corev1.ProtocolTCP),
			corev1ac.ContainerPort().WithName("probes").WithContainerPort(probePort).WithProtocol(corev1.ProtocolTCP),
		).
		// /readyz flips at once on SIGTERM; the threshold only rides out a slow probe on a
		// loaded node (the endpoint is marked terminating on deletion anyway).
		WithReadinessProbe(httpProbe("/readyz", 2, 2)).
		WithLivenessProbe(httpProbe("/livez", 10, 3)).
		WithStartupProbe(httpProbe("/livez", 1, 120)).
		WithResources(corev1ac.ResourceRequirements().
			WithRequests(corev1.ResourceList{
				corev1.ResourceCPU:    resource.MustParse(cpuRequest),
				corev1.ResourceMemory: resource.MustParse(memoryRequest),
			}).
			WithLimits(corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(memoryLimit)})).
		WithSecurityContext(corev1ac.SecurityContext().
			WithAllowPrivilegeEscalation(false).
			WithReadOnlyRootFilesystem(true).
			WithCapabilities(corev1ac.Capabilities().WithDrop("ALL"))).
		WithVolumeMounts(
			corev1ac.VolumeMount().WithName("tls").WithMountPath("/etc/berth-webhook/tls").WithReadOnly(true),
			corev1ac.VolumeMount().WithName("policy").WithMountPath("/etc/berth-webhook/policy").WithReadOnly(true),
		)
	return typed(appsv1ac.Deployment(webhookconfig.Name, namespace).
		WithLabels(labels).
		WithSpec(appsv1ac.DeploymentSpec().
			WithReplicas(int32(w.cfg.Replicas)).
			WithSelector(selector()).
			WithStrategy(appsv1ac.DeploymentStrategy().
				WithType(appsv1.RollingUpdateDeploymentStrategyType).
				WithRollingUpdate(appsv1ac.RollingUpdateDeployment().
					WithMaxUnavailable(intstr.FromInt32(0)).WithMaxSurge(intstr.FromInt32(1)))).
			WithTemplate(corev1ac.PodTemplateSpec().
				WithLabels(labels).
				WithSpec(corev1ac.PodSpec().
					WithServiceAccountName(webhookconfig.Name).
					WithAutomountServiceAccountToken(false).
					WithPriorityClassName("system-cluster-critical").
					WithTerminationGracePeriodSeconds(grace).
					WithTolerations(corev1ac.Toleration().WithKey(controlPlaneLabel).
						WithOperator(corev1.TolerationOpExists).WithEffect(corev1.TaintEffectNoSchedule)).
					// One replica per node wherever there are nodes that can run them (their
					// taints tolerated): losing a node must not take both. The scheduler never
					// moves a placed pod; the joinservice evicts one of two that share a node when
					// another node could run it (joinservice/spread), and this places the new one.
					WithTopologySpreadConstraints(corev1ac.TopologySpreadConstraint().
						WithMaxSkew(1).WithTopologyKey("kubernetes.io/hostname").
						WithWhenUnsatisfiable(corev1.DoNotSchedule).
						WithNodeTaintsPolicy(corev1.NodeInclusionPolicyHonor).
						WithLabelSelector(selector())).
					// Pod Security "restricted", which berth-system enforces.
					WithSecurityContext(corev1ac.PodSecurityContext().
						WithRunAsNonRoot(true).WithRunAsUser(65532).WithRunAsGroup(65532).WithFSGroup(65532).
						WithSeccompProfile(corev1ac.SeccompProfile().WithType(corev1.SeccompProfileTypeRuntimeDefault))).
					WithContainers(container).
					WithVolumes(
						corev1ac.Volume().WithName("tls").WithSecret(corev1ac.SecretVolumeSource().
							WithSecretName(webhookconfig.TLSSecret).WithDefaultMode(0o440).
							// The CA key stays in the Secret; the pods get only their keypair.
							WithItems(
								corev1ac.KeyToPath().WithKey("tls.crt").WithPath("tls.crt"),
								corev1ac.KeyToPath().WithKey("tls.key").WithPath("tls.key"),
							)),
						corev1ac.Volume().WithName("policy").WithConfigMap(corev1ac.ConfigMapVolumeSource().WithName(webhookconfig.PolicyConfigMap)),
					)))))
}

func (w *Installer) pdb() *unstructured.Unstructured {
	return typed(policyv1ac.PodDisruptionBudget(webhookconfig.Name, namespace).
		WithLabels(ownLabels()).
		WithSpec(policyv1ac.PodDisruptionBudgetSpec().
			WithMaxUnavailable(intstr.FromInt32(1)).
			WithSelector(selector())))
}

func qualifiedName(obj *unstructured.Unstructured) string {
	if ns := obj.GetNamespace(); ns != "" {
		return ns + "/" + obj.GetName()
	}
	return obj.GetName()
}
