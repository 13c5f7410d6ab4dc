// Package jointrace is a node's own record of its join: the phases it went through (metadata,
// ticket, kubeadm-join, node-ready), when each began, how long it took, and for a phase that
// failed the reason. The bootstrapper keeps it in a file in its state directory (FileName), logs
// every phase's end, and sends it to the joinservice (ReportTrace), which stores it on the node's
// Machine (records.berth.dev). A node the cluster never admitted has no Machine: its trace stays on
// the node, next to what the joinservice saw of it (its JoinRecords).
//
//	phase         from                                 until
//	metadata      the join client starts               the platform told the node who it is
//	ticket        asking the joinservices              a ticket arrived (attempts, last refusal)
//	kubeadm-join  the ticket was taken                 kubeadm join succeeded or gave up
//	node-ready    kubeadm join succeeded               the Node reports Ready
//
// FromProto is the joinservice's side: it checks what a node sent (known phase names, bounded
// counts and lengths, printable text) before anything is stored.
package jointrace

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinproto"
)

// Phases of a join, in their order.
// (records.berth.dev owns the names: a Machine's status stores them).
const (
	PhaseMetadata = v1alpha1.PhaseMetadata
	PhaseTicket   = v1alpha1.PhaseTicket
	PhaseJoin     = v1alpha1.PhaseJoin
	PhaseReady    = v1alpha1.PhaseReady
)

// Phases lists the phase names in their order.
var Phases = v1alpha1.JoinPhases

// Outcomes of a phase.
const (
	OutcomeSucceeded = v1alpha1.PhaseOutcomeSucceeded
	OutcomeFailed    = v1alpha1.PhaseOutcomeFailed
	OutcomeRunning   = v1alpha1.PhaseOutcomeRunning
)

// The node's own reasons for a failed phase (a refused ticket carries the joinservice's reason).
const (
	// ReasonJoinFailed: kubeadm join failed, or kept failing, after the node took a ticket.
	ReasonJoinFailed = "KUBEADM_JOIN_FAILED"
	// ReasonNotReady: kubeadm join succeeded, but the Node did not report Ready in time.
	ReasonNotReady = "NODE_NOT_READY"
)

// FileName is the trace's file in the bootstrapper's state directory.
const FileName = "join-trace.json"

// Bounds of a trace.
const (
	// MaxPhases bounds the phases of a trace.
	MaxPhases = v1alpha1.MaxTracePhases
	// MaxReason bounds a reason code's length.
	MaxReason = v1alpha1.MaxTraceReason
	// MaxMessage bounds a phase's message.
	MaxMessage = v1alpha1.MaxTraceMessage
	// maxDuration bounds one phase's duration: a week.
	maxDuration = 7 * 24 * time.Hour
)

// ErrInvalidTrace is wrapped by FromProto's refusals.
var ErrInvalidTrace = errors.New("invalid join trace")

// Phase is one phase of a join.
type Phase struct {
	Name     string        `json:"name"`
	Start    time.Time     `json:"start"`
	Duration time.Duration `json:"duration"`
	Outcome  string        `json:"outcome"`
	Reason   string        `json:"reason,omitempty"`
	Message  string        `json:"message,omitempty"`
}

// Trace is the phases of one join, oldest first.
type Trace struct {
	Phases []Phase `json:"phases"`
}

// Failed returns the failed phase, if any.
func (t Trace) Failed() (Phase, bool) {
	for _, p := range t.Phases {
		if p.Outcome == OutcomeFailed {
			return p, true
		}
	}
	return Phase{}, false
}

// Recorder records the phases of a join as they happen: every change is logged and written to its
// file. Safe for concurrent use.
type Recorder struct {
	log  *zap.Logger
	fs   afero.Fs
	path string
	now  func() time.Time

	mu    sync.Mutex
	trace Trace
}

// NewRecorder returns a Recorder that keeps its trace in path on fsys ("" keeps none).
func NewRecorder(log *zap.Logger, fsys afero.Fs, path string) *Recorder {
	return &Recorder{log: log, fs: fsys, path: path, now: time.Now}
}

