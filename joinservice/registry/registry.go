// Package registry is the joinservice's view of the cluster's machine record (package machines,
// ConfigMap berth-machines): it watches the record, tells the join server from that cache whether a
// machine is known and whether an operator removed it, and writes the machines the joinservice admits.
//
// Lookups never reach the API server: they read the watched copy, so a join costs one map lookup
// for its revocation check. Until the first copy is read (Synced) every lookup fails with
// ErrNotSynced, and the server refuses joins rather than admit a removed machine.
//
// Admissions are queued without blocking (at most QueueSize distinct machines; more are dropped and
// counted, the next join of such a machine queues it again) and written every FlushInterval in one
// read-modify-write, so a scale-up of many nodes costs a few writes a second, and a machine already
// in the record costs none. A failed write keeps the queue and is retried with a backoff.
package registry

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/machines"
)

// Limits and intervals.
const (
	// QueueSize bounds the machines waiting to be written.
	QueueSize = 4096
	// FlushInterval is how often queued admissions are written.
	FlushInterval = 500 * time.Millisecond
	// retryInitial and retryCap bound the wait before retrying a failed write; it doubles per failure.
	retryInitial = 250 * time.Millisecond
	retryCap     = 10 * time.Second
)

// ErrNotSynced is returned by Lookup before the record was first read.
var ErrNotSynced = errors.New("the machine record has not been read yet")

// Registry watches the machine record and writes admissions. Lookup, Admit and Removals are safe
// for concurrent use; Run must be running for them to see the record and for admissions to be written.
type Registry struct {
	client    kubernetes.Interface
	namespace string
	log       *zap.Logger

	mu         sync.RWMutex
	byIdentity map[string]machines.Machine
	order      []string
	synced     atomic.Bool

	qmu     sync.Mutex
	queue   map[string]machines.Machine
	dropped atomic.Uint64

	// onChange, if set, gets every record the watch reads (OnChange).
	onChange func([]machines.Machine)
}

// OnChange makes the registry hand every record the watch reads to f (the record writer copies
// removals onto the record API's Machines). f must return at once; call OnChange before Run.
func (r *Registry) OnChange(f func([]machines.Machine)) { r.onChange = f }

// New returns a Registry of the record in namespace.
func New(client kubernetes.Interface, namespace string, log *zap.Logger) *Registry {
	if log == nil {
		log = zap.NewNop()
	}
	return &Registry{client: client, namespace: namespace, log: log, byIdentity: map[string]machines.Machine{}, queue: map[string]machines.Machine{}}
}

// Synced reports whether the record was read at least once.
func (r *Registry) Synced() bool { return r.synced.Load() }

// Lookup returns the recorded machine with identity and whether there is one.
func (r *Registry) Lookup(identity string) (machines.Machine, bool, error) {
	if !r.Synced() {
		return machines.Machine{}, false, ErrNotSynced
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	m, ok := r.byIdentity[identity]
	return m, ok, nil
}

// Machines returns the record as last read, in its order.
func (r *Registry) Machines() []machines.Machine {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]machines.Machine, 0, len(r.order))
	for _, id := range r.order {
		out = append(out, r.byIdentity[id])
	}
	return out
}

// Admit queues m to be recorded unless the record holds its identity already. It never blocks, and
// never changes a recorded machine (a removed one stays removed).
func (r *Registry) Admit(m machines.Machine) {
	r.mu.RLock()
	_, known := r.byIdentity[m.Identity]
	r.mu.RUnlock()
	if known {
		return
	}
	r.qmu.Lock()
	defer r.qmu.Unlock()
	if _, queued := r.queue[m.Identity]; queued {
		return
	}
	if len(r.queue) >= QueueSize {
		r.dropped.Add(1)
		return
	}
	r.queue[m.Identity] = m
}

// Dropped returns how many admissions were not queued because the queue was full.
func (r *Registry) Dropped() uint64 { return r.dropped.Load() }

// Removals returns the control planes whose removal waits for their etcd member to be removed.
func (r *Registry) Removals() []machines.Machine {
	var out []machines.Machine
	for _, m := range r.Machines() {
		if m.Removal != nil && m.Removal.Etcd == machines.EtcdPending {
			out = append(out, m)
		}
	}
	return out
}

