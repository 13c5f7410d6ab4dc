// Package ledger is the joinservice's join ledger: every join attempt, accepted or rejected, visible
// from the cluster.
//
// Each attempt becomes an Entry (time, peer address, attested node name if known, claimed role, the
// state disk UUID a ticket call named, SHA-256 of the peer's attestation document, outcome, reason
// code and message). A Writer publishes entries in
// two places in the joinservice's namespace:
//   - ConfigMap berth-join-ledger, key entries.json: the newest Capacity entries of all joinservice
//     replicas, oldest first. Replicas write it with optimistic concurrency (get, merge, update with
//     the read resourceVersion, retry on conflict), so concurrent batches from several replicas never
//     overwrite each other's entries. The format is package joinledger's; `berth status` reads it
//     with joinledger.Read.
//   - Events whose involved object is that ConfigMap: JoinRejected (Warning) and JoinAccepted (Normal),
//     rejections first, at most EventsPerSecond per replica (burst EventBurst); what does not fit is
//     summarised in one JoinAttemptsNotShown Event per batch, so that a flood of attempts cannot turn
//     into an Event flood.
//
// The writer never blocks or fails a join: Record puts an accepted entry into a bounded queue
// (QueueSize) and counts it as dropped when the queue is full. One goroutine (Run) drains the queue
// continuously and writes what it collected every FlushInterval, so one replica updates the ConfigMap
// at most twice a second whatever the load (each update is a full copy of the object in etcd until
// compaction). After writing a full batch (a flood: Capacity entries within one interval) it waits
// FloodInterval before the next write, so a sustained flood rewrites the ~130 KB object every 5 s
// rather than twice a second (make bench-join's 10-minute run grew etcd's memory by 135 MB at twice a
// second). A failed write keeps the batch and retries with backoff.
//
// The ledger keeps its evidence (joinledger's kinds and quotas). Refusals are not queued one by one:
// Record (for a refusal), RecordCounted and RecordRateLimited aggregate them per kind, peer, RPC, node,
// reason and disk UUID, in tables bounded per kind (an unverified flood cannot crowd out the evidence of
// attested peers), and each flush writes one entry per key with Count; the ConfigMap aggregates them
// further across flushes (joinledger.Merge). What a batch or the ConfigMap cannot keep is chosen by
// kind (joinledger.Keep): accepted joins and cryptographic failures are never evicted by unverified
// refusals. Entries a batch could not keep are counted as superseded (Superseded); their Events and
// metrics are unaffected.
package ledger

import (
	"context"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/configmapkey"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
)

// Limits.
const (
	// Capacity is how many entries the ConfigMap keeps (joinledger's).
	Capacity = joinledger.Capacity
	// QueueSize bounds the accepted entries waiting to be written.
	QueueSize = 4096
	// FlushInterval is how often collected entries are written.
	FlushInterval = 500 * time.Millisecond
	// FloodInterval is the wait after writing a full batch (Capacity entries) before the next write.
	FloodInterval = 5 * time.Second
	// EventsPerSecond and EventBurst bound the Events one replica creates.
	EventsPerSecond = 5
	EventBurst      = 20
	// maxMessage bounds an entry's message.
	maxMessage = 400
	// maxCounted bounds the refusals aggregated between flushes, per kind.
	maxCounted = 1024
	// retryInitial and retryCap bound the wait before retrying a failed write; it doubles per failure.
	retryInitial = 250 * time.Millisecond
	retryCap     = 10 * time.Second
	// shutdownFlushTimeout bounds the last write when Run stops.
	shutdownFlushTimeout = 5 * time.Second
)

// conflictAttempts bounds the get-merge-update rounds of one flush; they follow each other at once.
var conflictAttempts = wait.Backoff{Steps: 8}

// Outcomes (joinledger's).
const (
	OutcomeAccepted = joinledger.OutcomeAccepted
	OutcomeRejected = joinledger.OutcomeRejected
)

// ReasonRateLimited is the reason code of rate-limited attempts (the server's RATE_LIMITED).
const ReasonRateLimited = "RATE_LIMITED"

// Entry is one join attempt (joinledger's format).
type Entry = joinledger.Entry

// Writer publishes entries. Record and RecordRateLimited are safe for concurrent use; Run must be
// running for anything to be written.
type Writer struct {
	client    kubernetes.Interface
	namespace string
	replica   string
	log       *zap.Logger

	queue      chan Entry
	dropped    atomic.Uint64
	superseded atomic.Uint64

	mu      sync.Mutex
	counted map[countKey]*Entry
	// perKind is how many keys of each kind counted holds.
	perKind map[string]int

	eventLimit *rate.Limiter
	eventSeq   atomic.Uint64
}

type countKey struct{ kind, peer, rpc, node, reason, disk string }

// NewWriter returns a Writer that writes through client into namespace, as replica.
func NewWriter(client kubernetes.Interface, namespace, replica string, log *zap.Logger) *Writer {
	if log == nil {
		log = zap.NewNop()
	}
	return &Writer{
		client: client, namespace: namespace, replica: replica, log: log,
		queue: make(chan Entry, QueueSize), counted: map[countKey]*Entry{}, perKind: map[string]int{},
		eventLimit: rate.NewLimiter(EventsPerSecond, EventBurst),
	}
}

