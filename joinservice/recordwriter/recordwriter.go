// Package recordwriter writes the joinservice's part of the record API (internal/records): a
// Machine for every machine it admits, with its latest join and the evidence it proved, JoinRecords
// aggregating the refusals it answered, and Events about both through client-go's events library.
//
// Nothing here blocks or fails a join. Admit and Record put what they learn into tables bounded in
// size (QueueSize machines; maxCounted refusal keys per class) and count what does not fit as
// dropped; Run writes the tables every FlushInterval. Each write touches one object: an admission
// creates its Machine (one request) or, when it exists, patches its latest join and evidence (two);
// each refusal key updates one JoinRecord (a read and a write). So a join costs O(1) requests
// whatever the number of machines, and the writer's memory is bounded by its tables.
//
// The refusal classes keep the join ledger's guarantee: refusals of what a peer sent without
// proving anything (unverified) and refusals of attested machines (evidence) have separate tables
// and separate object quotas (records.ClassQuota). When a class is full, new keys of that class are
// folded into its overflow record (peer "*", one per reason), so a flood of unverified refusals from
// many addresses never displaces an evidence record or a Machine.
//
// Removals stay where `berth node remove` writes them, in the machine record ConfigMap whose
// revoked-nodes key the API server's revocation policy reads (package machines). SyncRemovals copies
// each change of a machine's removal onto its Machine (state Locked or Removed), and on its first
// call creates the Machines of every machine the ConfigMap holds that has none yet: the migration of
// a cluster whose only record was the ConfigMap.
package recordwriter

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/retry"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/clientset/scheme"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// Limits and intervals.
const (
	// QueueSize bounds the admissions waiting to be written (distinct machines).
	QueueSize = 4096
	// FlushInterval is how often the tables are written.
	FlushInterval = 500 * time.Millisecond
	// EventsPerSecond and EventBurst bound the Events one replica emits.
	EventsPerSecond = 5
	EventBurst      = 20
	// maxCounted bounds the refusal keys aggregated between flushes, per class.
	maxCounted = 1024
	// maxMessage bounds a record's message (the CRD allows 1024 bytes).
	maxMessage = 400
	// reportingController names the writer in its Events.
	reportingController = "berth.dev/joinservice"
)

// Admission is one accepted join or rejoin.
type Admission struct {
	Time     time.Time
	Identity string
	Node     string
	Role     string
	RPC      string
	Peer     string
	Replica  string
	// Evidence is the peer's verified attestation; nil without attestation.
	Evidence *v1alpha1.Evidence
}

// NewEvidence reduces a verified attestation to a Machine's evidence: the document's hex SHA-256,
// the variant and the measurements by decimal index in hex.
func NewEvidence(documentSHA256, variant string, measurements map[uint32][]byte) *v1alpha1.Evidence {
	ev := &v1alpha1.Evidence{SHA256: documentSHA256, Variant: variant}
	if len(measurements) > 0 {
		ev.Measurements = make(map[string]string, len(measurements))
		for i, v := range measurements {
			ev.Measurements[strconv.FormatUint(uint64(i), 10)] = hex.EncodeToString(v)
		}
	}
	return ev
}

// Writer writes Machines and JoinRecords. Admit, Record, RecordRateLimited and SyncRemovals are
// safe for concurrent use and return at once; Run must be running for anything to be written.
type Writer struct {
	client    clientset.Interface
	kube      kubernetes.Interface
	namespace string
	replica   string
	log       *zap.Logger

	mu        sync.Mutex
	admitted  map[string]Admission
	refusals  map[v1alpha1.JoinRecordSpec]*refusal
	perClass  map[string]int
	removals  map[string]machines.Machine // identity -> latest removal state to write
	written   map[string]string           // identity -> removal state last written
	migrating []machines.Machine
	migrated  bool

	recordsPerClass map[string]map[string]bool // names of existing JoinRecords, per class (Run's goroutine only)

	dropped    atomic.Uint64
	eventLimit *rate.Limiter
	requests   atomic.Uint64
}

type refusal struct {
	count          int64
	first, last    time.Time
	message        string
	evidenceSHA256 string
}

// New returns a Writer of the record API in namespace, as replica. kube is used for Events.
func New(client clientset.Interface, kube kubernetes.Interface, namespace, replica string, log *zap.Logger) *Writer {
	if log == nil {
		log = zap.NewNop()
	}
	return &Writer{
		client: client, kube: kube, namespace: namespace, replica: replica, log: log,
		admitted: map[string]Admission{}, refusals: map[v1alpha1.JoinRecordSpec]*refusal{}, perClass: map[string]int{},
		removals: map[string]machines.Machine{}, written: map[string]string{},
		eventLimit: rate.NewLimiter(EventsPerSecond, EventBurst),
	}
}