// Begin starts phase name; a phase still running is ended as succeeded first.
func (r *Recorder) Begin(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i := r.running(); i >= 0 {
		r.end(i, OutcomeSucceeded, "", "")
	}
	if len(r.trace.Phases) >= MaxPhases {
		return
	}
	r.trace.Phases = append(r.trace.Phases, Phase{Name: name, Start: r.now().UTC(), Outcome: OutcomeRunning})
	r.log.Info("join phase started", zap.String("phase", name))
	r.save()
}

// Note sets the running phase's message (attempts so far, the latest refusal) without ending it.
func (r *Recorder) Note(reason, message string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i := r.running(); i >= 0 {
		p := &r.trace.Phases[i]
		if p.Reason == code(reason) && p.Message == clip(message, MaxMessage) {
			return
		}
		p.Reason, p.Message = code(reason), clip(message, MaxMessage)
		r.save()
	}
}

// Succeed ends the running phase as succeeded, with message.
func (r *Recorder) Succeed(message string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i := r.running(); i >= 0 {
		r.end(i, OutcomeSucceeded, "", message)
		r.save()
	}
}

// Fail ends the running phase as failed with reason and message.
func (r *Recorder) Fail(reason, message string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i := r.running(); i >= 0 {
		r.end(i, OutcomeFailed, reason, message)
		r.save()
	}
}

// Snapshot returns the trace so far; a running phase's duration runs until now.
func (r *Recorder) Snapshot() Trace {
	r.mu.Lock()
	defer r.mu.Unlock()
	t := Trace{Phases: slices.Clone(r.trace.Phases)}
	for i := range t.Phases {
		if t.Phases[i].Outcome == OutcomeRunning {
			t.Phases[i].Duration = r.now().Sub(t.Phases[i].Start)
		}
	}
	return t
}

func (r *Recorder) running() int {
	for i := len(r.trace.Phases) - 1; i >= 0; i-- {
		if r.trace.Phases[i].Outcome == OutcomeRunning {
			return i
		}
	}
	return -1
}

func (r *Recorder) end(i int, outcome, reason, message string) {
	p := &r.trace.Phases[i]
	p.Duration = r.now().Sub(p.Start)
	p.Outcome = outcome
	if reason != "" || outcome == OutcomeSucceeded {
		p.Reason = code(reason)
	}
	if message != "" || outcome == OutcomeSucceeded {
		p.Message = clip(message, MaxMessage)
	}
	fields := []zap.Field{zap.String("phase", p.Name), zap.Duration("took", p.Duration), zap.String("outcome", outcome)}
	if outcome == OutcomeFailed {
		r.log.Warn("join phase failed", append(fields, zap.String("reason", p.Reason), zap.String("message", p.Message))...)
		return
	}
	r.log.Info("join phase ended", fields...)
}

// save writes the trace to the file; a failure is logged, never fatal: the trace is a record, not
// a step of the join.
func (r *Recorder) save() {
	if r.path == "" {
		return
	}
	data, err := json.MarshalIndent(r.trace, "", "  ")
	if err == nil {
		err = atomicfile.Write(r.fs, r.path, append(data, '\n'), 0o600)
	}
	if err != nil {
		r.log.Warn("writing the join trace", zap.String("path", r.path), zap.Error(err))
	}
}

// Load reads a trace file a Recorder wrote.
func Load(fsys afero.Fs, path string) (Trace, error) {
	data, err := afero.ReadFile(fsys, path)
	if err != nil {
		return Trace{}, fmt.Errorf("reading the join trace: %w", err)
	}
	var t Trace
	if err := json.Unmarshal(data, &t); err != nil {
		return Trace{}, fmt.Errorf("decoding the join trace %s: %w", path, err)
	}
	return t, nil
}

// Proto is the trace on the wire.
func (t Trace) Proto() []*joinproto.JoinPhase {
	out := make([]*joinproto.JoinPhase, 0, len(t.Phases))
	for _, p := range t.Phases {
		out = append(out, &joinproto.JoinPhase{
			Name: p.Name, Start: timestamppb.New(p.Start), Duration: durationpb.New(p.Duration),
			Outcome: p.Outcome, Reason: p.Reason, Message: p.Message,
		})
	}
	return out
}

