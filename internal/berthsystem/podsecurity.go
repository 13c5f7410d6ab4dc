package berthsystem

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"

	"github.com/spf13/afero"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/version"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	admissionv1ac "k8s.io/client-go/applyconfigurations/admissionregistration/v1"
	nodev1ac "k8s.io/client-go/applyconfigurations/node/v1"
	psaconfigv1 "k8s.io/pod-security-admission/admission/api/v1"
	psaapi "k8s.io/pod-security-admission/api"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// Pod Security in berth-system.
//
// berth-system enforces the Pod Security Standard "restricted": the webhook's pods, and any pod
// someone else manages to create there, run as non-root without capabilities, with the runtime's
// default seccomp profile, on no host namespace or path. The joinservice cannot: it serves joins on
// port 9002 of every control plane (host network), signs with the kubeadm CA from the node's
// /etc/kubernetes/pki (a hostPath volume, files only root reads), and attests with the node's TPM (a
// host socket or a device), all of which even "baseline" forbids. Its pods run with the RuntimeClass
// HostRuntimeClass, which the API server's PodSecurity admission configuration (AdmissionConfiguration,
// passed to kube-apiserver through kubeadm) exempts; the ValidatingAdmissionPolicy HostRuntimeGuardName
// lets only pods in berth-system whose images are the joinservice's use that RuntimeClass, in any
// namespace. The joinservice container still runs with a read-only root file system, no
// capabilities, no privilege escalation and the default seccomp profile where its node lets it (a TPM
// character device makes it privileged). Without the exemption (an API server started without the
// configuration), the joinservice's pods are refused: a cluster fails closed, and visibly.

const (
	// HostRuntimeClass is the RuntimeClass of the joinservice's pods, exempt from Pod Security.
	HostRuntimeClass = "berth-host"
	// HostRuntimeHandler is the container runtime handler HostRuntimeClass runs pods with: containerd's
	// default runc runtime, as every other pod.
	HostRuntimeHandler = "runc"
	// HostRuntimeGuardName names the ValidatingAdmissionPolicy (and its binding) that keeps
	// HostRuntimeClass to the joinservice.
	HostRuntimeGuardName = "berth-host-runtime"
	// AdmissionConfigFile is the API server's admission configuration, relative to kubeadm's directory
	// (/etc/kubernetes). Its directory is mounted into the API server's static pod.
	AdmissionConfigFile = "berth/admission.yaml"
)

// podSecurityLevel is what berth-system enforces, audits and warns about.
const podSecurityLevel = psaapi.LevelRestricted

// podSecurityVersion pins the Pod Security Standards to the cluster's Kubernetes minor version
// ("v1.37" for "v1.37.2"), so that an upgrade does not tighten them under running pods; "latest"
// when the version does not parse.
func podSecurityVersion(kubernetesVersion string) string {
	v, err := version.ParseGeneric(kubernetesVersion)
	if err != nil {
		return psaapi.VersionLatest
	}
	return fmt.Sprintf("v%d.%d", v.Major(), v.Minor())
}

// podSecurityLabels are berth-system's Pod Security labels for a cluster of kubernetesVersion.
func podSecurityLabels(kubernetesVersion string) map[string]string {
	v := podSecurityVersion(kubernetesVersion)
	return map[string]string{
		psaapi.EnforceLevelLabel: string(podSecurityLevel), psaapi.EnforceVersionLabel: v,
		psaapi.AuditLevelLabel: string(podSecurityLevel), psaapi.AuditVersionLabel: v,
		psaapi.WarnLevelLabel: string(podSecurityLevel), psaapi.WarnVersionLabel: v,
	}
}

// RuntimeClass returns HostRuntimeClass.
func RuntimeClass() *nodev1ac.RuntimeClassApplyConfiguration {
	return nodev1ac.RuntimeClass(HostRuntimeClass).
		WithLabels(map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf, "app.kubernetes.io/managed-by": "berth-bootstrapper"}).
		WithHandler(HostRuntimeHandler)
}

