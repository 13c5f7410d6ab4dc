package components

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	mathrand "math/rand/v2"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/pemcerts"
	"github.com/berth-k8s/berth/internal/webhook"
)

// Names of the image-policy webhook's objects. WebhookName and WebhookConfigName are contracts.
const (
	WebhookName            = "berth-webhook"
	WebhookConfigName      = "berth-image-policy"
	WebhookTLSSecret       = "berth-webhook-tls"
	WebhookPolicyConfigMap = "berth-webhook-policy"
	WebhookCanaryNamespace = "berth-webhook-canary"
	// WebhookHookName is the webhook's name inside the configuration.
	WebhookHookName = "image-policy.berth-webhook.berth-system.svc"
	// WebhookPausedAnnotation on the configuration (value "true") makes the installer leave it alone:
	// the operator's break-glass marker.
	WebhookPausedAnnotation = "berth.dev/paused"
	webhookPort             = 8443
	webhookProbePort        = 8081
	webhookShutdownDelay    = 10 * time.Second
	managedByLabel          = "app.kubernetes.io/managed-by"
)

// Failure categories of the webhook install (B8). Every error Install returns wraps one of them.
var (
	ErrWebhookAPINotReady          = errors.New("API server not ready")
	ErrWebhookApply                = errors.New("applying the webhook's objects failed")
	ErrWebhookServiceMissing       = errors.New("webhook Service missing")
	ErrWebhookDeploymentNotReady   = errors.New("webhook Deployment not available")
	ErrWebhookNoReadyEndpoints     = errors.New("no ready webhook endpoints")
	ErrWebhookTLSMismatch          = errors.New("webhook serves a certificate the CA bundle does not verify")
	ErrWebhookWrongResponse        = errors.New("webhook gave a wrong answer to a probe review")
	ErrWebhookConfigNotHonored     = errors.New("webhook configuration not honored (webhook not invoked)")
	ErrWebhookCallFailed           = errors.New("API server failed calling the webhook")
	ErrWebhookUnexpectedDenial     = errors.New("webhook denied an allowed canary pod")
	ErrWebhookInvalidConfiguration = errors.New("invalid webhook install configuration")
)

// WebhookError is an install failure: a category (one of the ErrWebhook* errors), what happened and
// what to do.
type WebhookError struct {
	Category error
	Detail   string
	Hint     string
}

func (e *WebhookError) Error() string {
	return fmt.Sprintf("%v: %s; %s", e.Category, e.Detail, e.Hint)
}

// Unwrap returns the category.
func (e *WebhookError) Unwrap() error { return e.Category }

func failure(category error, hint, format string, args ...any) *WebhookError {
	return &WebhookError{Category: category, Detail: fmt.Sprintf(format, args...), Hint: hint}
}

// WebhookConfig configures the webhook install.
type WebhookConfig struct {
	// Image of the berth-webhook container.
	Image string
	// ImagePullPolicy of the container (default IfNotPresent).
	ImagePullPolicy string
	// Replicas of the Deployment (default 2); the install waits for all of them.
	Replicas int
	// Policy is the image policy (YAML); empty means webhook.DefaultPolicy.
	Policy []byte
	// ExemptNamespaces are exempt besides kube-system, kube-node-lease, kube-public and berth-system.
	ExemptNamespaces []string
	// TimeoutSeconds of the webhook call (default 5); the handler's deadline is one second less.
	TimeoutSeconds int
	// Budget bounds the whole install (default 5 minutes).
	Budget time.Duration
	// ProbeTimeout bounds one probe (default 3 s).
	ProbeTimeout time.Duration
	// StablePasses is how many consecutive probe rounds of every endpoint must pass (default 3), with
	// StableInterval between them (default 1 s).
	StablePasses   int
	StableInterval time.Duration
	// MaxBackoff caps the wait between retries (default 10 s).
	MaxBackoff time.Duration
	// EndToEndWindow is how long the end-to-end check retries while the API server may not have
	// picked up a new configuration yet (default 15 s).
	EndToEndWindow time.Duration
	// ProbeServiceIP also probes the Service's ClusterIP (needs kube-proxy on this host; without
	// --enable-aggregator-routing that is the path the API server takes).
	ProbeServiceIP bool
	// CARenewBefore starts a CA rotation when the CA has less than this left (default: a leaf's
	// lifetime plus 90 days, so the last leaf of the old CA never outlives it).
	CARenewBefore time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
}

