package install

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/webhook"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// Readiness: the API server answers, the Deployment is available, and every ready endpoint answers
// probe reviews correctly over TLS verified with the CA bundle about to be published.

// readyPoll caps the backoff while waiting for the webhook's own pods: the checks are two GETs and a
// list, and a long sleep right when the pods turn ready is what the operator would wait for.
const readyPoll = 2 * time.Second

func (w *Installer) waitAPI(ctx context.Context) error {
	err := retry(ctx, w.cfg.MaxBackoff, func() (bool, error) {
		pctx, cancel := context.WithTimeout(ctx, w.cfg.ProbeTimeout)
		defer cancel()
		body, err := w.kube.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(pctx)
		if err == nil && string(body) == "ok" {
			return true, nil
		}
		if err != nil {
			return false, fmt.Errorf("readyz: %q %w", body, err)
		}
		return false, fmt.Errorf("readyz: %q", body)
	})
	if err != nil {
		return failure(ErrAPINotReady, "check the control plane (kube-apiserver, etcd) and retry", "%v", err)
	}
	return nil
}

// waitServing waits until the Deployment is available, the Service has enough ready endpoints and
// every one of them passes StablePasses consecutive TLS probe rounds; it returns the endpoints.
func (w *Installer) waitServing(ctx context.Context, caPEM []byte) ([]string, error) {
	var last *Error
	var endpoints []string
	// One attempt is a whole streak of StablePasses rounds, StableInterval apart; a failed round ends
	// the attempt, and only then does the backoff apply.
	err := retry(ctx, min(w.cfg.MaxBackoff, readyPoll), func() (bool, error) {
		passes, failed := 0, false
		err := wait.PollUntilContextCancel(ctx, w.cfg.StableInterval, true, func(context.Context) (bool, error) {
			var err *Error
			endpoints, err = w.readyEndpoints(ctx)
			if err == nil {
				err = w.probeAll(ctx, caPEM, endpoints)
			}
			if err != nil && last != nil && ctx.Err() != nil {
				// The budget cut this round's request short: that says nothing about the webhook,
				// so the failure stays what the last complete round saw.
				return false, last
			}
			if err != nil {
				if last == nil || last.Error() != err.Error() {
					w.say("waiting: %v", err)
				}
				last, failed = err, true
				return false, err
			}
			passes++
			return passes >= w.cfg.StablePasses, nil
		})
		// A streak cut short by ctx is done: retry would only wait for ctx again.
		return !failed, err
	})
	if err != nil {
		if last == nil {
			last = failure(ErrNoReadyEndpoints, "check the berth-webhook pods (kubectl -n berth-system get pods)", "%v", err)
		}
		last.Detail += " (no webhook configuration was created or changed)"
		return nil, last
	}
	w.say("%d endpoints served the expected certificate and answers %d times in a row: %s", len(endpoints), w.cfg.StablePasses, strings.Join(endpoints, " "))
	return endpoints, nil
}

// readyEndpoints returns the endpoints to probe. The installer waits for the whole Deployment; the
// keeper needs one ready endpoint: it probes every endpoint the API server may call, and a pod that
// starts later mounts the Secret as it is then.
func (w *Installer) readyEndpoints(ctx context.Context) ([]string, *Error) {
	minReady := 1
	if !w.keep {
		if err := w.deploymentReady(ctx); err != nil {
			return nil, err
		}
		minReady = w.cfg.Replicas
	}
	svc, err := w.kube.CoreV1().Services(namespace).Get(ctx, webhookconfig.Name, metav1.GetOptions{})
	if err != nil {
		return nil, failure(ErrServiceMissing, "re-run the install; it applies the Service", "%v", err)
	}
	list, err := w.kube.DiscoveryV1().EndpointSlices(namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + webhookconfig.Name})
	if err != nil {
		return nil, failure(ErrNoReadyEndpoints, "check the API server", "listing EndpointSlices: %v", err)
	}
	eps := readyAddresses(list.Items)
	if w.cfg.ProbeServiceIP && svc.Spec.ClusterIP != "" && svc.Spec.ClusterIP != corev1.ClusterIPNone {
		eps = append(eps, net.JoinHostPort(svc.Spec.ClusterIP, "443"))
	}
	if len(readyAddresses(list.Items)) < minReady {
		return nil, failure(ErrNoReadyEndpoints, "check the berth-webhook pods' readiness (/readyz on port 8081)",
			"%d ready endpoints, want %d", len(readyAddresses(list.Items)), minReady)
	}
	return eps, nil
}

