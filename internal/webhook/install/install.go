// Package install installs the image-policy webhook (internal/webhook) into a cluster and arms it
// only once it verifiably serves. One run goes through these steps, each in its own file:
//
//   - objects.go: the backend (canary namespace, ServiceAccount, policy ConfigMap, TLS Secret,
//     Service, Deployment, PodDisruptionBudget) is applied, only what differs from the live objects;
//   - tls.go: the TLS Secret's CA and serving certificate, reused while good, renewed and rotated in
//     steps that never replace CA and leaf together;
//   - ready.go: the API server answers; the Deployment is available and every ready endpoint passes
//     a TLS probe against the CA bundle about to be published, several rounds in a row;
//   - arm.go: the ValidatingWebhookConfiguration is armed for the canary namespace, proven end to end
//     through the API server, then widened; a failed check rolls it back.
//
// A re-run on a healthy cluster writes nothing. Reconcile is the same run after a restart of the node
// that initialized the cluster, with the policy the cluster holds.
//
// After the install, the Keeper (keep.go) owns the trust chain for the cluster's whole life: the
// same steps, run by the joinservice's certificate keeper on whichever control plane holds its
// lease, writing only the TLS Secret and the configuration's caBundle. lifetimes.go holds the
// validity periods (ConfigMap berth-webhook-certificates) and when each certificate is renewed.
package install

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/webhook"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// Failure categories of the install. Every error Install returns wraps one of them.
var (
	ErrAPINotReady          = errors.New("API server not ready")
	ErrApply                = errors.New("applying the webhook's objects failed")
	ErrServiceMissing       = errors.New("webhook Service missing")
	ErrDeploymentNotReady   = errors.New("webhook Deployment not available")
	ErrNoReadyEndpoints     = errors.New("no ready webhook endpoints")
	ErrTLSMismatch          = errors.New("webhook serves a certificate the CA bundle does not verify")
	ErrWrongResponse        = errors.New("webhook gave a wrong answer to a probe review")
	ErrConfigNotHonored     = errors.New("webhook configuration not honored (webhook not invoked)")
	ErrCallFailed           = errors.New("API server failed calling the webhook")
	ErrUnexpectedDenial     = errors.New("webhook denied an allowed canary pod")
	ErrInvalidConfiguration = errors.New("invalid webhook install configuration")
)

// Error is an install failure: a category (one of the Err* errors), what happened and what to do.
type Error struct {
	Category error
	Detail   string
	Hint     string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%v: %s; %s", e.Category, e.Detail, e.Hint)
}

// Unwrap returns the category.
func (e *Error) Unwrap() error { return e.Category }

func failure(category error, hint, format string, args ...any) *Error {
	return &Error{Category: category, Detail: fmt.Sprintf(format, args...), Hint: hint}
}

// Config configures the install.
type Config struct {
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
	// Lifetimes are the validity periods of the CA and the serving certificate and when each is
	// renewed; zero periods take their defaults (a year and ten years).
	Lifetimes Lifetimes
	// Now is the clock (default time.Now).
	Now func() time.Time
}