func (c *WebhookConfig) defaults() {
	if c.ImagePullPolicy == "" {
		c.ImagePullPolicy = "IfNotPresent"
	}
	if c.Replicas == 0 {
		c.Replicas = 2
	}
	if len(c.Policy) == 0 {
		c.Policy = []byte(webhook.DefaultPolicy)
	}
	if c.TimeoutSeconds == 0 {
		c.TimeoutSeconds = 5
	}
	if c.Budget == 0 {
		c.Budget = 5 * time.Minute
	}
	if c.ProbeTimeout == 0 {
		c.ProbeTimeout = 3 * time.Second
	}
	if c.StablePasses == 0 {
		c.StablePasses = 3
	}
	if c.StableInterval == 0 {
		c.StableInterval = time.Second
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 10 * time.Second
	}
	if c.EndToEndWindow == 0 {
		c.EndToEndWindow = 15 * time.Second
	}
	if c.CARenewBefore == 0 {
		c.CARenewBefore = leafLifetime + 90*24*time.Hour
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// WebhookResult reports what an install changed.
type WebhookResult struct {
	// Writes lists every write ("apply Kind name", "delete Kind name"); empty on a no-op re-run.
	Writes []string
	// ProbedEndpoints are the endpoints that passed the TLS probe.
	ProbedEndpoints []string
}

// WebhookInstaller installs the image-policy webhook and arms it only once it verifiably serves.
type WebhookInstaller struct {
	cfg  WebhookConfig
	kube kubernetes.Interface
	dyn  dynamic.Interface
	applier
	out    io.Writer
	result WebhookResult
	// started is when the running Install began; progress lines say how long ago.
	started time.Time
}

// NewWebhookInstaller returns an installer using the given clients; progress goes to out.
func NewWebhookInstaller(cfg WebhookConfig, kube kubernetes.Interface, dyn dynamic.Interface, out io.Writer) *WebhookInstaller {
	cfg.defaults()
	return &WebhookInstaller{cfg: cfg, kube: kube, dyn: dyn, applier: apply.New(dyn), out: out}
}

// clients returns the typed and dynamic clients for a kubeconfig.
func clients(kubeconfigPath string) (kubernetes.Interface, dynamic.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfigPath)
	if err != nil {
		return nil, nil, fmt.Errorf("loading kubeconfig: %w", err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("creating client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("creating client: %w", err)
	}
	return kube, dyn, nil
}

// installWebhook runs the webhook installer when Config.WebhookImage names an image; the policy
// comes from the init request.
func (i *Installer) installWebhook(ctx context.Context, kubeconfigPath string, job *initcluster.Job) error {
	image := i.cfg.WebhookImage
	if image == "" {
		fmt.Fprintln(job.Out, "[berth] image-policy webhook not installed: no webhook image configured (--webhook-image)")
		return nil
	}
	kube, dyn, err := clients(kubeconfigPath)
	if err != nil {
		return err
	}
	w := NewWebhookInstaller(WebhookConfig{Image: image, ImagePullPolicy: i.cfg.ImagePullPolicy, Policy: job.Req.ImagePolicy}, kube, dyn, job.Out)
	_, err = w.Install(ctx)
	return err
}

func (w *WebhookInstaller) say(format string, args ...any) {
	elapsed := ""
	if !w.started.IsZero() {
		elapsed = fmt.Sprintf(" (+%.1fs)", time.Since(w.started).Seconds())
	}
	fmt.Fprintf(w.out, "[berth] webhook%s: "+format+"\n", append([]any{elapsed}, args...)...)
}

// Install runs B1–B10: API ready, backend applied (only what differs), Deployment available, every
// ready endpoint passes a TLS probe against the CA bundle about to be published, then the
// configuration is armed for the canary namespace, proven end to end through the API server, and
// widened. A re-run on a healthy cluster writes nothing. Every error wraps an ErrWebhook* category.
func (w *WebhookInstaller) Install(ctx context.Context) (WebhookResult, error) {
	w.result = WebhookResult{}
	w.started = time.Now()
	if w.cfg.Image == "" {
		return w.result, failure(ErrWebhookInvalidConfiguration, "name the berth-webhook image", "no image")
	}
	if _, err := webhook.ParsePolicy(w.cfg.Policy); err != nil {
		return w.result, failure(ErrWebhookInvalidConfiguration, "fix the image policy", "%v", err)
	}
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Budget)
	defer cancel()
	if err := w.waitAPI(ctx); err != nil {
		return w.result, err
	}
	caPEM, err := w.ensureBackend(ctx)
	if err != nil {
		return w.result, err
	}
	endpoints, err := w.waitServing(ctx, caPEM)
	if err != nil {
		return w.result, err
	}
	w.result.ProbedEndpoints = endpoints
	if err := w.arm(ctx, caPEM); err != nil {
		return w.result, err
	}
	if err := w.finishCARotation(ctx); err != nil {
		return w.result, err
	}
	w.say("enforcing (%d writes in this run)", len(w.result.Writes))
	return w.result, nil
}

// retry calls f with exponential, jittered backoff capped at MaxBackoff until it returns done or ctx
// ends; it returns f's last error.
func (w *WebhookInstaller) retry(ctx context.Context, f func() (done bool, err error)) error {
	return w.retryCapped(ctx, w.cfg.MaxBackoff, f)
}

// readyPoll caps the backoff while waiting for the webhook's own pods: the checks are two GETs and a
// list, and a long sleep right when the pods turn ready is what the operator would wait for.
const readyPoll = 2 * time.Second

func (w *WebhookInstaller) retryCapped(ctx context.Context, maxWait time.Duration, f func() (done bool, err error)) error {
	wait := 200 * time.Millisecond
	for {
		done, err := f()
		if done {
			return err
		}
		jittered := wait/2 + mathrand.N(wait/2+1)
		select {
		case <-ctx.Done():
			if err == nil {
				err = ctx.Err()
			}
			return err
		case <-time.After(jittered):
		}
		wait = min(wait*2, maxWait)
	}
}

func (w *WebhookInstaller) waitAPI(ctx context.Context) error {
	err := w.retry(ctx, func() (bool, error) {
		pctx, cancel := context.WithTimeout(ctx, w.cfg.ProbeTimeout)
		defer cancel()
		body, err := w.kube.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(pctx)
		if err == nil && string(body) == "ok" {
			return true, nil
		}
		return false, fmt.Errorf("readyz: %q %v", body, err)
	})
	if err != nil {
		return failure(ErrWebhookAPINotReady, "check the control plane (kube-apiserver, etcd) and retry", "%v", err)
	}
	return nil
}

// --- backend (B2–B4) ---

var webhookGVRs = map[string]schema.GroupVersionResource{
	"Namespace":                      {Version: "v1", Resource: "namespaces"},
	"ServiceAccount":                 {Version: "v1", Resource: "serviceaccounts"},
	"ConfigMap":                      {Version: "v1", Resource: "configmaps"},
	"Secret":                         {Version: "v1", Resource: "secrets"},
	"Service":                        {Version: "v1", Resource: "services"},
	"Deployment":                     {Group: "apps", Version: "v1", Resource: "deployments"},
	"PodDisruptionBudget":            {Group: "policy", Version: "v1", Resource: "poddisruptionbudgets"},
	"ValidatingWebhookConfiguration": {Group: "admissionregistration.k8s.io", Version: "v1", Resource: "validatingwebhookconfigurations"},
}

func (w *WebhookInstaller) resource(obj *unstructured.Unstructured) dynamic.ResourceInterface {
	gvr := webhookGVRs[obj.GetKind()]
	if ns := obj.GetNamespace(); ns != "" {
		return w.dyn.Resource(gvr).Namespace(ns)
	}
	return w.dyn.Resource(gvr)
}

// get returns the live object, or nil when it does not exist.
func (w *WebhookInstaller) get(ctx context.Context, obj *unstructured.Unstructured) (*unstructured.Unstructured, error) {
	live, err := w.resource(obj).Get(ctx, obj.GetName(), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s %s: %w", obj.GetKind(), obj.GetName(), err)
	}
	return live, nil
}

// ensure applies obj unless the live object already holds every field of it (observe, diff, apply).
func (w *WebhookInstaller) ensure(ctx context.Context, obj *unstructured.Unstructured) error {
	obj = normalize(obj)
	live, err := w.get(ctx, obj)
	if err != nil {
		return failure(ErrWebhookApply, "check the API server and retry", "%v", err)
	}
	if live != nil && contains(live.Object, obj.Object) {
		return nil
	}
	if err := w.Apply(ctx, obj); err != nil {
		return failure(ErrWebhookApply, "check the API server and the object, then retry", "%v", err)
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

func (w *WebhookInstaller) ensureBackend(ctx context.Context) ([]byte, error) {
	ns := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "Namespace",
		"metadata": map[string]any{"name": Namespace, "labels": map[string]any{"app.kubernetes.io/part-of": "berth"}},
	}}
	if live, err := w.get(ctx, ns); err != nil {
		return nil, failure(ErrWebhookApply, "check the API server and retry", "%v", err)
	} else if live == nil {
		if err := w.ensure(ctx, ns); err != nil {
			return nil, err
		}
	}
	if err := w.waitNotTerminating(ctx, WebhookCanaryNamespace); err != nil {
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
func (w *WebhookInstaller) waitNotTerminating(ctx context.Context, name string) error {
	err := w.retry(ctx, func() (bool, error) {
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
		return failure(ErrWebhookApply, "check what keeps the namespace from being deleted (kubectl get namespace "+name+" -o yaml)", "%v", err)
	}
	return nil
}

func webhookLabels() map[string]any {
	return map[string]any{"app.kubernetes.io/name": WebhookName, "app.kubernetes.io/part-of": "berth", managedByLabel: apply.FieldManager}
}

func obj(m map[string]any) *unstructured.Unstructured { return &unstructured.Unstructured{Object: m} }

func (w *WebhookInstaller) canaryNamespace() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "Namespace",
		"metadata": map[string]any{"name": WebhookCanaryNamespace, "labels": webhookLabels()}})
}

func (w *WebhookInstaller) canaryServiceAccount() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": false,
		"metadata": map[string]any{"name": "berth-webhook-canary", "namespace": WebhookCanaryNamespace, "labels": webhookLabels()}})
}