// FromProto checks a trace a node sent and returns it: at least one and at most MaxPhases phases,
// each with a known name, at most once, in order; a start and a duration between zero and a week;
// a known outcome; a reason of at most MaxReason characters of A-Z, 0-9 and _; a message of at most
// MaxMessage printable ASCII characters. Anything else is refused, wrapping ErrInvalidTrace with
// what is wrong (never the offending text).
func FromProto(phases []*joinproto.JoinPhase) (Trace, error) {
	if len(phases) == 0 || len(phases) > MaxPhases {
		return Trace{}, fmt.Errorf("%d phases, want 1 to %d: %w", len(phases), MaxPhases, ErrInvalidTrace)
	}
	t := Trace{Phases: make([]Phase, 0, len(phases))}
	last := -1
	for i, p := range phases {
		idx := slices.Index(Phases, p.GetName())
		if idx < 0 {
			return Trace{}, fmt.Errorf("phase %d: unknown name: %w", i, ErrInvalidTrace)
		}
		if idx <= last {
			return Trace{}, fmt.Errorf("phase %d (%s): out of order or repeated: %w", i, p.GetName(), ErrInvalidTrace)
		}
		last = idx
		if p.GetStart() == nil || p.GetStart().CheckValid() != nil || p.GetDuration() == nil || p.GetDuration().CheckValid() != nil {
			return Trace{}, fmt.Errorf("phase %d (%s): missing or invalid start or duration: %w", i, p.GetName(), ErrInvalidTrace)
		}
		d := p.GetDuration().AsDuration()
		if d < 0 || d > maxDuration {
			return Trace{}, fmt.Errorf("phase %d (%s): duration out of range: %w", i, p.GetName(), ErrInvalidTrace)
		}
		switch p.GetOutcome() {
		case OutcomeSucceeded, OutcomeFailed, OutcomeRunning:
		default:
			return Trace{}, fmt.Errorf("phase %d (%s): unknown outcome: %w", i, p.GetName(), ErrInvalidTrace)
		}
		if !reasonCode(p.GetReason()) {
			return Trace{}, fmt.Errorf("phase %d (%s): reason is not a reason code: %w", i, p.GetName(), ErrInvalidTrace)
		}
		if len(p.GetMessage()) > MaxMessage || strings.IndexFunc(p.GetMessage(), func(r rune) bool { return r < 0x20 || r > 0x7e }) >= 0 {
			return Trace{}, fmt.Errorf("phase %d (%s): message longer than %d characters or not printable ASCII: %w", i, p.GetName(), MaxMessage, ErrInvalidTrace)
		}
		t.Phases = append(t.Phases, Phase{Name: p.GetName(), Start: p.GetStart().AsTime().UTC(), Duration: d,
			Outcome: p.GetOutcome(), Reason: p.GetReason(), Message: p.GetMessage()})
	}
	return t, nil
}

func reasonCode(s string) bool {
	if len(s) > MaxReason {
		return false
	}
	return strings.IndexFunc(s, func(r rune) bool { return (r < 'A' || r > 'Z') && (r < '0' || r > '9') && r != '_' }) < 0
}

// code bounds a reason to MaxReason characters of A-Z, 0-9 and _, replacing any other with _: a
// joinservice's reason reaches the trace as a code FromProto accepts.
func code(s string) string {
	if len(s) > MaxReason {
		s = s[:MaxReason]
	}
	return strings.Map(func(r rune) rune {
		if 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || r == '_' {
			return r
		}
		return '_'
	}, s)
}

// clip bounds s to n bytes and replaces what is not printable ASCII, so that what a peer sent
// reaches no terminal unescaped and no trace is refused for it.
func clip(s string, n int) string {
	if len(s) > n {
		s = s[:n]
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e {
			return '?'
		}
		return r
	}, s)
}

// Status is the trace as a Machine stores it, reported at reported.
func (t Trace) Status(reported time.Time) *v1alpha1.JoinTrace {
	out := &v1alpha1.JoinTrace{Reported: metav1.NewTime(reported.UTC().Truncate(time.Second)), Phases: make([]v1alpha1.JoinPhase, 0, len(t.Phases))}
	for _, p := range t.Phases {
		out.Phases = append(out.Phases, v1alpha1.JoinPhase{Name: p.Name, Start: metav1.NewTime(p.Start.UTC()),
			Duration: metav1.Duration{Duration: p.Duration.Round(time.Millisecond)}, Outcome: p.Outcome, Reason: p.Reason, Message: p.Message})
	}
	return out
}