// SetEtcd records where the etcd member removal of the removed machine with identity stands. It
// changes nothing when the machine is no longer removed (re-admitted) or its removal is no longer
// pending (another replica was first).
func (r *Registry) SetEtcd(ctx context.Context, identity string, state machines.EtcdState, message string) error {
	_, err := machines.Update(ctx, r.client, r.namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
		i := machines.Index(ms, identity)
		if i < 0 || ms[i].Removal == nil || ms[i].Removal.Etcd != machines.EtcdPending {
			return nil, machines.ErrUnchanged
		}
		if state == machines.EtcdPending && ms[i].Removal.EtcdMessage == message {
			return nil, machines.ErrUnchanged
		}
		removal := *ms[i].Removal
		removal.Etcd, removal.EtcdMessage = state, message
		ms[i].Removal = &removal
		return ms, nil
	})
	if err != nil {
		return fmt.Errorf("recording the etcd member removal: %w", err)
	}
	return nil
}

// Run watches the record and writes queued admissions until ctx ends. It returns nil then.
func (r *Registry) Run(ctx context.Context) error {
	factory := informers.NewSharedInformerFactoryWithOptions(r.client, 0, informers.WithNamespace(r.namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", machines.ConfigMapName).String()
		}))
	inf := factory.Core().V1().ConfigMaps().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { r.load(obj) },
		UpdateFunc: func(_, obj any) { r.load(obj) },
		DeleteFunc: func(any) { r.set(nil) },
	}); err != nil {
		return fmt.Errorf("watching the machine record: %w", err)
	}
	// Every return below comes after ctx ended, which stops the informer Shutdown waits for.
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil // ctx ended
	}
	r.synced.Store(true)
	r.log.Info("machine record synced", zap.Int("machines", len(r.Machines())))
	r.writeLoop(ctx)
	return nil
}

// load replaces the cache with the record in obj, a ConfigMap. An unreadable record keeps the cache.
func (r *Registry) load(obj any) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok {
		return
	}
	ms, err := machines.Decode(cm.Data[machines.DataKey])
	if err != nil {
		r.log.Error("unreadable machine record: keeping the last one read", zap.Error(err))
		return
	}
	r.set(ms)
}

func (r *Registry) set(ms []machines.Machine) {
	by := make(map[string]machines.Machine, len(ms))
	order := make([]string, 0, len(ms))
	for _, m := range ms {
		if _, dup := by[m.Identity]; !dup {
			order = append(order, m.Identity)
		}
		by[m.Identity] = m
	}
	r.mu.Lock()
	r.byIdentity, r.order = by, order
	r.mu.Unlock()
	if r.onChange != nil {
		r.onChange(ms)
	}
}

// retryBackoff is the wait before each retry of a failed write: retryInitial, doubling up to retryCap.
func retryBackoff() wait.Backoff {
	return wait.Backoff{Duration: retryInitial, Factor: 2, Cap: retryCap, Steps: math.MaxInt32}
}

// writeLoop writes the queue every FlushInterval until ctx ends.
func (r *Registry) writeLoop(ctx context.Context) {
	t := time.NewTicker(FlushInterval)
	defer t.Stop()
	retry, notBefore := retryBackoff(), time.Time{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if time.Now().Before(notBefore) {
			continue
		}
		if err := r.flush(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			r.log.Warn("writing the machine record", zap.Error(err))
			notBefore = time.Now().Add(retry.Step())
			continue
		}
		retry, notBefore = retryBackoff(), time.Time{}
	}
}

// flush writes what is queued; the queue keeps what was not written.
func (r *Registry) flush(ctx context.Context) error {
	r.qmu.Lock()
	batch := make([]machines.Machine, 0, len(r.queue))
	for _, m := range r.queue {
		batch = append(batch, m)
	}
	r.qmu.Unlock()
	if len(batch) == 0 {
		return nil
	}
	slices.SortFunc(batch, func(a, b machines.Machine) int { return a.Admitted.Compare(b.Admitted) })
	_, err := machines.Update(ctx, r.client, r.namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
		ms, added := machines.Admit(ms, batch...)
		if !added {
			return nil, machines.ErrUnchanged
		}
		return ms, nil
	})
	if err != nil {
		return err
	}
	r.qmu.Lock()
	for _, m := range batch {
		delete(r.queue, m.Identity)
	}
	r.qmu.Unlock()
	// The cache learns the write from the watch, never from here: a newer write (a removal) may have
	// reached it already.
	return nil
}