func (w *WebhookInstaller) serviceAccount() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "ServiceAccount", "automountServiceAccountToken": false,
		"metadata": map[string]any{"name": WebhookName, "namespace": Namespace, "labels": webhookLabels()}})
}

func (w *WebhookInstaller) policyConfigMap() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": WebhookPolicyConfigMap, "namespace": Namespace, "labels": webhookLabels()},
		"data":     map[string]any{"policy.yaml": string(w.cfg.Policy)}})
}

func (w *WebhookInstaller) service() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "v1", "kind": "Service",
		"metadata": map[string]any{"name": WebhookName, "namespace": Namespace, "labels": webhookLabels()},
		"spec": map[string]any{
			"selector": map[string]any{"app.kubernetes.io/name": WebhookName},
			"ports":    []any{map[string]any{"name": "https", "port": 443, "targetPort": webhookPort, "protocol": "TCP"}},
		}})
}

func (w *WebhookInstaller) exemptNamespaces() []string {
	ns := []string{"kube-system", "kube-node-lease", "kube-public", Namespace}
	for _, n := range w.cfg.ExemptNamespaces {
		if !slices.Contains(ns, n) {
			ns = append(ns, n)
		}
	}
	return ns
}

func (w *WebhookInstaller) deployment() *unstructured.Unstructured {
	labels := webhookLabels()
	// W8: the handler answers one second before the API server would give up.
	handlerDeadline := time.Duration(w.cfg.TimeoutSeconds-1) * time.Second
	if w.cfg.TimeoutSeconds <= 1 {
		handlerDeadline = 500 * time.Millisecond
	}
	grace := int((webhookShutdownDelay + time.Duration(w.cfg.TimeoutSeconds)*time.Second).Seconds()) + 15
	httpProbe := func(path string, period, failures int) map[string]any {
		return map[string]any{
			"httpGet":       map[string]any{"path": path, "port": webhookProbePort, "scheme": "HTTP"},
			"periodSeconds": period, "timeoutSeconds": 2, "failureThreshold": failures, "successThreshold": 1,
		}
	}
	return obj(map[string]any{"apiVersion": "apps/v1", "kind": "Deployment",
		"metadata": map[string]any{"name": WebhookName, "namespace": Namespace, "labels": labels},
		"spec": map[string]any{
			"replicas": w.cfg.Replicas,
			"selector": map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": WebhookName}},
			"strategy": map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": 0, "maxSurge": 1}},
			"template": map[string]any{
				"metadata": map[string]any{"labels": labels},
				"spec": map[string]any{
					"serviceAccountName":            WebhookName,
					"automountServiceAccountToken":  false,
					"priorityClassName":             "system-cluster-critical",
					"terminationGracePeriodSeconds": grace,
					"tolerations": []any{
						map[string]any{"key": controlPlaneLabel, "operator": "Exists", "effect": "NoSchedule"},
					},
					"topologySpreadConstraints": []any{map[string]any{
						"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
						"labelSelector": map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": WebhookName}},
					}},
					"securityContext": map[string]any{"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
					"containers": []any{map[string]any{
						"name":            "webhook",
						"image":           w.cfg.Image,
						"imagePullPolicy": w.cfg.ImagePullPolicy,
						"args": []any{
							fmt.Sprintf("--listen=:%d", webhookPort),
							fmt.Sprintf("--probe-listen=:%d", webhookProbePort),
							"--cert-file=/etc/berth-webhook/tls/tls.crt",
							"--key-file=/etc/berth-webhook/tls/tls.key",
							"--policy-file=/etc/berth-webhook/policy/policy.yaml",
							"--shutdown-delay=" + webhookShutdownDelay.String(),
							"--handler-deadline=" + handlerDeadline.String(),
							"--exempt-namespaces=" + strings.Join(w.exemptNamespaces(), ","),
						},
						"env": []any{map[string]any{"name": "POD_NAMESPACE", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "metadata.namespace"}}}},
						"ports": []any{
							map[string]any{"name": "https", "containerPort": webhookPort, "protocol": "TCP"},
							map[string]any{"name": "probes", "containerPort": webhookProbePort, "protocol": "TCP"},
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
							"secretName": WebhookTLSSecret, "defaultMode": 0o440,
							// The CA key stays in the Secret; the pods get only their keypair.
							"items": []any{
								map[string]any{"key": "tls.crt", "path": "tls.crt"},
								map[string]any{"key": "tls.key", "path": "tls.key"},
							},
						}},
						map[string]any{"name": "policy", "configMap": map[string]any{"name": WebhookPolicyConfigMap}},
					},
				},
			},
		}})
}

