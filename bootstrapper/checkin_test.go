package bootstrapper

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/bootstrapper/joinclient"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/nodelock"
)

// answers is a cluster that answers check-ins from a channel, one answer per call.
type answers struct {
	next  chan error
	calls chan wait.Backoff
}

func newAnswers() *answers {
	return &answers{next: make(chan error, 10), calls: make(chan wait.Backoff, 10)}
}

func (a *answers) checkIn(ctx context.Context, b wait.Backoff) error {
	a.calls <- b
	select {
	case err := <-a.next:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// locker counts Lock calls.
type locker struct{ locked chan struct{} }

func (l *locker) Lock(context.Context) error { l.locked <- struct{}{}; return nil }

var (
	errRevoked  = fmt.Errorf("check-in refused by joinservice 10.0.0.1:9002: removed: %w", joinclient.ErrRevoked)
	errNoAnswer = fmt.Errorf("%w after 8 rounds", joinclient.ErrNoCheckIn)
	testTiming  = checkInTiming{first: wait.Backoff{Steps: 1}, background: wait.Backoff{Steps: 2}, revoked: time.Millisecond}
)

// joinedNode is a node that joined before, restarted with a check-in.
func joinedNode(t *testing.T, controlPlane bool) (*node, *answers, *locker) {
	t.Helper()
	n := newNode(t)
	if err := n.deps.Lock.lock.TryLockOnce(context.Background(), "join", []byte{1}); err != nil {
		t.Fatal(err)
	}
	if err := n.state.Save(&nodestate.State{Role: nodestate.RoleJoin, ClusterID: "01", NodeName: "w", Done: true}); err != nil {
		t.Fatal(err)
	}
	n.deps.Lock = NewRace(nodelock.New(nodelock.NewFileMarker(n.fs, "/state/bootstrapped")))
	a, l := newAnswers(), &locker{locked: make(chan struct{}, 10)}
	n.deps.CheckIn, n.deps.Locker = a.checkIn, l
	n.deps.ControlPlane = func(context.Context) (bool, error) { return controlPlane, nil }
	n.deps.checkInTiming = testTiming
	return n, a, l
}

// none fails when ch holds an event.
func none(t *testing.T, ch chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
		t.Fatalf("%s", what)
	default:
	}
}

// TestRevokedWorkerNeverStartsKubelet: a restarted worker checks in before its kubelet starts. The
// cluster answers REVOKED: the kubelet does not start, the node is locked once, and it keeps asking;
// the next answers are REVOKED too (nothing more happens), then the operator re-admits it: the
// kubelet starts.
func TestRevokedWorkerNeverStartsKubelet(t *testing.T) {
	n, a, l := joinedNode(t, false)
	stop := n.run(t)
	if b := <-a.calls; b != testTiming.first {
		t.Fatalf("first check-in with %+v, want the first backoff", b)
	}
	a.next <- errRevoked
	<-l.locked
	<-a.calls
	a.next <- errRevoked
	<-a.calls
	none(t, n.kubelet.started, "the kubelet of a revoked worker started")
	none(t, l.locked, "the node was locked twice")
	a.next <- nil // berth node readmit
	<-n.kubelet.started
	if err := stop(); err != nil {
		t.Fatalf("Run() = %v", err)
	}
	none(t, n.kubelet.stopped, "the kubelet was stopped without a REVOKED answer while it ran")
}

// TestWorkerWithoutJoinServiceStartsKubelet: no joinservice answers the first check-in (a power cut
// of the whole cluster): the worker starts its kubelet and keeps asking; a later REVOKED stops it
// and locks the node.
func TestWorkerWithoutJoinServiceStartsKubelet(t *testing.T) {
	n, a, l := joinedNode(t, false)
	stop := n.run(t)
	<-a.calls
	none(t, n.kubelet.started, "the kubelet started before the first check-in ended")
	a.next <- errNoAnswer
	<-n.kubelet.started
	if b := <-a.calls; b != testTiming.background {
		t.Fatalf("check-in beside the kubelet with %+v, want the background backoff", b)
	}
	a.next <- errRevoked
	<-n.kubelet.stopped
	<-l.locked
	<-a.calls
	if err := stop(); err != nil {
		t.Fatalf("Run() = %v", err)
	}
}

// TestControlPlaneStartsKubeletBeforeCheckIn: a control plane's kubelet runs its joinservice, so it
// starts before any check-in (a cluster whose control planes all restart must not wait for itself);
// the check-in runs beside it, and a REVOKED answer stops it. A node whose role metadata cannot tell
// counts as a control plane.
func TestControlPlaneStartsKubeletBeforeCheckIn(t *testing.T) {
	for name, role := range map[string]func(context.Context) (bool, error){
		"control plane": func(context.Context) (bool, error) { return true, nil },
		"role unknown":  func(context.Context) (bool, error) { return false, errors.New("metadata unreachable") },
	} {
		t.Run(name, func(t *testing.T) {
			n, a, l := joinedNode(t, true)
			n.deps.ControlPlane = role
			stop := n.run(t)
			<-n.kubelet.started
			if b := <-a.calls; b != testTiming.background {
				t.Fatalf("check-in with %+v, want the background backoff", b)
			}
			a.next <- errRevoked
			<-n.kubelet.stopped
			<-l.locked
			<-a.calls
			if err := stop(); err != nil {
				t.Fatalf("Run() = %v", err)
			}
		})
	}
}