// HostRuntimeGuard returns the policy and binding that let only pods in berth-system running
// joinServiceImage use HostRuntimeClass, in every namespace: the RuntimeClass exempts a pod from Pod
// Security, so whoever may create pods anywhere could otherwise claim it. Images a pod already runs
// stay allowed on UPDATE, as in Guard.
func HostRuntimeGuard(joinServiceImage string) (*admissionv1ac.ValidatingAdmissionPolicyApplyConfiguration, *admissionv1ac.ValidatingAdmissionPolicyBindingApplyConfiguration) {
	labels := map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf, "app.kubernetes.io/managed-by": "berth-bootstrapper"}
	policy := admissionv1ac.ValidatingAdmissionPolicy(HostRuntimeGuardName).
		WithLabels(labels).
		WithSpec(admissionv1ac.ValidatingAdmissionPolicySpec().
			WithFailurePolicy(admissionv1.Fail).
			WithMatchConstraints(admissionv1ac.MatchResources().
				WithResourceRules(admissionv1ac.NamedRuleWithOperations().
					WithAPIGroups("").WithAPIVersions("v1").
					WithOperations(admissionv1.Create, admissionv1.Update).
					WithResources("pods", "pods/ephemeralcontainers"))).
			WithMatchConditions(admissionv1ac.MatchCondition().
				WithName("uses-"+HostRuntimeClass).
				WithExpression("has(object.spec.runtimeClassName) && object.spec.runtimeClassName == "+strconv.Quote(HostRuntimeClass))).
			WithVariables(
				admissionv1ac.Variable().WithName("images").WithExpression(podImages("object")),
				admissionv1ac.Variable().WithName("running").WithExpression("oldObject == null ? [] : "+podImages("oldObject")),
			).
			WithValidations(
				admissionv1ac.Validation().
					WithExpression("request.namespace == "+strconv.Quote(joinconfig.Namespace)).
					WithMessage(fmt.Sprintf("RuntimeClass %s is exempt from Pod Security and only for the joinservice in namespace %s; "+
						"policy %s enforces this", HostRuntimeClass, joinconfig.Namespace, HostRuntimeGuardName)).
					WithReason(metav1.StatusReasonForbidden),
				admissionv1ac.Validation().
					WithExpression("variables.images.all(i, i == "+strconv.Quote(joinServiceImage)+" || i in variables.running)").
					WithMessage(fmt.Sprintf("RuntimeClass %s is exempt from Pod Security and only for the joinservice's image %s; "+
						"policy %s enforces this", HostRuntimeClass, joinServiceImage, HostRuntimeGuardName)).
					WithReason(metav1.StatusReasonForbidden),
			))
	binding := admissionv1ac.ValidatingAdmissionPolicyBinding(HostRuntimeGuardName).
		WithLabels(labels).
		WithSpec(admissionv1ac.ValidatingAdmissionPolicyBindingSpec().
			WithPolicyName(HostRuntimeGuardName).
			WithValidationActions(admissionv1.Deny))
	return policy, binding
}

// ErrPodSecurityOverride refuses an extra admission plugin configuration for PodSecurity: Berth's
// own exempts HostRuntimeClass, and a second would replace it.
var ErrPodSecurityOverride = errors.New("the PodSecurity admission configuration is Berth's own and cannot be overridden")

// AdmissionConfiguration returns the API server's admission configuration (its
// --admission-control-config-file): PodSecurity with Kubernetes' own defaults (privileged, so
// namespaces without labels behave as in any cluster) and HostRuntimeClass exempt, then the
// operator's extra plugin configurations (never PodSecurity's: ErrPodSecurityOverride).
func AdmissionConfiguration(extra ...apiserverv1.AdmissionPluginConfiguration) ([]byte, error) {
	for _, p := range extra {
		if p.Name == "PodSecurity" {
			return nil, ErrPodSecurityOverride
		}
	}
	psa, err := json.Marshal(psaconfigv1.PodSecurityConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: psaconfigv1.SchemeGroupVersion.String(), Kind: "PodSecurityConfiguration"},
		Defaults: psaconfigv1.PodSecurityDefaults{
			Enforce: string(psaapi.LevelPrivileged), EnforceVersion: psaapi.VersionLatest,
			Audit: string(psaapi.LevelPrivileged), AuditVersion: psaapi.VersionLatest,
			Warn: string(psaapi.LevelPrivileged), WarnVersion: psaapi.VersionLatest,
		},
		Exemptions: psaconfigv1.PodSecurityExemptions{RuntimeClasses: []string{HostRuntimeClass}},
	})
	if err != nil {
		return nil, fmt.Errorf("encoding the PodSecurity configuration: %w", err)
	}
	data, err := yaml.Marshal(apiserverv1.AdmissionConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: apiserverv1.SchemeGroupVersion.String(), Kind: "AdmissionConfiguration"},
		Plugins: append([]apiserverv1.AdmissionPluginConfiguration{{
			Name:          "PodSecurity",
			Configuration: &runtime.Unknown{Raw: psa, ContentType: runtime.ContentTypeJSON},
		}}, extra...),
	})
	if err != nil {
		return nil, fmt.Errorf("encoding the admission configuration: %w", err)
	}
	return data, nil
}

// WriteAdmissionConfiguration writes AdmissionConfiguration (with the operator's extra plugin
// configurations) to AdmissionConfigFile below kubeadm's directory kubernetesDir on fsys and
// returns the file's path. Every control plane writes it before kubeadm starts its API server.
func WriteAdmissionConfiguration(fsys afero.Fs, kubernetesDir string, extra ...apiserverv1.AdmissionPluginConfiguration) (string, error) {
	data, err := AdmissionConfiguration(extra...)
	if err != nil {
		return "", err
	}
	path := filepath.Join(kubernetesDir, AdmissionConfigFile)
	if err := fsys.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", fmt.Errorf("writing the admission configuration: %w", err)
	}
	if err := afero.WriteFile(fsys, path, data, 0o600); err != nil {
		return "", fmt.Errorf("writing the admission configuration: %w", err)
	}
	return path, nil
}
