// Package policywatch hot-reloads the cluster's attestation policy: it watches ConfigMap
// berth-join-config (key attestationPolicy) with an informer and swaps the policy the joinservice
// judges measurements by, together with the validator its attested TLS handshakes use, in one atomic
// step.
//
// An update is applied only when it parses, names this joinservice's attestation variant and yields a
// validator of the same kind (with or without key activation); otherwise it is refused, the policy in
// force stays, and a Warning Event PolicyRejected on the ConfigMap says why. An applied update gets a
// Normal Event PolicyApplied. A handshake or a check that started before a swap finishes with the
// policy it started with; everything after the swap uses the new one. A deleted ConfigMap keeps the
// policy in force.
package policywatch

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/joinservice/server"
)

// ErrRefused wraps every reason an update is not applied.
var ErrRefused = errors.New("policy update refused")

// BuildValidator makes the handshake validator for a policy (server.NewHandshakeValidator).
type BuildValidator func(p *policy.Policy) (atls.Validator, error)

type state struct {
	policy    *policy.Policy
	validator atls.Validator
	text      string
}

// Holder is the policy in force and its handshake validator.
type Holder struct {
	variant    string
	challenger bool
	build      BuildValidator
	origin     string
	cur        atomic.Pointer[state]
	mu         sync.Mutex // serializes Update
}

// NewHolder parses policyYAML (origin names it in messages) for variant and builds its validator.
func NewHolder(variant, origin, policyYAML string, build BuildValidator) (*Holder, error) {
	h := &Holder{variant: variant, build: build, origin: origin}
	st, err := h.parse(policyYAML)
	if err != nil {
		return nil, err
	}
	_, h.challenger = st.validator.(atls.Challenger)
	h.cur.Store(st)
	return h, nil
}

func (h *Holder) parse(text string) (*state, error) {
	p, err := policy.Parse([]byte(text), h.origin, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	if p.Variant != h.variant {
		return nil, fmt.Errorf("%w: the policy is for variant %q, this joinservice attests and validates %q", ErrRefused, p.Variant, h.variant)
	}
	v, err := h.build(p)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	return &state{policy: p, validator: v, text: text}, nil
}

// Update applies policyYAML, or returns an error wrapping ErrRefused and keeps the policy in force.
// It reports whether anything changed (false for the text in force).
func (h *Holder) Update(policyYAML string) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cur.Load().text == policyYAML {
		return false, nil
	}
	st, err := h.parse(policyYAML)
	if err != nil {
		return false, err
	}
	if _, ok := st.validator.(atls.Challenger); ok != h.challenger {
		return false, fmt.Errorf("%w: its validator differs in key activation from the one in force", ErrRefused)
	}
	h.cur.Store(st)
	return true, nil
}

// Policy returns the policy in force.
func (h *Holder) Policy() *policy.Policy { return h.cur.Load().policy }

// Check judges the peer's measurements against the policy in force (server.PolicyCheck).
func (h *Holder) Check(ctx context.Context) ([]string, error) {
	return server.PolicyCheck(h.cur.Load().policy)(ctx)
}

// Validator returns the handshake validator that always delegates to the one in force. It is an
// atls.Challenger when the initial validator is.
func (h *Holder) Validator() atls.Validator {
	if h.challenger {
		return challengingValidator{swappingValidator{h}}
	}
	return swappingValidator{h}
}

type swappingValidator struct{ h *Holder }

func (v swappingValidator) Variant() string { return v.h.variant }

func (v swappingValidator) Validate(ctx context.Context, doc, nonce []byte) (attestation.Result, error) {
	return v.h.cur.Load().validator.Validate(ctx, doc, nonce)
}

type challengingValidator struct{ swappingValidator }

func (v challengingValidator) Challenge(identity []byte) ([]byte, []byte, func(ctx context.Context, doc, nonce []byte) (attestation.Result, error), error) {
	ch, ok := v.h.cur.Load().validator.(atls.Challenger)
	if !ok {
		return nil, nil, nil, errors.New("the validator in force cannot challenge")
	}
	return ch.Challenge(identity)
}

// ReloadObserver counts reloads (metrics.Metrics).
type ReloadObserver interface {
	PolicyReload(applied bool)
}

// Watcher feeds ConfigMap updates into a Holder.
type Watcher struct {
	client    kubernetes.Interface
	namespace string
	name      string
	replica   string
	holder    *Holder
	obs       ReloadObserver
	log       *zap.Logger
	eventSeq  atomic.Uint64
	synced    chan struct{}
	// syncErr is the last error listing or watching the ConfigMap before the first sync.
	syncErr atomic.Pointer[error]
}

