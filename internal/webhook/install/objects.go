package install

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/joinconfig"
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
	obj = normalize(obj)
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

// normalize round-trips obj through JSON so that numbers have the types decoded objects have.
func normalize(obj *unstructured.Unstructured) *unstructured.Unstructured {
	data, err := json.Marshal(obj.Object)
	if err != nil {
		return obj
	}
	out := &unstructured.Unstructured{}
	if err := out.UnmarshalJSON(data); err != nil {
		return obj
	}
	return out
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
	ns := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "Namespace",
		"metadata": map[string]any{"name": namespace, "labels": map[string]any{"app.kubernetes.io/part-of": "berth"}},
	}}
	if live, err := w.get(ctx, ns); err != nil {
		return nil, failure(ErrApply, "check the API server and retry", "%v", err)
	} else if live == nil {
		if err := w.ensure(ctx, ns); err != nil {
			return nil, err
		}
	}
	if err := w.waitNotTerminating(ctx, CanaryNamespace); err != nil {
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
	for _, o := range objs {
		if err := w.ensure(ctx, o); err != nil {
			return nil, err
		}
	}
	return caPEM, nil
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

func ownLabels() map[string]any {
	return map[string]any{"app.kubernetes.io/name": Name, "app.kubernetes.io/part-of": "berth", managedByLabel: apply.FieldManager}
}

func obj(m map[string]any) *unstructured.Unstructured { return &unstructured.Unstructured{Object: m} }

func (w *Installer) canaryNamespace() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "Namespace",
		"metadata": map[string]any{"name": CanaryNamespace, "labels": ownLabels()}})
}

func (w *Installer) canaryServiceAccount() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": false,
		"metadata": map[string]any{"name": "berth-webhook-canary", "namespace": CanaryNamespace, "labels": ownLabels()}})
}

func (w *Installer) serviceAccount() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": false,
		"metadata": map[string]any{"name": Name, "namespace": namespace, "labels": ownLabels()}})
}

func (w *Installer) policyConfigMap() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": PolicyConfigMap, "namespace": namespace, "labels": ownLabels()},
		"data":     map[string]any{"policy.yaml": string(w.cfg.Policy)}})
}

func (w *Installer) service() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "Service",
		"metadata": map[string]any{"name": Name, "namespace": namespace, "labels": ownLabels()},
		"spec": map[string]any{
			"selector": map[string]any{"app.kubernetes.io/name": Name},
			"ports":    []any{map[string]any{"name": "https", "port": 443, "targetPort": servingPort, "protocol": "TCP"}},
		}})
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
	grace := int((shutdownDelay + time.Duration(w.cfg.TimeoutSeconds)*time.Second).Seconds()) + 15
	httpProbe := func(path string, period, failures int) map[string]any {
		return map[string]any{
			"httpGet":       map[string]any{"path": path, "port": probePort, "scheme": "HTTP"},
			"periodSeconds": period, "timeoutSeconds": 2, "failureThreshold": failures, "successThreshold": 1,
		}
	}
	return obj(map[string]any{"apiVersion": "apps/v1", "kind": "Deployment",
		"metadata": map[string]any{"name": Name, "namespace": namespace, "labels": labels},
		"spec": map[string]any{
			"replicas": w.cfg.Replicas,
			"selector": map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": Name}},
			"strategy": map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": 0, "maxSurge": 1}},
			"template": map[string]any{
				"metadata": map[string]any{"labels": labels},
				"spec": map[string]any{
					"serviceAccountName":            Name,
					"automountServiceAccountToken":  false,
					"priorityClassName":             "system-cluster-critical",
					"terminationGracePeriodSeconds": grace,
					"tolerations": []any{
						map[string]any{"key": controlPlaneLabel, "operator": "Exists", "effect": "NoSchedule"},
					},
					"topologySpreadConstraints": []any{map[string]any{
						"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
						"labelSelector": map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": Name}},
					}},
					"securityContext": map[string]any{"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
					"containers": []any{map[string]any{
						"name":            "webhook",
						"image":           w.cfg.Image,
						"imagePullPolicy": w.cfg.ImagePullPolicy,
						"args": []any{
							fmt.Sprintf("--listen=:%d", servingPort),
							fmt.Sprintf("--probe-listen=:%d", probePort),
							"--cert-file=/etc/berth-webhook/tls/tls.crt",
							"--key-file=/etc/berth-webhook/tls/tls.key",
							"--policy-file=/etc/berth-webhook/policy/policy.yaml",
							"--shutdown-delay=" + shutdownDelay.String(),
							"--handler-deadline=" + handlerDeadline.String(),
							"--exempt-namespaces=" + strings.Join(w.exemptNamespaces(), ","),
						},
						"env": []any{map[string]any{"name": "POD_NAMESPACE", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "metadata.namespace"}}}},
						"ports": []any{
							map[string]any{"name": "https", "containerPort": servingPort, "protocol": "TCP"},
							map[string]any{"name": "probes", "containerPort": probePort, "protocol": "TCP"},
						},
						// /readyz flips at once on SIGTERM; the threshold only rides out a slow probe on a
						// loaded node (the endpoint is marked terminating on deletion anyway).
						"readinessProbe": httpProbe("/readyz", 2, 2),
						"livenessProbe":  httpProbe("/livez", 10, 3),
						"startupProbe":   httpProbe("/livez", 1, 120),
						"securityContext": map[string]any{
							"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
							"capabilities": map[string]any{"drop": []any{"ALL"}},
						},
						"volumeMounts": []any{
							map[string]any{"name": "tls", "mountPath": "/etc/berth-webhook/tls", "readOnly": true},
							map[string]any{"name": "policy", "mountPath": "/etc/berth-webhook/policy", "readOnly": true},
						},
					}},
					"volumes": []any{
						map[string]any{"name": "tls", "secret": map[string]any{
							"secretName": TLSSecret, "defaultMode": 0o440,
							// The CA key stays in the Secret; the pods get only their keypair.
							"items": []any{
								map[string]any{"key": "tls.crt", "path": "tls.crt"},
								map[string]any{"key": "tls.key", "path": "tls.key"},
							},
						}},
						map[string]any{"name": "policy", "configMap": map[string]any{"name": PolicyConfigMap}},
					},
				},
			},
		}})
}

func (w *Installer) pdb() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
		"metadata": map[string]any{"name": Name, "namespace": namespace, "labels": ownLabels()},
		"spec": map[string]any{
			"maxUnavailable": 1,
			"selector":       map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": Name}},
		}})
}

func qualifiedName(obj *unstructured.Unstructured) string {
	if ns := obj.GetNamespace(); ns != "" {
		return ns + "/" + obj.GetName()
	}
	return obj.GetName()
}

func toAny(s []string) []any {
	out := make([]any, len(s))
	for n, v := range s {
		out[n] = v
	}
	return out
}

func toAnyMap(m map[string]string) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}
