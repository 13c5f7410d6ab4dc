package joinclient

import (
	"context"
	"crypto"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// traceService is a joinService that stores reported traces, or refuses them with refuse.
type traceService struct {
	joinService
	refuse  string
	reports [][]*joinproto.JoinPhase
}

func (s *traceService) ReportTrace(_ context.Context, req *joinproto.ReportTraceRequest) (*joinproto.ReportTraceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reports = append(s.reports, req.GetPhases())
	if s.refuse != "" {
		st, _ := status.New(codes.FailedPrecondition, "no machine").WithDetails(&errdetails.ErrorInfo{Reason: s.refuse, Domain: "berth"})
		return nil, st.Err()
	}
	return &joinproto.ReportTraceResponse{Machine: "m-1"}, nil
}

// slowJoiner takes took to join and fails with err.
type slowJoiner struct {
	took time.Duration
	err  error
}

func (j slowJoiner) Join(context.Context, metadata.Instance, *joinproto.IssueJoinTicketResponse, crypto.Signer) error {
	time.Sleep(j.took)
	return j.err
}

// readyAfter is a Node that becomes Ready after a while.
type readyAfter struct{ d time.Duration }

func (r readyAfter) WaitReady(ctx context.Context, _ string) error {
	select {
	case <-time.After(r.d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func runTraced(t *testing.T, svc *traceService, joiner clusterJoiner, ready nodeReadiness) (jointrace.Trace, afero.Fs) {
	t.Helper()
	self := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}
	meta := staticMeta{self: self, peers: []metadata.Instance{self, {Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}}}
	fs := afero.NewMemMapFs()
	c := New(zap.NewNop(), meta, startBufJoinService(t, svc, "198.51.100.10:9002"), joiner, "disk-1").WithPort(9002).
		WithTrace(jointrace.NewRecorder(zap.NewNop(), fs, "/state/"+jointrace.FileName), ready)
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	_ = c.Run(ctx)
	tr, err := jointrace.Load(fs, "/state/"+jointrace.FileName)
	if err != nil {
		t.Fatal(err)
	}
	return tr, fs
}

// TestRunTracesAndReportsTheJoin: a join's phases, with their durations as they passed, land in
// the state directory's file and in one ReportTrace call.
func TestRunTracesAndReportsTheJoin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := &traceService{joinService: joinService{rejections: 1}}
		tr, _ := runTraced(t, svc, slowJoiner{took: 40 * time.Second}, readyAfter{d: 12 * time.Second})
		names := []string{jointrace.PhaseMetadata, jointrace.PhaseTicket, jointrace.PhaseJoin, jointrace.PhaseReady}
		if len(tr.Phases) != len(names) {
			t.Fatalf("trace = %+v, want %v", tr, names)
		}
		for i, p := range tr.Phases {
			if p.Name != names[i] || p.Outcome != jointrace.OutcomeSucceeded {
				t.Errorf("phase %d = %+v, want %s succeeded", i, p, names[i])
			}
		}
		if tr.Phases[2].Duration != 40*time.Second || tr.Phases[3].Duration != 12*time.Second {
			t.Errorf("durations: join %s, ready %s; want 40s, 12s", tr.Phases[2].Duration, tr.Phases[3].Duration)
		}
		if tr.Phases[1].Message != "attempt 2, from 198.51.100.10:9002" {
			t.Errorf("ticket phase message %q", tr.Phases[1].Message)
		}
		if len(svc.reports) != 1 || len(svc.reports[0]) != 4 || svc.reports[0][3].GetDuration().AsDuration() != 12*time.Second {
			t.Errorf("reports = %v, want the whole trace once", svc.reports)
		}
	})
}

// TestRunReportsAFailedJoin: a failed kubeadm join is traced with its reason and reported; a
// NO_MACHINE answer ends the reporting after one call.
func TestRunReportsAFailedJoin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := &traceService{}
		tr, _ := runTraced(t, svc, slowJoiner{took: time.Second, err: errors.New("kubeadm join failed: exit status 1")}, readyAfter{})
		failed, ok := tr.Failed()
		if !ok || failed.Name != jointrace.PhaseJoin || failed.Reason != jointrace.ReasonJoinFailed || failed.Message != "kubeadm join failed: exit status 1" {
			t.Fatalf("failed phase = %+v, %v", failed, ok)
		}
		if len(tr.Phases) != 3 {
			t.Errorf("a failed join went on to wait for Ready: %+v", tr.Phases)
		}
		if len(svc.reports) != 1 || len(svc.reports[0]) != 3 || svc.reports[0][2].GetReason() != jointrace.ReasonJoinFailed {
			t.Fatalf("reports = %v, want the failed trace once", svc.reports)
		}

		svc = &traceService{refuse: reasonNoMachine}
		runTraced(t, svc, slowJoiner{}, readyAfter{})
		if len(svc.reports) != 1 {
			t.Errorf("%d reports after NO_MACHINE, want 1", len(svc.reports))
		}
	})
}

// TestNodeReady reads the Node's Ready condition.
func TestNodeReady(t *testing.T) {
	node := func(status corev1.ConditionStatus) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w1"}}
		if status != "" {
			n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status, Reason: "KubeletNotReady"}}
		}
		return n
	}
	for name, tc := range map[string]struct {
		objs  []*corev1.Node
		ready bool
	}{
		"ready":        {[]*corev1.Node{node(corev1.ConditionTrue)}, true},
		"not ready":    {[]*corev1.Node{node(corev1.ConditionFalse)}, false},
		"no condition": {[]*corev1.Node{node("")}, false},
		"no node":      {nil, false},
	} {
		client := fake.NewClientset()
		for _, n := range tc.objs {
			if _, err := client.CoreV1().Nodes().Create(t.Context(), n, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		ready, err := nodeReady(t.Context(), client, "w1")
		if ready != tc.ready || ready == (err != nil) {
			t.Errorf("%s: nodeReady = %v, %v", name, ready, err)
		}
	}
}