func (w *WebhookInstaller) pdb() *unstructured.Unstructured {
	return obj(map[string]any{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
		"metadata": map[string]any{"name": WebhookName, "namespace": Namespace, "labels": webhookLabels()},
		"spec": map[string]any{
			"maxUnavailable": 1,
			"selector":       map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": WebhookName}},
		}})
}

// --- certificates (B3) ---

func serviceDNSNames() []string {
	return []string{WebhookName, WebhookName + "." + Namespace, WebhookName + "." + Namespace + ".svc", WebhookName + "." + Namespace + ".svc.cluster.local"}
}

func serverName() string { return WebhookName + "." + Namespace + ".svc" }

// tlsMaterial is what Secret berth-webhook-tls holds: the current CA (it signs the leaf), the
// serving keypair, and the CA bundle the webhook configuration publishes. The bundle is the CA alone,
// except during a CA rotation, when it also holds the previous CA.
type tlsMaterial struct {
	caPEM, caKeyPEM, certPEM, keyPEM, bundlePEM []byte
}

func (m tlsMaterial) secret() *unstructured.Unstructured {
	b64 := base64.StdEncoding.EncodeToString
	return obj(map[string]any{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
		"metadata": map[string]any{"name": WebhookTLSSecret, "namespace": Namespace, "labels": webhookLabels()},
		"data": map[string]any{
			"ca.crt": b64(m.caPEM), "ca.key": b64(m.caKeyPEM), "tls.crt": b64(m.certPEM), "tls.key": b64(m.keyPEM),
			"ca-bundle.crt": b64(m.bundlePEM),
		}})
}

// rotating reports whether the bundle still holds a CA besides the current one.
func (m tlsMaterial) rotating() bool {
	cas, err1 := pemcerts.Parse(m.caPEM)
	bundle, err2 := pemcerts.Parse(m.bundlePEM)
	if err1 != nil || err2 != nil {
		return false
	}
	return slices.ContainsFunc(bundle, func(c *x509.Certificate) bool { return !c.Equal(cas[0]) })
}

func (w *WebhookInstaller) readTLS(ctx context.Context) (tlsMaterial, error) {
	existing, err := w.kube.CoreV1().Secrets(Namespace).Get(ctx, WebhookTLSSecret, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return tlsMaterial{}, nil
	}
	if err != nil {
		return tlsMaterial{}, failure(ErrWebhookApply, "check the API server and retry", "reading Secret %s: %v", WebhookTLSSecret, err)
	}
	d := existing.Data
	return tlsMaterial{caPEM: d["ca.crt"], caKeyPEM: d["ca.key"], certPEM: d["tls.crt"], keyPEM: d["tls.key"], bundlePEM: d["ca-bundle.crt"]}, nil
}

// tlsSecret returns the TLS Secret to apply and the CA bundle to publish (B3, W6).
func (w *WebhookInstaller) tlsSecret(ctx context.Context) (*unstructured.Unstructured, []byte, error) {
	cur, err := w.readTLS(ctx)
	if err != nil {
		return nil, nil, err
	}
	next, err := planTLS(cur, w.cfg.Now(), w.cfg.CARenewBefore, w.say)
	if err != nil {
		return nil, nil, failure(ErrWebhookApply, "retry", "%v", err)
	}
	return next.secret(), next.bundlePEM, nil
}

// planTLS decides this run's TLS material from the Secret's (B3, W6). A re-run never regenerates
// what is still good. The CA and the leaf are never replaced in one step:
//   - no usable CA: a new CA and leaf, the bundle is the new CA (nothing depends on the old one);
//   - the CA is due (less than renewBefore left) and no rotation is under way: a new CA joins the
//     bundle next to the old one, and the leaf stays; it is switched on a later step, once the
//     bundle is published;
//   - the leaf is missing, due (2/3 of its life) or not signed by the current CA: a new leaf from
//     the current CA. The bundle still holds every CA that can have signed a served leaf.
//
// Certificates in the bundle that have expired are dropped.
func planTLS(cur tlsMaterial, now time.Time, renewBefore time.Duration, say func(string, ...any)) (tlsMaterial, error) {
	next := cur
	ca, caKey, caOK := parseCA(cur.caPEM, cur.caKeyPEM, now)
	var bundle []*x509.Certificate
	if certs, err := pemcerts.Parse(cur.bundlePEM); err == nil {
		for _, c := range certs {
			if now.Before(c.NotAfter) {
				bundle = append(bundle, c)
			}
		}
	}
	// While the bundle still holds an older CA, the rotation under way is finished before another
	// can start: the new CA's leaf must be published against a bundle that holds it.
	inRotation := caOK && slices.ContainsFunc(bundle, func(c *x509.Certificate) bool { return !c.Equal(ca) })
	switch {
	case !caOK:
		var err error
		if ca, caKey, next.caPEM, next.caKeyPEM, err = newCA(now); err != nil {
			return tlsMaterial{}, fmt.Errorf("creating the webhook CA: %w", err)
		}
		next.certPEM, next.keyPEM = nil, nil
		bundle = nil
		say("created a new webhook CA")
	case !inRotation && now.Add(renewBefore).After(ca.NotAfter):
		old := ca
		var err error
		if ca, caKey, next.caPEM, next.caKeyPEM, err = newCA(now); err != nil {
			return tlsMaterial{}, fmt.Errorf("creating the webhook CA: %w", err)
		}
		if !containsCert(bundle, old) {
			bundle = append(bundle, old)
		}
		say("CA rotation: a new CA joins the bundle; the old one (expires %s) stays until no endpoint serves a certificate it signed", old.NotAfter.Format(time.DateOnly))
		if leafValid(cur.certPEM, cur.keyPEM, old, now) {
			// The leaf follows once the bundle with both CAs is in place (finishCARotation).
			next.bundlePEM = encodeBundle(append(bundle, ca))
			return next, nil
		}
	}
	if !leafValid(next.certPEM, next.keyPEM, ca, now) {
		var err error
		if next.certPEM, next.keyPEM, err = newLeaf(ca, caKey, now); err != nil {
			return tlsMaterial{}, fmt.Errorf("issuing the webhook serving certificate: %w", err)
		}
		say("issued a new webhook serving certificate")
	}
	if !containsCert(bundle, ca) {
		bundle = append(bundle, ca)
	}
	next.bundlePEM = encodeBundle(bundle)
	return next, nil
}