// Dropped returns how many admissions and refusals found their table full.
func (w *Writer) Dropped() uint64 { return w.dropped.Load() }

// Requests returns how many API requests the writer made.
func (w *Writer) Requests() uint64 { return w.requests.Load() }

// Admit queues a's Machine to be written; a later admission of the same machine replaces it.
func (w *Writer) Admit(a Admission) {
	if a.Replica == "" {
		a.Replica = w.replica
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.admitted[a.Identity]; !ok && len(w.admitted) >= QueueSize {
		w.dropped.Add(1)
		return
	}
	w.admitted[a.Identity] = a
}

// Record aggregates a refused attempt (a join ledger entry) into its JoinRecord; accepted entries
// and membership events are not the writer's (Admit has the accepted joins).
func (w *Writer) Record(e joinledger.Entry) {
	if e.Outcome == joinledger.OutcomeAccepted || joinledger.IsMembership(e) {
		return
	}
	spec := v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassUnverified, Peer: e.Peer, Node: e.Node, RPC: e.RPC, Reason: e.Reason}
	if joinledger.KindOf(e) == joinledger.KindEvidence {
		spec.Class, spec.Identity = v1alpha1.ClassEvidence, e.Identity
	}
	if spec.Reason == "" {
		spec.Reason = "UNKNOWN"
	}
	at := e.Time
	if at.IsZero() {
		at = time.Now()
	}
	msg := e.Message
	if len(msg) > maxMessage {
		msg = msg[:maxMessage] + "..."
	}
	w.count(spec, max(int64(e.Count), 1), at.UTC().Truncate(time.Second), msg, e.EvidenceSHA256)
}

// RecordRateLimited counts one rate-limited attempt of peer.
func (w *Writer) RecordRateLimited(peer string) {
	w.count(v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassUnverified, Peer: peer, Reason: "RATE_LIMITED"}, 1,
		time.Now().UTC().Truncate(time.Second), "", "")
}

func (w *Writer) count(spec v1alpha1.JoinRecordSpec, n int64, at time.Time, msg, digest string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	r, ok := w.refusals[spec]
	if !ok {
		if w.perClass[spec.Class] >= maxCounted {
			w.dropped.Add(1)
			return
		}
		w.perClass[spec.Class]++
		r = &refusal{first: at}
		w.refusals[spec] = r
	}
	r.count += n
	if !at.Before(r.last) {
		r.last, r.message = at, msg
		if digest != "" {
			r.evidenceSHA256 = digest
		}
	}
}

// SyncRemovals takes the machine record as read (registry): every machine whose removal changed
// since the last call gets its Machine's state written. The first call also creates the Machines of
// the record's machines that have none.
func (w *Writer) SyncRemovals(ms []machines.Machine) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.migrated && w.migrating == nil {
		w.migrating = append([]machines.Machine{}, ms...)
	}
	for _, m := range ms {
		if w.written[m.Identity] != removalState(m) {
			w.removals[m.Identity] = m
		}
	}
}

// removalState is the state the Machine of m has by its removal, with its time.
func removalState(m machines.Machine) string {
	switch {
	case !m.Revoked():
		return string(v1alpha1.StateAdmitted)
	case m.Removal.Etcd == machines.EtcdPending:
		return string(v1alpha1.StateLocked) + "@" + m.Removal.Time.UTC().Format(time.RFC3339)
	default:
		return string(v1alpha1.StateRemoved) + "@" + m.Removal.Time.UTC().Format(time.RFC3339)
	}
}

// Run writes the tables every FlushInterval until ctx ends, then once more (bounded). It returns nil.
func (w *Writer) Run(ctx context.Context) error {
	broadcaster := events.NewBroadcaster(&events.EventSinkImpl{Interface: w.kube.EventsV1()})
	if err := broadcaster.StartRecordingToSinkWithContext(ctx); err != nil {
		return fmt.Errorf("starting the event recorder: %w", err)
	}
	defer broadcaster.Shutdown()
	recorder := broadcaster.NewRecorder(scheme.Scheme, reportingController)
	t := time.NewTicker(FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			w.Flush(fctx, recorder)
			cancel()
			return nil
		case <-t.C:
		}
		w.Flush(ctx, recorder)
	}
}