// Record records e without blocking: an accepted entry is queued (dropped and counted when the queue
// is full), a refusal is aggregated with the refusals of its kind, peer, RPC, node, reason and disk since
// the last flush (dropped and counted when its kind's table is full).
func (w *Writer) Record(e Entry) {
	if e.Replica == "" {
		e.Replica = w.replica
	}
	if len(e.Message) > maxMessage {
		e.Message = e.Message[:maxMessage] + "..."
	}
	if e.Outcome != OutcomeAccepted {
		w.count(e)
		return
	}
	select {
	case w.queue <- e:
	default:
		w.dropped.Add(1)
	}
}

// RecordRateLimited counts one rate-limited attempt from peer.
func (w *Writer) RecordRateLimited(peer string) { w.RecordCounted(peer, ReasonRateLimited) }

// RecordCounted counts one unverified refusal of peer with reason; each flush writes one entry per
// peer and reason.
func (w *Writer) RecordCounted(peer, reason string) {
	w.count(Entry{Time: time.Now().UTC(), Peer: peer, Outcome: OutcomeRejected, Reason: reason, Replica: w.replica,
		Kind: joinledger.KindUnverified})
}

// count aggregates one refusal.
func (w *Writer) count(e Entry) {
	e.Kind = joinledger.KindOf(e)
	k := countKey{e.Kind, e.Peer, e.RPC, e.Node, e.Reason, e.DiskUUID}
	w.mu.Lock()
	defer w.mu.Unlock()
	agg, ok := w.counted[k]
	if !ok {
		if w.perKind[e.Kind] >= maxCounted {
			w.dropped.Add(1)
			return
		}
		w.perKind[e.Kind]++
		e.Count = max(e.Count, 1)
		w.counted[k] = &e
		return
	}
	n := agg.Count + max(e.Count, 1)
	*agg = e
	agg.Count = n
}

// Dropped returns how many entries were lost because the queue (or the table of counted peers) was
// full.
func (w *Writer) Dropped() uint64 { return w.dropped.Load() }

// Superseded returns how many entries were not written because more than Capacity newer ones came
// within one flush interval (or while the API server was unreachable).
func (w *Writer) Superseded() uint64 { return w.superseded.Load() }

// retryBackoff is the wait before each retry of a failed write: retryInitial, doubling up to retryCap.
func retryBackoff() wait.Backoff {
	return wait.Backoff{Duration: retryInitial, Factor: 2, Cap: retryCap, Steps: math.MaxInt32}
}

// Run writes queued entries until ctx ends, then makes one last attempt (bounded to
// shutdownFlushTimeout) to write what is pending. It returns nil when ctx ends.
func (w *Writer) Run(ctx context.Context) error {
	var pending []Entry
	var notBefore time.Time
	retry, delay := retryBackoff(), time.Duration(0)
	ticker := time.NewTicker(FlushInterval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			pending = w.drain(pending)
			if len(pending) > 0 {
				fctx, cancel := context.WithTimeout(context.Background(), shutdownFlushTimeout)
				if err := w.flush(fctx, pending); err != nil {
					w.log.Warn("writing join ledger at shutdown", zap.Int("entries", len(pending)), zap.Error(err))
				}
				cancel()
			}
			return nil
		case e := <-w.queue:
			// Trimmed only when twice over capacity: a flood of entries costs amortized O(1) each,
			// not a copy of Capacity entries each (drain trims exactly before a write).
			if pending = append(pending, e); len(pending) >= 2*Capacity {
				pending = w.keep(pending)
			}
			continue
		case <-ticker.C:
		}
		pending = w.drain(pending)
		if len(pending) == 0 || time.Now().Before(notBefore) {
			continue
		}
		if delay > 0 {
			select {
			case <-ctx.Done():
				continue
			case <-time.After(delay):
			}
		}
		if err := w.flush(ctx, pending); err != nil {
			w.log.Warn("writing join ledger", zap.Int("entries", len(pending)), zap.Error(err))
			delay = retry.Step()
			continue
		}
		retry, delay = retryBackoff(), 0
		if len(pending) >= Capacity {
			notBefore = time.Now().Add(FloodInterval)
		}
		pending = pending[:0]
	}
}

// drain moves queued entries and the rate-limited counts into pending.
func (w *Writer) drain(pending []Entry) []Entry {
	for {
		select {
		case e := <-w.queue:
			pending = append(pending, e)
			continue
		default:
		}
		break
	}
	w.mu.Lock()
	counts := w.counted
	w.counted, w.perKind = map[countKey]*Entry{}, map[string]int{}
	w.mu.Unlock()
	for _, e := range counts {
		if e.Reason == ReasonRateLimited {
			e.Message = fmt.Sprintf("%d attempts with this reason since the last ledger write", e.Count)
		}
		pending = append(pending, *e)
	}
	sort.SliceStable(pending, func(i, j int) bool { return pending[i].Time.Before(pending[j].Time) })
	return w.keep(pending)
}