func containsCert(certs []*x509.Certificate, c *x509.Certificate) bool {
	return slices.ContainsFunc(certs, func(x *x509.Certificate) bool { return x.Equal(c) })
}

func encodeBundle(certs []*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}

// finishCARotation completes a CA rotation that the armed bundle now allows (W6 steps 3 and 4): it
// switches the leaf to the new CA, waits until every endpoint serves a leaf that the new CA alone
// verifies (the pods read the Secret's files), and only then drops the old CA from the bundle,
// checking enforcement end to end. Without a rotation under way it does nothing.
func (w *WebhookInstaller) finishCARotation(ctx context.Context) error {
	cur, err := w.readTLS(ctx)
	if err != nil || !cur.rotating() {
		return err
	}
	next, err := planTLS(cur, w.cfg.Now(), w.cfg.CARenewBefore, w.say)
	if err != nil {
		return failure(ErrWebhookApply, "retry", "%v", err)
	}
	if err := w.ensure(ctx, next.secret()); err != nil {
		return err
	}
	w.say("CA rotation: waiting for every endpoint to serve the certificate of the new CA")
	if _, err := w.waitServing(ctx, next.caPEM); err != nil {
		return err
	}
	next.bundlePEM = next.caPEM
	if err := w.ensure(ctx, next.secret()); err != nil {
		return err
	}
	if err := w.arm(ctx, next.caPEM); err != nil {
		return err
	}
	w.say("CA rotation done: the bundle holds only the new CA")
	return nil
}

const (
	caLifetime   = 10 * 365 * 24 * time.Hour
	leafLifetime = 365 * 24 * time.Hour
)

func parseCA(certPEM, keyPEM []byte, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, bool) {
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, nil, false
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil || !ca.IsCA {
		return nil, nil, false
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil || !key.PublicKey.Equal(ca.PublicKey) {
		return nil, nil, false
	}
	if now.Before(ca.NotBefore) || !now.Before(ca.NotAfter) {
		return nil, nil, false
	}
	return ca, key, true
}

// leafValid: the pair matches, chains to ca for the service name, and is not past 2/3 of its life.
func leafValid(certPEM, keyPEM []byte, ca *x509.Certificate, now time.Time) bool {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return false
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return false
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: serverName(), CurrentTime: now}); err != nil {
		return false
	}
	renewAt := leaf.NotBefore.Add(leaf.NotAfter.Sub(leaf.NotBefore) * 2 / 3)
	return now.Before(renewAt)
}

func serial() (*big.Int, error) { return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127)) }

func newCA(now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, []byte, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn, Subject: pkix.Name{CommonName: "berth-webhook-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(caLifetime),
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	return ca, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}

func newLeaf(ca *x509.Certificate, caKey *ecdsa.PrivateKey, now time.Time) ([]byte, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn, Subject: pkix.Name{CommonName: serverName()},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(leafLifetime),
		DNSNames: serviceDNSNames(), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}

// --- readiness of the backend (B5, B6) ---

// waitServing waits until the Deployment is available, the Service has enough ready endpoints and
// every one of them passes StablePasses consecutive TLS probe rounds; it returns the endpoints.
func (w *WebhookInstaller) waitServing(ctx context.Context, caPEM []byte) ([]string, error) {
	var last *WebhookError
	var endpoints []string
	// One attempt is a whole streak of StablePasses rounds, StableInterval apart; a failed round ends
	// the attempt, and only then does the backoff apply.
	err := w.retryCapped(ctx, min(w.cfg.MaxBackoff, readyPoll), func() (bool, error) {
		for passes := 0; ; {
			var err *WebhookError
			endpoints, err = w.readyEndpoints(ctx)
			if err == nil {
				err = w.probeAll(ctx, caPEM, endpoints)
			}
			if err != nil {
				if last == nil || last.Error() != err.Error() {
					w.say("waiting: %v", err)
				}
				last = err
				return false, err
			}
			if passes++; passes >= w.cfg.StablePasses {
				return true, nil
			}
			select {
			case <-ctx.Done():
				return true, ctx.Err()
			case <-time.After(w.cfg.StableInterval):
			}
		}
	})
	if err != nil {
		if last == nil {
			last = failure(ErrWebhookNoReadyEndpoints, "check the berth-webhook pods (kubectl -n berth-system get pods)", "%v", err)
		}
		last.Detail += " (no webhook configuration was created or changed)"
		return nil, last
	}
	w.say("%d endpoints served the expected certificate and answers %d times in a row: %s", len(endpoints), w.cfg.StablePasses, strings.Join(endpoints, " "))
	return endpoints, nil
}

func (w *WebhookInstaller) readyEndpoints(ctx context.Context) ([]string, *WebhookError) {
	dep, err := w.kube.AppsV1().Deployments(Namespace).Get(ctx, WebhookName, metav1.GetOptions{})
	if err != nil {
		return nil, failure(ErrWebhookDeploymentNotReady, "check the Deployment berth-system/berth-webhook", "%v", err)
	}
	if !deploymentAvailable(dep, w.cfg.Replicas) {
		return nil, failure(ErrWebhookDeploymentNotReady, "check the berth-webhook pods, their image and their readiness (kubectl -n berth-system describe pods)",
			"generation %d observed %d, %d updated, %d available of %d", dep.Generation, dep.Status.ObservedGeneration, dep.Status.UpdatedReplicas, dep.Status.AvailableReplicas, w.cfg.Replicas)
	}
	svc, err := w.kube.CoreV1().Services(Namespace).Get(ctx, WebhookName, metav1.GetOptions{})
	if err != nil {
		return nil, failure(ErrWebhookServiceMissing, "re-run the install; it applies the Service", "%v", err)
	}
	list, err := w.kube.DiscoveryV1().EndpointSlices(Namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + WebhookName})
	if err != nil {
		return nil, failure(ErrWebhookNoReadyEndpoints, "check the API server", "listing EndpointSlices: %v", err)
	}
	eps := readyAddresses(list.Items)
	if w.cfg.ProbeServiceIP && svc.Spec.ClusterIP != "" && svc.Spec.ClusterIP != corev1.ClusterIPNone {
		eps = append(eps, net.JoinHostPort(svc.Spec.ClusterIP, "443"))
	}
	if len(readyAddresses(list.Items)) < w.cfg.Replicas {
		return nil, failure(ErrWebhookNoReadyEndpoints, "check the berth-webhook pods' readiness (/readyz on port 8081)",
			"%d ready endpoints, want %d", len(readyAddresses(list.Items)), w.cfg.Replicas)
	}
	return eps, nil
}