func (c *Config) defaults() {
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
	c.Lifetimes = c.Lifetimes.WithDefaults()
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Result reports what an install changed.
type Result struct {
	// Writes lists every write ("apply Kind name", "delete Kind name"); empty on a no-op re-run.
	Writes []string
	// ProbedEndpoints are the endpoints that passed the TLS probe.
	ProbedEndpoints []string
}

// Installer installs the image-policy webhook and arms it only once it verifiably serves.
type Installer struct {
	cfg     Config
	kube    kubernetes.Interface
	objects *apply.Applier
	out     io.Writer
	result  Result
	// started is when the running Install began; progress lines say how long ago.
	started time.Time
	// keep makes this installer the keeper of an installed webhook (keep.go): it writes only the TLS
	// Secret (on the resourceVersion it read) and the configuration's caBundle, and it needs one
	// ready endpoint instead of every replica.
	keep bool
	// What the run changed in the TLS Secret: a new leaf, a new CA, a finished CA rotation.
	leafRenewed, caRenewed, rotationDone bool
	// checking is the bundle the keeper's end-to-end check expects the configuration to publish.
	checking []byte
	// rotationLocked says whether a keeper with a rotation lock holds it in this pass; lockless
	// says that it has none (the installer, or a keeper built without one).
	rotationLocked, lockless bool
	// unlock gives the rotation lock back.
	unlock func()
}

// mayRotate reports whether this run may change which CA the API servers must trust: always for the
// installer, for a keeper only while it holds its rotation lock.
func (w *Installer) mayRotate() bool { return !w.keep || w.lockless || w.rotationLocked }

// New returns an installer using the given clients; progress goes to out.
func New(cfg Config, kube kubernetes.Interface, dyn dynamic.Interface, out io.Writer) *Installer {
	cfg.defaults()
	return &Installer{cfg: cfg, kube: kube, objects: apply.New(dyn, kube.Discovery()), out: out}
}

// NewFromKubeconfig returns an installer for the cluster named by the kubeconfig at path.
func NewFromKubeconfig(cfg Config, kubeconfigPath string, out io.Writer) (*Installer, error) {
	kube, dyn, err := apply.ClientsFromKubeconfig(kubeconfigPath)
	if err != nil {
		return nil, err
	}
	return New(cfg, kube, dyn, out), nil
}

func (w *Installer) say(format string, args ...any) {
	elapsed := ""
	if !w.started.IsZero() {
		elapsed = fmt.Sprintf(" (+%.1fs)", time.Since(w.started).Seconds())
	}
	_, _ = fmt.Fprintf(w.out, "[berth] webhook%s: "+format+"\n", append([]any{elapsed}, args...)...)
}

// Install waits for the API server, applies the backend (only what differs), waits until the
// Deployment is available and every ready endpoint passes a TLS probe against the CA bundle about to
// be published, then arms the configuration for the canary namespace, proves it end to end through
// the API server, and widens it; a CA rotation under way is finished last. A re-run on a healthy
// cluster writes nothing. Every error wraps an Err* category.
func (w *Installer) Install(ctx context.Context) (Result, error) {
	w.result = Result{}
	w.started = time.Now()
	if w.cfg.Image == "" {
		return w.result, failure(ErrInvalidConfiguration, "name the berth-webhook image", "no image")
	}
	if _, err := webhook.ParsePolicy(w.cfg.Policy); err != nil {
		return w.result, failure(ErrInvalidConfiguration, "fix the image policy", "%v", err)
	}
	if err := w.cfg.Lifetimes.Validate(); err != nil {
		return w.result, failure(ErrInvalidConfiguration, "fix the certificate validity periods", "%v", err)
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

// RestartBudget bounds the webhook check after the daemon restarts on an initialized control plane:
// after a power cut of every node the API server, the pod network and the webhook pods all have to
// come back first.
const RestartBudget = 10 * time.Minute

// Reconcile runs after the daemon restarts on the node that initialized the cluster. It never
// disarms anything: it waits for the webhook to serve again, probes every endpoint against the
// published CA, proves enforcement end to end, and repairs only what differs (a deleted
// configuration, a changed caBundle) once those checks pass. On a healthy cluster it writes
// nothing. The image policy is the one in the cluster (ConfigMap berth-webhook-policy), and the
// whole check has RestartBudget; cfg gives the image and its pull policy. Without an image nothing
// was installed and there is nothing to check. Progress goes to out.
func Reconcile(ctx context.Context, cfg Config, kubeconfigPath string, out io.Writer) error {
	if cfg.Image == "" {
		return nil
	}
	kube, dyn, err := apply.ClientsFromKubeconfig(kubeconfigPath)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, RestartBudget)
	defer cancel()
	policy, err := clusterPolicy(ctx, kube)
	if err != nil {
		return err
	}
	cfg.Policy, cfg.Budget = policy, RestartBudget
	_, err = New(cfg, kube, dyn, out).Install(ctx)
	return err
}

// The policy read after a restart retries while the API server is not up: first after 500 ms, then
// twice as long each time, at most policyMaxWait.
const (
	policyFirstWait = 500 * time.Millisecond
	policyMaxWait   = 5 * time.Second
)

// clusterPolicy reads the image policy from its ConfigMap, retrying while the API server is not up.
func clusterPolicy(ctx context.Context, kube kubernetes.Interface) ([]byte, error) {
	backoff := wait.Backoff{Duration: policyFirstWait, Factor: 2, Steps: maxSteps, Cap: policyMaxWait}
	for {
		cm, err := kube.CoreV1().ConfigMaps(namespace).Get(ctx, webhookconfig.PolicyConfigMap, metav1.GetOptions{})
		switch {
		case err == nil:
			p, ok := cm.Data["policy.yaml"]
			if !ok {
				return nil, failure(ErrInvalidConfiguration, "restore the policy (key policy.yaml) in ConfigMap "+namespace+"/"+webhookconfig.PolicyConfigMap, "the ConfigMap has no policy.yaml")
			}
			return []byte(p), nil
		case apierrors.IsNotFound(err):
			return nil, failure(ErrInvalidConfiguration, "restore ConfigMap "+namespace+"/"+webhookconfig.PolicyConfigMap+" or re-install the webhook", "the image policy ConfigMap is gone")
		}
		select {
		case <-ctx.Done():
			return nil, failure(ErrAPINotReady, "check that the control plane came back", "reading the image policy: %v", err)
		case <-time.After(backoff.Step()):
		}
	}
}

// maxSteps keeps a wait.Backoff growing until its cap (and then at the cap) instead of running out.
const maxSteps = math.MaxInt32

// The installer's retries wait between half of a nominal wait and all of it; the nominal wait starts
// at retryFirstWait and doubles up to a cap (Config.MaxBackoff, or readyPoll).
const retryFirstWait = 200 * time.Millisecond

// retryBackoff is the backoff of the installer's retries with the nominal wait capped at maxWait.
func retryBackoff(maxWait time.Duration) wait.Backoff {
	// Jitter 1 on half the nominal wait gives a wait between half of it and all of it.
	return wait.Backoff{Duration: retryFirstWait / 2, Factor: 2, Jitter: 1, Steps: maxSteps, Cap: maxWait / 2}
}

// retry calls f with exponential, jittered backoff (the nominal wait capped at maxWait) until it
// returns done or ctx ends; it returns f's last error, or ctx's when f had none.
func retry(ctx context.Context, maxWait time.Duration, f func() (done bool, err error)) error {
	backoff := retryBackoff(maxWait)
	for {
		done, err := f()
		if done {
			return err
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = ctx.Err()
			}
			return err
		case <-time.After(backoff.Step()):
		}
	}
}