// Flush writes what the tables hold; what fails to be written is logged and kept for the next flush
// (admissions and removals) or dropped (refusals, whose counts the next ones carry on).
func (w *Writer) Flush(ctx context.Context, recorder events.EventRecorder) {
	w.mu.Lock()
	admitted, refusals, removals, migrating := w.admitted, w.refusals, w.removals, w.migrating
	w.admitted, w.refusals, w.removals, w.perClass = map[string]Admission{}, map[v1alpha1.JoinRecordSpec]*refusal{}, map[string]machines.Machine{}, map[string]int{}
	w.migrating = nil
	w.mu.Unlock()

	if migrating != nil {
		if err := w.migrate(ctx, migrating); err != nil {
			w.log.Warn("migrating the machine record", zap.Error(err))
			w.mu.Lock()
			if w.migrating == nil {
				w.migrating = migrating
			}
			w.mu.Unlock()
		} else {
			w.mu.Lock()
			w.migrated = true
			w.mu.Unlock()
		}
	}
	ids := make([]string, 0, len(admitted))
	for id := range admitted {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		a := admitted[id]
		m, err := w.writeAdmission(ctx, a)
		if err != nil {
			w.log.Warn("writing a machine", zap.String("identity", machines.Short(id)), zap.Error(err))
			w.requeue(a)
			continue
		}
		w.event(recorder, m, corev1.EventTypeNormal, "JoinAccepted", "Join", fmt.Sprintf("%s %s (%s) as %s: accepted by %s", a.RPC, a.Node, a.Peer, a.Role, a.Replica))
	}
	for id, m := range removals {
		if err := w.writeRemoval(ctx, m); err != nil {
			w.log.Warn("writing a machine's removal", zap.String("identity", machines.Short(id)), zap.Error(err))
			w.mu.Lock()
			if _, newer := w.removals[id]; !newer {
				w.removals[id] = m
			}
			w.mu.Unlock()
		}
	}
	specs := make([]v1alpha1.JoinRecordSpec, 0, len(refusals))
	for s := range refusals {
		specs = append(specs, s)
	}
	// Evidence first: if the API server is slow, the refusals of attested machines get through first.
	sort.Slice(specs, func(i, j int) bool {
		if specs[i].Class != specs[j].Class {
			return specs[i].Class == v1alpha1.ClassEvidence
		}
		return refusals[specs[i]].last.After(refusals[specs[j]].last)
	})
	for _, s := range specs {
		jr, err := w.writeRefusal(ctx, s, refusals[s])
		if err != nil {
			w.log.Warn("writing a join record", zap.String("reason", s.Reason), zap.Error(err))
			continue
		}
		r := refusals[s]
		w.event(recorder, jr, corev1.EventTypeWarning, "JoinRejected", "Join",
			fmt.Sprintf("%s %s (%s): %s: %s (%d attempts)", dash(s.RPC), dash(s.Node), jr.Spec.Peer, s.Reason, r.message, r.count))
	}
}

func (w *Writer) requeue(a Admission) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, newer := w.admitted[a.Identity]; !newer && len(w.admitted) < QueueSize {
		w.admitted[a.Identity] = a
	}
}