func deploymentAvailable(d *appsv1.Deployment, replicas int) bool {
	if d.Status.ObservedGeneration < d.Generation || int(d.Status.UpdatedReplicas) < replicas || int(d.Status.AvailableReplicas) < replicas {
		return false
	}
	for _, c := range d.Status.Conditions {
		if c.Type == appsv1.DeploymentAvailable {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// readyAddresses returns IP:port of every endpoint that is ready and not terminating, sorted.
func readyAddresses(items []discoveryv1.EndpointSlice) []string {
	var out []string
	for _, s := range items {
		port := int32(webhookPort)
		for _, p := range s.Ports {
			if p.Name != nil && *p.Name == "https" && p.Port != nil {
				port = *p.Port
			}
		}
		for _, e := range s.Endpoints {
			if e.Conditions.Ready == nil || !*e.Conditions.Ready || (e.Conditions.Terminating != nil && *e.Conditions.Terminating) {
				continue
			}
			for _, a := range e.Addresses {
				out = append(out, net.JoinHostPort(a, strconv.Itoa(int(port))))
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Canary images: one the policy denies and one it allows.
const canaryDeniedImage = "canary.invalid/berth-webhook-canary:v1"

func (w *WebhookInstaller) canaryAllowedImage() string {
	p, err := webhook.ParsePolicy(w.cfg.Policy)
	if err != nil || len(p.Rules) == 0 {
		return ""
	}
	img := p.Rules[0].Registries[0] + "/berth-webhook-canary:v1"
	if p.Rules[0].RequireDigest {
		img += "@sha256:" + strings.Repeat("0", 64)
	}
	return img
}

func (w *WebhookInstaller) probeAll(ctx context.Context, caPEM []byte, endpoints []string) *WebhookError {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return failure(ErrWebhookTLSMismatch, "delete Secret berth-system/berth-webhook-tls and re-run", "the CA bundle holds no certificate")
	}
	for _, ep := range endpoints {
		if err := w.probe(ctx, roots, ep); err != nil {
			return err
		}
	}
	return nil
}

// probe sends a denied and an allowed synthetic review to one endpoint over TLS verified with exactly
// the CA bundle that will be published, with the Service's DNS name.
func (w *WebhookInstaller) probe(ctx context.Context, roots *x509.CertPool, endpoint string) *WebhookError {
	tr := &http.Transport{
		DisableKeepAlives: true,
		TLSClientConfig:   &tls.Config{RootCAs: roots, ServerName: serverName(), MinVersion: tls.VersionTLS12},
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: w.cfg.ProbeTimeout}
	cases := []struct {
		image string
		allow bool
	}{{canaryDeniedImage, false}}
	if allowed := w.canaryAllowedImage(); allowed != "" {
		cases = append(cases, struct {
			image string
			allow bool
		}{allowed, true})
	}
	for n, c := range cases {
		uid := types.UID(fmt.Sprintf("berth-install-probe-%d-%d", time.Now().UnixNano(), n))
		body, _ := json.Marshal(probeReview(uid, c.image))
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+endpoint+webhook.Path, bytes.NewReader(body))
		if err != nil {
			return failure(ErrWebhookWrongResponse, "report a bug", "%v", err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			var unknown x509.UnknownAuthorityError
			var hostname x509.HostnameError
			var verify *tls.CertificateVerificationError
			if errors.As(err, &unknown) || errors.As(err, &hostname) || errors.As(err, &verify) {
				return failure(ErrWebhookTLSMismatch, "the pods serve an old or foreign certificate: wait for the Secret to reach them or restart the Deployment", "%s: %v", endpoint, err)
			}
			return failure(ErrWebhookNoReadyEndpoints, "check that this host reaches the pod network (CNI, routes)", "%s: %v", endpoint, err)
		}
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return failure(ErrWebhookWrongResponse, "check the webhook's logs", "%s: HTTP %d: %s", endpoint, resp.StatusCode, bytes.TrimSpace(data))
		}
		var out admissionv1.AdmissionReview
		if err := json.Unmarshal(data, &out); err != nil || out.Response == nil {
			return failure(ErrWebhookWrongResponse, "check the webhook's image and logs", "%s: not an admission review: %v", endpoint, err)
		}
		if out.Response.UID != uid {
			return failure(ErrWebhookWrongResponse, "check the webhook's image", "%s: UID %q, want %q", endpoint, out.Response.UID, uid)
		}
		if out.Response.Allowed != c.allow {
			msg := ""
			if out.Response.Result != nil {
				msg = out.Response.Result.Message
			}
			return failure(ErrWebhookWrongResponse, "check the image policy in ConfigMap berth-system/berth-webhook-policy", "%s: image %s allowed=%v (%s), want allowed=%v", endpoint, c.image, out.Response.Allowed, msg, c.allow)
		}
	}
	return nil
}

func canaryPod(name, image string) *corev1.Pod {
	f := false
	return &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: WebhookCanaryNamespace},
		Spec: corev1.PodSpec{
			ServiceAccountName: "berth-webhook-canary", AutomountServiceAccountToken: &f,
			Containers: []corev1.Container{{Name: "canary", Image: image}},
		},
	}
}

func probeReview(uid types.UID, image string) *admissionv1.AdmissionReview {
	raw, _ := json.Marshal(canaryPod("berth-install-probe", image))
	return &admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID: uid, Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
			Name:     "berth-install-probe", Namespace: WebhookCanaryNamespace, Operation: admissionv1.Create,
			Object: runtime.RawExtension{Raw: raw},
		},
	}
}

// --- arming (B7, B9, B10) ---

// ValidatingWebhookConfiguration returns the configuration: the final one, or with canaryOnly the
// first stage, which matches only the canary namespace.
func (w *WebhookInstaller) ValidatingWebhookConfiguration(caPEM []byte, canaryOnly bool) *unstructured.Unstructured {
	selector := map[string]any{"matchExpressions": []any{map[string]any{
		"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": toAny(w.exemptNamespaces()),
	}}}
	if canaryOnly {
		selector = map[string]any{"matchExpressions": []any{map[string]any{
			"key": "kubernetes.io/metadata.name", "operator": "In", "values": []any{WebhookCanaryNamespace},
		}}}
	}
	rule := func(group string, resources ...string) map[string]any {
		return map[string]any{
			"apiGroups": []any{group}, "apiVersions": []any{"v1"}, "operations": []any{"CREATE", "UPDATE"},
			"resources": toAny(resources), "scope": "Namespaced",
		}
	}
	return normalize(obj(map[string]any{
		"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
		"metadata": map[string]any{"name": WebhookConfigName, "labels": webhookLabels()},
		"webhooks": []any{map[string]any{
			"name":                    WebhookHookName,
			"admissionReviewVersions": []any{"v1"},
			"sideEffects":             "None",
			"timeoutSeconds":          w.cfg.TimeoutSeconds,
			"failurePolicy":           "Fail",
			"matchPolicy":             "Equivalent",
			"clientConfig": map[string]any{
				"caBundle": base64.StdEncoding.EncodeToString(caPEM),
				"service":  map[string]any{"name": WebhookName, "namespace": Namespace, "path": webhook.Path, "port": 443},
			},
			"rules": []any{
				rule("", "pods", "pods/ephemeralcontainers", "replicationcontrollers"),
				rule("apps", "deployments", "replicasets", "statefulsets", "daemonsets"),
				rule("batch", "jobs", "cronjobs"),
			},
			"namespaceSelector": selector,
			"objectSelector":    map[string]any{},
			// Evaluated by the API server, so they hold with every webhook pod gone. Null-safe:
			// oldObject is null on CREATE, and an evaluation error would reject under Fail.
			"matchConditions": []any{
				map[string]any{"name": "not-terminating", "expression": "oldObject == null || !has(oldObject.metadata.deletionTimestamp)"},
				map[string]any{"name": "not-node-lease-csr", "expression": "!(request.resource.resource in ['nodes', 'leases', 'certificatesigningrequests', 'events', 'namespaces'])"},
				map[string]any{"name": "not-a-node", "expression": "!has(request.userInfo.groups) || !('system:nodes' in request.userInfo.groups)"},
			},
		}},
	}))
}

func toAny(s []string) []any {
	out := make([]any, len(s))
	for n, v := range s {
		out[n] = v
	}
	return out
}

func (w *WebhookInstaller) vwcs() dynamic.ResourceInterface {
	return w.dyn.Resource(webhookGVRs["ValidatingWebhookConfiguration"])
}

func (w *WebhookInstaller) arm(ctx context.Context, caPEM []byte) error {
	final := w.ValidatingWebhookConfiguration(caPEM, false)
	live, err := w.get(ctx, final)
	if err != nil {
		return failure(ErrWebhookApply, "check the API server and retry", "%v", err)
	}
	if live != nil && live.GetAnnotations()[WebhookPausedAnnotation] == "true" {
		w.say("configuration %s is paused by the operator (annotation %s): left alone", WebhookConfigName, WebhookPausedAnnotation)
		return nil
	}
	if live != nil && contains(live.Object, final.Object) {
		// Already armed: prove it end to end (dry-run, no write) and stop.
		return w.endToEnd(ctx)
	}
	if live != nil && contains(live.Object, withBundleOf(final, live).Object) {
		// Armed, and only the CA bundle changes (a rotation step): narrowing to the canary namespace
		// would stop enforcement elsewhere for a moment, so swap the bundle in place and prove it.
		return w.armStage(ctx, final, live)
	}
	// Stage 1: only the canary namespace. Stage 2: everything but the exempt namespaces.
	if err := w.armStage(ctx, w.ValidatingWebhookConfiguration(caPEM, true), live); err != nil {
		return err
	}
	return w.armStage(ctx, final, live)
}

// armStage applies cfg and proves it end to end; when either fails it restores live, or deletes the
// configuration when there was none: never leave a fail-closed configuration the check did not pass.
func (w *WebhookInstaller) armStage(ctx context.Context, cfg, live *unstructured.Unstructured) error {
	if err := w.applyConfig(ctx, cfg); err != nil {
		w.rollback(ctx, live)
		return err
	}
	if err := w.endToEnd(ctx); err != nil {
		w.rollback(ctx, live)
		return err
	}
	return nil
}

// withBundleOf returns a copy of cfg whose webhooks carry the CA bundles of live's.
func withBundleOf(cfg, live *unstructured.Unstructured) *unstructured.Unstructured {
	out := cfg.DeepCopy()
	liveHooks, _, _ := unstructured.NestedSlice(live.Object, "webhooks")
	hooks, _, _ := unstructured.NestedSlice(out.Object, "webhooks")
	for n := range hooks {
		if n >= len(liveHooks) {
			break
		}
		bundle, _, _ := unstructured.NestedString(liveHooks[n].(map[string]any), "clientConfig", "caBundle")
		_ = unstructured.SetNestedField(hooks[n].(map[string]any), bundle, "clientConfig", "caBundle")
	}
	_ = unstructured.SetNestedSlice(out.Object, hooks, "webhooks")
	return out
}

func (w *WebhookInstaller) applyConfig(ctx context.Context, cfg *unstructured.Unstructured) error {
	if err := w.Apply(ctx, cfg); err != nil {
		return failure(ErrWebhookApply, "check the API server and retry", "%v", err)
	}
	stage := "armed for every namespace but the exempt ones"
	if sel, _, _ := unstructured.NestedSlice(cfg.Object, "webhooks"); len(sel) > 0 {
		if ms, _, _ := unstructured.NestedSlice(sel[0].(map[string]any), "namespaceSelector", "matchExpressions"); len(ms) > 0 && ms[0].(map[string]any)["operator"] == "In" {
			stage = "armed for the canary namespace " + WebhookCanaryNamespace
		}
	}
	w.result.Writes = append(w.result.Writes, "apply ValidatingWebhookConfiguration "+cfg.GetName())
	w.say("configuration %s %s", cfg.GetName(), stage)
	return nil
}

// rollback restores the configuration as it was before this run, or deletes it when there was none:
// never leave a fail-closed configuration pointing at a backend that failed its check.
func (w *WebhookInstaller) rollback(ctx context.Context, previous *unstructured.Unstructured) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if previous == nil {
		err := w.vwcs().Delete(ctx, WebhookConfigName, metav1.DeleteOptions{})
		if apierrors.IsNotFound(err) {
			return // nothing was created
		}
		if err != nil {
			w.say("rolling back: deleting configuration %s failed: %v; delete it by hand", WebhookConfigName, err)
			return
		}
		w.result.Writes = append(w.result.Writes, "delete ValidatingWebhookConfiguration "+WebhookConfigName)
		w.say("rolled back: configuration %s deleted", WebhookConfigName)
		return
	}
	restored := obj(map[string]any{
		"apiVersion": previous.GetAPIVersion(), "kind": previous.GetKind(),
		"metadata": map[string]any{"name": previous.GetName(), "labels": toAnyMap(previous.GetLabels())},
		"webhooks": previous.Object["webhooks"],
	})
	if err := w.Apply(ctx, restored); err != nil {
		w.say("rolling back: restoring configuration %s failed: %v", WebhookConfigName, err)
		return
	}
	w.result.Writes = append(w.result.Writes, "apply ValidatingWebhookConfiguration "+WebhookConfigName+" (rollback)")
	w.say("rolled back: configuration %s restored", WebhookConfigName)
}