// NewWatcher watches ConfigMap namespace/name for holder. obs may be nil.
func NewWatcher(client kubernetes.Interface, namespace, name, replica string, holder *Holder, obs ReloadObserver, log *zap.Logger) *Watcher {
	if log == nil {
		log = zap.NewNop()
	}
	return &Watcher{client: client, namespace: namespace, name: name, replica: replica, holder: holder, obs: obs, log: log,
		synced: make(chan struct{})}
}

// Synced is closed once Run's informer has listed the ConfigMap: from then on every update reaches
// the policy. It stays open while listing fails (the joinservice's RBAC, say); SyncError says why.
func (w *Watcher) Synced() <-chan struct{} { return w.synced }

// SyncError returns the last error listing or watching the ConfigMap before the first sync, or nil.
func (w *Watcher) SyncError() error {
	if err := w.syncErr.Load(); err != nil {
		return *err
	}
	return nil
}

// Run watches until ctx ends and returns nil then; its informer's goroutines have ended when it returns.
func (w *Watcher) Run(ctx context.Context) error {
	factory := informers.NewSharedInformerFactoryWithOptions(w.client, 0,
		informers.WithNamespace(w.namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", w.name).String()
		}))
	inf := factory.Core().V1().ConfigMaps().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { w.handle(ctx, obj) },
		UpdateFunc: func(_, obj any) { w.handle(ctx, obj) },
		DeleteFunc: func(any) {
			w.log.Warn("join configuration deleted: keeping the policy in force", zap.String("configMap", w.name))
		},
	}); err != nil {
		return fmt.Errorf("watching join configuration: %w", err)
	}
	if err := inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, r *cache.Reflector, err error) {
		cache.DefaultWatchErrorHandler(ctx, r, err)
		select {
		case <-w.synced:
		default:
			w.syncErr.Store(&err)
		}
	}); err != nil {
		return fmt.Errorf("watching join configuration: %w", err)
	}
	factory.Start(ctx.Done())
	if cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		close(w.synced)
	}
	<-ctx.Done()
	factory.Shutdown()
	return nil
}

func (w *Watcher) handle(ctx context.Context, obj any) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok {
		return
	}
	text, present := cm.Data[joinconfig.KeyAttestationPolicy]
	var changed bool
	var err error
	if !present {
		err = fmt.Errorf("%w: the ConfigMap has no key %s", ErrRefused, joinconfig.KeyAttestationPolicy)
	} else {
		changed, err = w.holder.Update(text)
	}
	if err != nil {
		w.log.Warn("attestation policy update refused", zap.String("resourceVersion", cm.ResourceVersion), zap.Error(err))
		if w.obs != nil {
			w.obs.PolicyReload(false)
		}
		w.event(ctx, cm, corev1.EventTypeWarning, "PolicyRejected",
			fmt.Sprintf("attestation policy update (resourceVersion %s) refused, the previous policy stays in force: %v", cm.ResourceVersion, err))
		return
	}
	if !changed {
		return
	}
	w.log.Info("attestation policy applied", zap.String("resourceVersion", cm.ResourceVersion))
	if w.obs != nil {
		w.obs.PolicyReload(true)
	}
	w.event(ctx, cm, corev1.EventTypeNormal, "PolicyApplied",
		fmt.Sprintf("attestation policy (resourceVersion %s) in force on %s", cm.ResourceVersion, w.replica))
}

func (w *Watcher) event(ctx context.Context, cm *corev1.ConfigMap, typ, reason, msg string) {
	if len(msg) > 1024 {
		msg = msg[:1024] + "..."
	}
	now := metav1.NewTime(time.Now())
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("%s.%x.%x", cm.Name, now.UnixNano(), w.eventSeq.Add(1)),
			Namespace: cm.Namespace,
		},
		InvolvedObject: corev1.ObjectReference{
			Kind: "ConfigMap", APIVersion: "v1", Namespace: cm.Namespace, Name: cm.Name, UID: cm.UID, ResourceVersion: cm.ResourceVersion,
		},
		Reason: reason, Message: msg, Type: typ,
		Source:         corev1.EventSource{Component: "berth-joinservice", Host: w.replica},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: "berth.dev/joinservice", ReportingInstance: w.replica,
	}
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if _, err := w.client.CoreV1().Events(cm.Namespace).Create(ectx, ev, metav1.CreateOptions{}); err != nil {
		w.log.Warn("creating policy event", zap.Error(err))
	}
}