func (w *Installer) deploymentReady(ctx context.Context) *Error {
	dep, err := w.kube.AppsV1().Deployments(namespace).Get(ctx, webhookconfig.Name, metav1.GetOptions{})
	if err != nil {
		return failure(ErrDeploymentNotReady, "check the Deployment berth-system/berth-webhook", "%v", err)
	}
	if !deploymentAvailable(dep, w.cfg.Replicas) {
		return failure(ErrDeploymentNotReady, "check the berth-webhook pods, their image and their readiness (kubectl -n berth-system describe pods)",
			"generation %d observed %d, %d updated, %d available of %d", dep.Generation, dep.Status.ObservedGeneration, dep.Status.UpdatedReplicas, dep.Status.AvailableReplicas, w.cfg.Replicas)
	}
	return nil
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
		port := int32(servingPort)
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

func (w *Installer) canaryAllowedImage() string {
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

func (w *Installer) probeAll(ctx context.Context, caPEM []byte, endpoints []string) *Error {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return failure(ErrTLSMismatch, "delete Secret berth-system/berth-webhook-tls and re-run", "the CA bundle holds no certificate")
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
func (w *Installer) probe(ctx context.Context, roots *x509.CertPool, endpoint string) *Error {
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
			return failure(ErrWrongResponse, "report a bug", "%v", err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			var unknown x509.UnknownAuthorityError
			var hostname x509.HostnameError
			var verify *tls.CertificateVerificationError
			if errors.As(err, &unknown) || errors.As(err, &hostname) || errors.As(err, &verify) {
				return failure(ErrTLSMismatch, "the pods serve an old or foreign certificate: wait for the Secret to reach them or restart the Deployment", "%s: %v", endpoint, err)
			}
			return failure(ErrNoReadyEndpoints, "check that this host reaches the pod network (CNI, routes)", "%s: %v", endpoint, err)
		}
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return failure(ErrWrongResponse, "check the webhook's logs", "%s: HTTP %d: %s", endpoint, resp.StatusCode, bytes.TrimSpace(data))
		}
		var out admissionv1.AdmissionReview
		if err := json.Unmarshal(data, &out); err != nil || out.Response == nil {
			return failure(ErrWrongResponse, "check the webhook's image and logs", "%s: not an admission review: %v", endpoint, err)
		}
		if out.Response.UID != uid {
			return failure(ErrWrongResponse, "check the webhook's image", "%s: UID %q, want %q", endpoint, out.Response.UID, uid)
		}
		if out.Response.Allowed != c.allow {
			msg := ""
			if out.Response.Result != nil {
				msg = out.Response.Result.Message
			}
			return failure(ErrWrongResponse, "check the image policy in ConfigMap berth-system/berth-webhook-policy", "%s: image %s allowed=%v (%s), want allowed=%v", endpoint, c.image, out.Response.Allowed, msg, c.allow)
		}
	}
	return nil
}

func canaryPod(name, image string) *corev1.Pod {
	f := false
	return &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: webhookconfig.CanaryNamespace},
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
			Name:     "berth-install-probe", Namespace: webhookconfig.CanaryNamespace, Operation: admissionv1.Create,
			Object: runtime.RawExtension{Raw: raw},
		},
	}
}