func toAnyMap(m map[string]string) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// endToEnd proves through the API server that the webhook is invoked: a server-side dry-run create of
// a pod with a denied image in the canary namespace must be denied by the webhook naming a rule, and
// one with an allowed image must be admitted. The configuration may take a moment to reach the API
// server's webhook cache, so "not invoked" is retried for a few seconds.
func (w *WebhookInstaller) endToEnd(ctx context.Context) error {
	pods := w.kube.CoreV1().Pods(WebhookCanaryNamespace)
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldManager: apply.FieldManager}
	var last *WebhookError
	deadline := time.Now().Add(w.cfg.EndToEndWindow)
	for {
		last = nil
		_, err := pods.Create(ctx, canaryPod("berth-webhook-canary-denied", canaryDeniedImage), dry)
		switch {
		case err == nil:
			last = failure(ErrWebhookConfigNotHonored, "check that the API server reaches the webhook (kube-apiserver logs, the configuration's namespaceSelector)",
				"a dry-run pod with image %s in namespace %s was admitted", canaryDeniedImage, WebhookCanaryNamespace)
		case strings.Contains(err.Error(), "failed calling webhook"):
			last = failure(ErrWebhookCallFailed, "check the route from the API server to the webhook pods and the CA bundle", "%v", err)
		case !strings.Contains(err.Error(), WebhookHookName) || !strings.Contains(err.Error(), "image policy rule"):
			last = failure(ErrWebhookConfigNotHonored, "check the admission chain of the API server", "the dry-run pod was rejected, but not by the webhook: %v", err)
		}
		if last == nil {
			if allowed := w.canaryAllowedImage(); allowed != "" {
				if _, err := pods.Create(ctx, canaryPod("berth-webhook-canary-allowed", allowed), dry); err != nil {
					last = failure(ErrWebhookUnexpectedDenial, "check the image policy and the webhook's logs", "a dry-run pod with image %s was rejected: %v", allowed, err)
				}
			}
		}
		if last == nil {
			w.say("end-to-end check passed: the API server sent the canary pods to the webhook")
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return last
		}
		select {
		case <-ctx.Done():
			return last
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// Uninstall removes the configuration first and confirms it is gone, then the backend (B13).
func (w *WebhookInstaller) Uninstall(ctx context.Context) error {
	if err := w.vwcs().Delete(ctx, WebhookConfigName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting configuration %s: %w", WebhookConfigName, err)
	}
	err := w.retry(ctx, func() (bool, error) {
		_, err := w.vwcs().Get(ctx, WebhookConfigName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, fmt.Errorf("configuration %s still there: %v", WebhookConfigName, err)
	})
	if err != nil {
		return err
	}
	for _, o := range []*unstructured.Unstructured{w.deployment(), w.pdb(), w.service(), w.policyConfigMap(),
		obj(map[string]any{"apiVersion": "v1", "kind": "Secret", "metadata": map[string]any{"name": WebhookTLSSecret, "namespace": Namespace}}),
		w.serviceAccount(), w.canaryNamespace()} {
		if err := w.resource(o).Delete(ctx, o.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return nil
}