// keep bounds pending to Capacity by kind (joinledger.Keep), counting what it drops as superseded.
func (w *Writer) keep(pending []Entry) []Entry {
	kept, dropped := joinledger.Keep(pending)
	w.superseded.Add(uint64(dropped))
	return kept
}

// flush writes batch into the ConfigMap and creates its Events.
func (w *Writer) flush(ctx context.Context, batch []Entry) error {
	cm, err := w.merge(ctx, batch)
	if err != nil {
		return err
	}
	if cm == nil { // nothing written (the update gave up without an error)
		return nil
	}
	w.events(ctx, cm, batch)
	return nil
}

// merge adds batch to the ConfigMap with optimistic concurrency (configmapkey.Update).
func (w *Writer) merge(ctx context.Context, batch []Entry) (*corev1.ConfigMap, error) {
	ref := configmapkey.Ref{Namespace: w.namespace, Name: joinledger.ConfigMapName, Key: joinledger.DataKey,
		Labels: map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf, joinconfig.NameLabel: joinconfig.JoinServiceName}}
	return configmapkey.Update(ctx, w.client, ref, conflictAttempts, func(data string) (string, error) {
		existing, err := joinledger.Decode(data)
		if err != nil {
			w.log.Warn("discarding unreadable join ledger", zap.Error(err))
			existing = nil
		}
		return joinledger.Encode(joinledger.Merge(existing, batch))
	})
}

// events creates the batch's Events. Failures are logged, never returned: the ConfigMap holds the
// entries already.
func (w *Writer) events(ctx context.Context, cm *corev1.ConfigMap, batch []Entry) {
	ref := corev1.ObjectReference{Kind: "ConfigMap", APIVersion: "v1", Namespace: cm.Namespace, Name: cm.Name, UID: cm.UID, ResourceVersion: cm.ResourceVersion}
	// Rejections first: they are what an operator looks for.
	ordered := append([]Entry(nil), batch...)
	sort.SliceStable(ordered, func(i, j int) bool {
		return ordered[i].Outcome == OutcomeRejected && ordered[j].Outcome != OutcomeRejected
	})
	n := 0
	for n < len(ordered) && w.eventLimit.Allow() {
		n++
	}
	shown := ordered[:n]
	for _, e := range shown {
		typ, reason := corev1.EventTypeNormal, "JoinAccepted"
		if e.Outcome != OutcomeAccepted {
			typ, reason = corev1.EventTypeWarning, "JoinRejected"
		}
		if err := w.createEvent(ctx, ref, typ, reason, EventMessage(e), e.Time, e.Count); err != nil {
			w.log.Warn("creating join event", zap.Error(err))
			return
		}
	}
	if n := len(batch) - len(shown); n > 0 && w.eventLimit.Allow() {
		msg := fmt.Sprintf("%d more join attempts in this batch are in ConfigMap %s only (Event rate limit)", n, joinledger.ConfigMapName)
		if err := w.createEvent(ctx, ref, corev1.EventTypeNormal, "JoinAttemptsNotShown", msg, time.Now(), 1); err != nil {
			w.log.Warn("creating join event", zap.Error(err))
		}
	}
}

// EventMessage is the one-line description of e used in Events.
func EventMessage(e Entry) string {
	var sb strings.Builder
	node := e.Node
	if node == "" {
		node = "unknown node"
	}
	fmt.Fprintf(&sb, "%s %s (%s)", e.RPC, node, e.Peer)
	if e.Role != "" {
		fmt.Fprintf(&sb, " as %s", e.Role)
	}
	if e.Outcome == OutcomeAccepted {
		sb.WriteString(": accepted")
	} else {
		fmt.Fprintf(&sb, ": %s", e.Reason)
		if e.Message != "" {
			fmt.Fprintf(&sb, ": %s", e.Message)
		}
	}
	if e.DiskUUID != "" {
		fmt.Fprintf(&sb, "; disk %s", e.DiskUUID)
	}
	if e.EvidenceSHA256 != "" {
		fmt.Fprintf(&sb, "; evidence sha256:%s", e.EvidenceSHA256)
	}
	if e.Replica != "" {
		fmt.Fprintf(&sb, "; answered by %s", e.Replica)
	}
	return strings.TrimSpace(sb.String())
}

func (w *Writer) createEvent(ctx context.Context, ref corev1.ObjectReference, typ, reason, msg string, at time.Time, count int) error {
	if count < 1 {
		count = 1
	}
	ts := metav1.NewTime(at)
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("%s.%x.%x", joinledger.ConfigMapName, time.Now().UnixNano(), w.eventSeq.Add(1)),
			Namespace: ref.Namespace,
		},
		InvolvedObject:      ref,
		Reason:              reason,
		Message:             msg,
		Type:                typ,
		Source:              corev1.EventSource{Component: "berth-joinservice", Host: w.replica},
		FirstTimestamp:      ts,
		LastTimestamp:       ts,
		Count:               int32(count),
		ReportingController: "berth.dev/joinservice",
		ReportingInstance:   w.replica,
	}
	_, err := w.client.CoreV1().Events(ref.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	return err
}
