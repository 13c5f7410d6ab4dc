package jointrace

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/berth-k8s/berth/joinproto"
)

// clock is a test clock the recorder reads.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func TestRecorderKeepsPhasesDurationsAndTheFailure(t *testing.T) {
	fs := afero.NewMemMapFs()
	core, logs := observer.New(zap.InfoLevel)
	c := &clock{t: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
	r := NewRecorder(zap.New(core), fs, "/state/"+FileName)
	r.now = c.now

	r.Begin(PhaseMetadata)
	c.t = c.t.Add(300 * time.Millisecond)
	r.Begin(PhaseTicket) // ends metadata as succeeded
	c.t = c.t.Add(2 * time.Second)
	r.Note("MEASUREMENT_MISMATCH", "attempt 3: refused")
	c.t = c.t.Add(time.Second)
	r.Succeed("attempt 4")
	r.Begin(PhaseJoin)
	c.t = c.t.Add(40 * time.Second)
	r.Fail(ReasonJoinFailed, "kubeadm join failed:\x1b[31m boom")

	got, err := Load(fs, "/state/"+FileName)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		name, outcome, reason, message string
		d                              time.Duration
	}{
		{PhaseMetadata, OutcomeSucceeded, "", "", 300 * time.Millisecond},
		{PhaseTicket, OutcomeSucceeded, "", "attempt 4", 3 * time.Second},
		{PhaseJoin, OutcomeFailed, ReasonJoinFailed, "kubeadm join failed:?[31m boom", 40 * time.Second},
	}
	if len(got.Phases) != len(want) {
		t.Fatalf("file holds %d phases, want %d: %+v", len(got.Phases), len(want), got)
	}
	for i, w := range want {
		p := got.Phases[i]
		if p.Name != w.name || p.Outcome != w.outcome || p.Reason != w.reason || p.Message != w.message || p.Duration != w.d {
			t.Errorf("phase %d = %+v, want %+v", i, p, w)
		}
	}
	if f, ok := got.Failed(); !ok || f.Name != PhaseJoin {
		t.Errorf("Failed() = %+v, %v", f, ok)
	}
	if n := logs.FilterMessage("join phase failed").Len(); n != 1 {
		t.Errorf("%d failure log lines, want 1", n)
	}
	if n := logs.FilterMessage("join phase ended").Len(); n != 2 {
		t.Errorf("%d phase-end log lines, want 2", n)
	}
	// What the node sends passes the joinservice's checks.
	if _, err := FromProto(got.Proto()); err != nil {
		t.Errorf("FromProto(the recorder's trace) = %v", err)
	}
}

func TestSnapshotRunsARunningPhaseUntilNow(t *testing.T) {
	c := &clock{t: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
	r := NewRecorder(zap.NewNop(), afero.NewMemMapFs(), "")
	r.now = c.now
	r.Begin(PhaseReady)
	c.t = c.t.Add(7 * time.Second)
	s := r.Snapshot()
	if len(s.Phases) != 1 || s.Phases[0].Outcome != OutcomeRunning || s.Phases[0].Duration != 7*time.Second {
		t.Fatalf("Snapshot() = %+v", s)
	}
}

func TestRecorderCodesAJoinservicesReason(t *testing.T) {
	r := NewRecorder(zap.NewNop(), afero.NewMemMapFs(), "")
	r.Begin(PhaseTicket)
	r.Fail("bad reason\n"+strings.Repeat("X", 100), "m")
	p := r.Snapshot().Phases[0]
	if p.Reason != strings.Repeat("_", 11)+strings.Repeat("X", MaxReason-11) {
		t.Errorf("reason = %q", p.Reason)
	}
	if _, err := FromProto(r.Snapshot().Proto()); err != nil {
		t.Errorf("FromProto = %v", err)
	}
}

func phase(name string) *joinproto.JoinPhase {
	return &joinproto.JoinPhase{Name: name, Start: timestamppb.New(time.Unix(1900000000, 0)), Duration: durationpb.New(time.Second), Outcome: OutcomeSucceeded}
}

func TestFromProtoRefuses(t *testing.T) {
	many := make([]*joinproto.JoinPhase, MaxPhases+1)
	for i := range many {
		many[i] = phase(PhaseMetadata)
	}
	with := func(f func(p *joinproto.JoinPhase)) []*joinproto.JoinPhase {
		p := phase(PhaseTicket)
		f(p)
		return []*joinproto.JoinPhase{p}
	}
	cases := map[string][]*joinproto.JoinPhase{
		"none":            nil,
		"too many":        many,
		"unknown name":    {phase("rm -rf")},
		"repeated":        {phase(PhaseTicket), phase(PhaseTicket)},
		"out of order":    {phase(PhaseJoin), phase(PhaseTicket)},
		"no start":        with(func(p *joinproto.JoinPhase) { p.Start = nil }),
		"no duration":     with(func(p *joinproto.JoinPhase) { p.Duration = nil }),
		"negative":        with(func(p *joinproto.JoinPhase) { p.Duration = durationpb.New(-time.Second) }),
		"over a week":     with(func(p *joinproto.JoinPhase) { p.Duration = durationpb.New(8 * 24 * time.Hour) }),
		"unknown outcome": with(func(p *joinproto.JoinPhase) { p.Outcome = "great" }),
		"reason not code": with(func(p *joinproto.JoinPhase) { p.Reason = "reason with spaces" }),
		"long reason":     with(func(p *joinproto.JoinPhase) { p.Reason = strings.Repeat("A", MaxReason+1) }),
		"control chars":   with(func(p *joinproto.JoinPhase) { p.Message = "ok\x1b]0;pwned\x07" }),
		"long message":    with(func(p *joinproto.JoinPhase) { p.Message = strings.Repeat("a", MaxMessage+1) }),
	}
	for name, phases := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := FromProto(phases)
			if !errors.Is(err, ErrInvalidTrace) {
				t.Fatalf("FromProto = %v, want ErrInvalidTrace", err)
			}
			if strings.Contains(err.Error(), "pwned") || strings.Contains(err.Error(), "rm -rf") {
				t.Errorf("error %q repeats what the peer sent", err)
			}
		})
	}
}

func TestFromProtoAccepts(t *testing.T) {
	in := []*joinproto.JoinPhase{phase(PhaseMetadata), phase(PhaseTicket), phase(PhaseJoin), phase(PhaseReady)}
	in[3].Outcome, in[3].Reason, in[3].Message = OutcomeFailed, ReasonNotReady, "Node w1 not Ready after 5m0s"
	got, err := FromProto(in)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Phases) != 4 || got.Phases[3].Reason != ReasonNotReady || got.Phases[1].Duration != time.Second {
		t.Errorf("FromProto = %+v", got)
	}
}