func (w *Writer) event(recorder events.EventRecorder, regarding any, typ, reason, action, note string) {
	if recorder == nil || !w.eventLimit.Allow() {
		return
	}
	obj, ok := regarding.(interface{ GetName() string })
	if !ok || obj.GetName() == "" {
		return
	}
	switch o := regarding.(type) {
	case *v1alpha1.Machine:
		recorder.Eventf(o, nil, typ, reason, action, "%s", note)
	case *v1alpha1.JoinRecord:
		recorder.Eventf(o, nil, typ, reason, action, "%s", note)
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// writeAdmission creates a's Machine or, when it exists, patches its node, role, latest join and
// evidence, and its state back to Admitted (the server admits no removed machine: a re-admitted one
// joins again).
func (w *Writer) writeAdmission(ctx context.Context, a Admission) (*v1alpha1.Machine, error) {
	at := metav1.NewTime(a.Time.UTC().Truncate(time.Second))
	seen := &v1alpha1.JoinSeen{Time: at, RPC: a.RPC, Peer: a.Peer, Replica: a.Replica}
	m := &v1alpha1.Machine{
		TypeMeta:   metav1.TypeMeta{APIVersion: v1alpha1.SchemeGroupVersion.String(), Kind: records.MachineKind},
		ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(a.Identity), Namespace: w.namespace},
		Spec:       v1alpha1.MachineSpec{Identity: a.Identity, Node: a.Node, Role: a.Role},
		Status:     v1alpha1.MachineStatus{State: v1alpha1.StateAdmitted, Admitted: at, LastJoin: seen, Evidence: a.Evidence},
	}
	w.requests.Add(1)
	created, err := w.client.RecordsV1alpha1().Machines(w.namespace).Create(ctx, m, metav1.CreateOptions{})
	if err == nil {
		return created, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("creating machine %s: %w", m.Name, err)
	}
	// A JSON patch, not a merge patch: "add" replaces the evidence whole, so that measurements the
	// new evidence lacks do not survive from the old one.
	ops := []map[string]any{
		{"op": "add", "path": "/spec/node", "value": a.Node},
		{"op": "add", "path": "/spec/role", "value": a.Role},
		{"op": "add", "path": "/status/state", "value": v1alpha1.StateAdmitted},
		{"op": "add", "path": "/status/lastJoin", "value": seen},
	}
	if a.Evidence != nil {
		ops = append(ops, map[string]any{"op": "add", "path": "/status/evidence", "value": a.Evidence})
	}
	patched, err := w.patch(ctx, m.Name, ops)
	if apierrors.IsInvalid(err) {
		// A re-admitted machine still carries its removal time until its first join after it.
		patched, err = w.patch(ctx, m.Name, append(ops, map[string]any{"op": "remove", "path": "/status/removed"}))
	}
	if err != nil {
		return nil, fmt.Errorf("updating machine %s: %w", m.Name, err)
	}
	return patched, nil
}

func (w *Writer) patch(ctx context.Context, name string, ops []map[string]any) (*v1alpha1.Machine, error) {
	body, err := json.Marshal(ops)
	if err != nil {
		return nil, fmt.Errorf("encoding machine %s: %w", name, err)
	}
	w.requests.Add(1)
	return w.client.RecordsV1alpha1().Machines(w.namespace).Patch(ctx, name, types.JSONPatchType, body, metav1.PatchOptions{})
}

// writeRemoval writes m's removal state onto its Machine, creating it when there is none.
func (w *Writer) writeRemoval(ctx context.Context, m machines.Machine) error {
	state, removed := v1alpha1.StateAdmitted, (*metav1.Time)(nil)
	if m.Revoked() {
		t := metav1.NewTime(m.Removal.Time.UTC())
		state, removed = v1alpha1.StateRemoved, &t
		if m.Removal.Etcd == machines.EtcdPending {
			state = v1alpha1.StateLocked
		}
	}
	body, err := json.Marshal(map[string]any{"status": map[string]any{"state": state, "removed": removed}})
	if err != nil {
		return fmt.Errorf("encoding machine: %w", err)
	}
	name := records.NameFor(m.Identity)
	w.requests.Add(1)
	_, err = w.client.RecordsV1alpha1().Machines(w.namespace).Patch(ctx, name, types.MergePatchType, body, metav1.PatchOptions{})
	if apierrors.IsNotFound(err) {
		err = w.create(ctx, m)
	}
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.written[m.Identity] = removalState(m)
	w.mu.Unlock()
	return nil
}

// machineOf is the Machine of a machine of the ConfigMap record.
func (w *Writer) machineOf(m machines.Machine) *v1alpha1.Machine {
	role := m.Role
	if role != machines.RoleControlPlane {
		role = machines.RoleWorker
	}
	out := &v1alpha1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(m.Identity), Namespace: w.namespace},
		Spec:       v1alpha1.MachineSpec{Identity: m.Identity, Node: m.Node, Role: role},
		Status:     v1alpha1.MachineStatus{State: v1alpha1.StateAdmitted, Admitted: metav1.NewTime(m.Admitted.UTC())},
	}
	if m.Revoked() {
		t := metav1.NewTime(m.Removal.Time.UTC())
		out.Status.State, out.Status.Removed = v1alpha1.StateRemoved, &t
		if m.Removal.Etcd == machines.EtcdPending {
			out.Status.State = v1alpha1.StateLocked
		}
	}
	return out
}

func (w *Writer) create(ctx context.Context, m machines.Machine) error {
	w.requests.Add(1)
	_, err := w.client.RecordsV1alpha1().Machines(w.namespace).Create(ctx, w.machineOf(m), metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating machine %s: %w", records.NameFor(m.Identity), err)
	}
	return nil
}

// migrate creates the Machines of the ConfigMap record's machines that have none: one list (in
// pages), then one create per missing machine.
func (w *Writer) migrate(ctx context.Context, ms []machines.Machine) error {
	have := map[string]bool{}
	opts := metav1.ListOptions{Limit: 500}
	for {
		w.requests.Add(1)
		list, err := w.client.RecordsV1alpha1().Machines(w.namespace).List(ctx, opts)
		if err != nil {
			return fmt.Errorf("listing machines: %w", err)
		}
		for _, m := range list.Items {
			have[m.Name] = true
		}
		if opts.Continue = list.Continue; opts.Continue == "" {
			break
		}
	}
	created := 0
	for _, m := range ms {
		if have[records.NameFor(m.Identity)] {
			continue
		}
		if err := w.create(ctx, m); err != nil {
			return err
		}
		created++
	}
	if created > 0 {
		w.log.Info("migrated the machine record to Machines", zap.Int("created", created), zap.Int("machines", len(ms)))
	}
	return nil
}

// errQuota says a class has as many JoinRecords as its quota allows.
var errQuota = errors.New("join record quota reached")

// writeRefusal adds r to the JoinRecord of spec (or of its class's overflow record when the class
// is full), creating it when there is none.
func (w *Writer) writeRefusal(ctx context.Context, spec v1alpha1.JoinRecordSpec, r *refusal) (*v1alpha1.JoinRecord, error) {
	jr, err := w.addRefusal(ctx, spec, r, true)
	if errors.Is(err, errQuota) {
		overflow := v1alpha1.JoinRecordSpec{Class: spec.Class, Peer: records.OverflowPeer, Reason: spec.Reason}
		return w.addRefusal(ctx, overflow, r, false)
	}
	return jr, err
}

func (w *Writer) addRefusal(ctx context.Context, spec v1alpha1.JoinRecordSpec, r *refusal, quota bool) (*v1alpha1.JoinRecord, error) {
	name := records.RecordName(spec)
	client := w.client.RecordsV1alpha1().JoinRecords(w.namespace)
	var out *v1alpha1.JoinRecord
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		w.requests.Add(1)
		cur, err := client.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if quota {
				full, err := w.classFull(ctx, spec.Class)
				if err != nil {
					return err
				}
				if full {
					return errQuota
				}
			}
			jr := &v1alpha1.JoinRecord{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: w.namespace,
					Labels: map[string]string{records.ClassLabel: spec.Class}},
				Spec: spec,
				Status: v1alpha1.JoinRecordStatus{Count: r.count, First: metav1.NewTime(r.first), Last: metav1.NewTime(r.last),
					Message: r.message, EvidenceSHA256: r.evidenceSHA256, Replica: w.replica},
			}
			w.requests.Add(1)
			out, err = client.Create(ctx, jr, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				return apierrors.NewConflict(v1alpha1.Resource(records.JoinRecordPlural), name, err)
			}
			if err == nil {
				w.noteRecord(spec.Class, name)
			}
			return err
		}
		if err != nil {
			return err
		}
		cur.Status.Count += r.count
		if r.first.Before(cur.Status.First.Time) {
			cur.Status.First = metav1.NewTime(r.first)
		}
		if !r.last.Before(cur.Status.Last.Time) {
			cur.Status.Last, cur.Status.Message, cur.Status.Replica = metav1.NewTime(r.last), r.message, w.replica
			if r.evidenceSHA256 != "" {
				cur.Status.EvidenceSHA256 = r.evidenceSHA256
			}
		}
		w.requests.Add(1)
		out, err = client.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("recording refusals in %s: %w", name, err)
	}
	return out, nil
}

// classFull reports whether class has its quota of JoinRecords. The names are listed once (by the
// class label) and then counted as this writer creates records; a full class is listed again, since
// records may have been pruned meanwhile.
func (w *Writer) classFull(ctx context.Context, class string) (bool, error) {
	if w.recordsPerClass == nil {
		w.recordsPerClass = map[string]map[string]bool{}
	}
	names, ok := w.recordsPerClass[class]
	if ok && len(names) < records.ClassQuota[class] {
		return false, nil
	}
	w.requests.Add(1)
	list, err := w.client.RecordsV1alpha1().JoinRecords(w.namespace).List(ctx, metav1.ListOptions{LabelSelector: records.ClassLabel + "=" + class})
	if err != nil {
		return false, fmt.Errorf("listing join records: %w", err)
	}
	names = make(map[string]bool, len(list.Items))
	for _, jr := range list.Items {
		names[jr.Name] = true
	}
	w.recordsPerClass[class] = names
	return len(names) >= records.ClassQuota[class], nil
}

func (w *Writer) noteRecord(class, name string) {
	if names, ok := w.recordsPerClass[class]; ok {
		names[name] = true
	}
}
