package joinclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

const rejoinDiskUUID = "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"

var (
	rejoinBinding = bytes.Repeat([]byte{7}, 32)
	rejoinKey     = bytes.Repeat([]byte{8}, 32)
	rejoinCluster = bytes.Repeat([]byte{9}, 32)
)

// rejoinService answers IssueRejoinTicket (and CheckIn) with its scripted errors, one per call, then
// with a ticket (or with the last error forever when always is set).
type rejoinService struct {
	joinproto.UnimplementedJoinServiceServer
	mu     sync.Mutex
	errs   []error
	always bool
	resp   *joinproto.IssueRejoinTicketResponse
	reqs   []*joinproto.IssueRejoinTicketRequest
}

func (s *rejoinService) IssueRejoinTicket(_ context.Context, req *joinproto.IssueRejoinTicketRequest) (*joinproto.IssueRejoinTicketResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reqs = append(s.reqs, req)
	if len(s.errs) > 0 {
		err := s.errs[0]
		if !s.always || len(s.errs) > 1 {
			s.errs = s.errs[1:]
		}
		return nil, err
	}
	if s.resp != nil {
		return s.resp, nil
	}
	return &joinproto.IssueRejoinTicketResponse{DiskKey: rejoinKey, ClusterId: rejoinCluster}, nil
}

// CheckIn answers like IssueRejoinTicket: the scripted errors, then an admission.
func (s *rejoinService) CheckIn(_ context.Context, req *joinproto.CheckInRequest) (*joinproto.CheckInResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reqs = append(s.reqs, &joinproto.IssueRejoinTicketRequest{DiskUuid: req.GetDiskUuid()})
	if len(s.errs) > 0 {
		err := s.errs[0]
		if !s.always || len(s.errs) > 1 {
			s.errs = s.errs[1:]
		}
		return nil, err
	}
	return &joinproto.CheckInResponse{NodeName: "cp-2"}, nil
}

func (s *rejoinService) calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.reqs)
}

// serveRejoin serves each endpoint's service on an in-memory listener and returns a dial function
// for them; an endpoint without a service is unreachable, and dialing this node's own endpoint fails
// the test.
func serveRejoin(t *testing.T, services map[string]*rejoinService, self string) dialFunc {
	t.Helper()
	listeners := map[string]*bufconn.Listener{}
	for ep, svc := range services {
		listeners[ep] = serveBuf(t, svc)
	}
	return func(_ context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
		if endpoint == self {
			t.Errorf("the node asked its own joinservice (%s)", endpoint)
		}
		lis, ok := listeners[endpoint]
		if !ok {
			return nil, nil, fmt.Errorf("dialing %s: connection refused", endpoint)
		}
		return dialBuf(lis, endpoint)
	}
}

// cluster is metadata for a node cp-2 (a control plane itself) with control planes cp-0 and cp-1
// and a worker.
var cluster = func() staticMeta {
	self := metadata.Instance{Name: "cp-2", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.12"}}
	return staticMeta{self: self, peers: []metadata.Instance{
		{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}},
		{Name: "cp-1", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.11"}},
		self,
		{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}},
	}}
}()

func refusal(code codes.Code, reason, msg string) error {
	st, _ := status.New(code, msg).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: "berth.joinservice"})
	return st.Err()
}

func rejoin(ctx context.Context, log *zap.Logger, dial dialFunc) ([]byte, []byte, error) {
	return Rejoin(ctx, log, cluster, dial, 9002, rejoinDiskUUID, rejoinBinding)
}

func TestRejoinRetriesUntilAJoinserviceAnswers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// cp-0 is down; cp-1 answers Unavailable twice (its joinservice still starting), then gives
		// the key.
		cp1 := &rejoinService{errs: []error{status.Error(codes.Unavailable, "starting"), status.Error(codes.Unavailable, "starting")}}
		dial := serveRejoin(t, map[string]*rejoinService{"198.51.100.11:9002": cp1}, "198.51.100.12:9002")
		core, logs := observer.New(zap.DebugLevel)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		start := time.Now()
		key, id, err := rejoin(ctx, zap.New(core), dial)
		if err != nil {
			t.Fatalf("Rejoin() = %v", err)
		}
		if !bytes.Equal(key, rejoinKey) || !bytes.Equal(id, rejoinCluster) {
			t.Fatalf("Rejoin() = %x, %x", key, id)
		}
		// Two waits: 100 ms and 200 ms, each lengthened by up to half.
		if took := time.Since(start); took < 300*time.Millisecond || took > 450*time.Millisecond {
			t.Fatalf("got the key %s after the first attempt, want two jittered waits of 100 ms and 200 ms", took)
		}
		if cp1.calls() != 3 {
			t.Fatalf("cp-1 was asked %d times, want 3", cp1.calls())
		}
		for _, req := range cp1.reqs {
			if req.GetDiskUuid() != rejoinDiskUUID || !bytes.Equal(req.GetDiskBinding(), rejoinBinding) {
				t.Fatalf("request %v, want the disk UUID and binding", req)
			}
		}
		got := logs.FilterMessage("rejoin ticket received").All()
		if len(got) != 1 || got[0].ContextMap()["attempt"] != int64(3) || got[0].ContextMap()["endpoint"] != "198.51.100.11:9002" {
			t.Fatalf("logs %v, want the ticket from cp-1 at attempt 3", got)
		}
		for _, e := range logs.All() {
			for _, v := range e.ContextMap() {
				if s := fmt.Sprint(v); strings.Contains(s, string(rejoinKey)) || strings.Contains(s, fmt.Sprintf("%x", rejoinKey)) {
					t.Fatalf("the disk key is in the log: %v", e)
				}
			}
		}
	})
}

func TestRejoinReturnsARefusal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		msg := "this disk does not belong to the attested machine\x1b[2J\n\u202e"
		cp0 := &rejoinService{errs: []error{refusal(codes.PermissionDenied, "DISK_NOT_BOUND", msg)}, always: true}
		cp1 := &rejoinService{errs: []error{status.Error(codes.Unavailable, "starting")}, always: true}
		dial := serveRejoin(t, map[string]*rejoinService{"198.51.100.10:9002": cp0, "198.51.100.11:9002": cp1}, "")
		core, logs := observer.New(zap.InfoLevel)
		key, _, err := rejoin(context.Background(), zap.New(core), dial)
		if key != nil || !errors.Is(err, ErrRejoinRefused) {
			t.Fatalf("Rejoin() = %x, %v, want ErrRejoinRefused", key, err)
		}
		var r *RejoinRefusedError
		if !errors.As(err, &r) || r.Reason != "DISK_NOT_BOUND" || r.Code != codes.PermissionDenied || r.Endpoint != "198.51.100.10:9002" || r.Unverified {
			t.Fatalf("refusal %+v", r)
		}
		if want := "this disk does not belong to the attested machine?[2J??"; r.Message != want {
			t.Fatalf("message %q, want the escaped %q", r.Message, want)
		}
		if strings.ContainsAny(err.Error(), "\x1b\n\u202e") {
			t.Fatalf("error text carries control characters: %q", err)
		}
		// Returned after one round: both control planes were asked once.
		if cp0.calls() != 1 || cp1.calls() != 1 {
			t.Fatalf("calls %d, %d, want one each", cp0.calls(), cp1.calls())
		}
		if l := logs.FilterMessage("rejoin refused").All(); len(l) != 1 || l[0].ContextMap()["reason"] != "DISK_NOT_BOUND" {
			t.Fatalf("logs %v", l)
		}
	})
}

func TestRejoinPrefersAnAnswerToARefusal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// cp-0 refuses (its policy not updated yet), cp-1 gives the key in the same round.
		cp0 := &rejoinService{errs: []error{refusal(codes.PermissionDenied, "MEASUREMENT_MISMATCH", "index 4: expected aa, got bb")}, always: true}
		cp1 := &rejoinService{}
		dial := serveRejoin(t, map[string]*rejoinService{"198.51.100.10:9002": cp0, "198.51.100.11:9002": cp1}, "")
		key, _, err := rejoin(context.Background(), zap.NewNop(), dial)
		if err != nil || !bytes.Equal(key, rejoinKey) {
			t.Fatalf("Rejoin() = %x, %v", key, err)
		}
	})
}

func TestRejoinNamesARefusalInTheHandshake(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		verdict := &atls.Rejection{Reason: "MEASUREMENT_MISMATCH", Message: "claimed measurements do not satisfy the cluster policy"}
		claims := status.Error(codes.Unavailable, fmt.Sprintf("connection error: desc = %q", "transport: authentication handshake failed: probing attestation identity: "+verdict.Error()))
		cp0 := &rejoinService{errs: []error{claims}, always: true}
		dial := serveRejoin(t, map[string]*rejoinService{"198.51.100.10:9002": cp0}, "")
		_, _, err := rejoin(context.Background(), zap.NewNop(), dial)
		var r *RejoinRefusedError
		if !errors.As(err, &r) || !r.Unverified || r.Reason != "MEASUREMENT_MISMATCH" || r.Message != verdict.Message {
			t.Fatalf("Rejoin() = %v, want an unverified MEASUREMENT_MISMATCH refusal", err)
		}
		if !strings.Contains(err.Error(), "has not attested yet") {
			t.Fatalf("error %q does not say the refusal is unverified", err)
		}
	})
}

func TestRejoinKeepsTryingUntilTheContextEnds(t *testing.T) {
	for name, cp0 := range map[string]*rejoinService{
		"unreachable":  nil,
		"rate-limited": {errs: []error{refusal(codes.ResourceExhausted, "RATE_LIMITED", "too many join attempts: retry later")}, always: true},
		"failing handshake": {errs: []error{status.Error(codes.Unavailable,
			`connection error: desc = "transport: authentication handshake failed: measurement mismatch: index 15: expected any non-zero value"`)}, always: true},
		"short disk key": {resp: &joinproto.IssueRejoinTicketResponse{DiskKey: rejoinKey[:16], ClusterId: rejoinCluster}},
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				services := map[string]*rejoinService{}
				if cp0 != nil {
					services["198.51.100.10:9002"] = cp0
				}
				dial := serveRejoin(t, services, "")
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				key, _, err := rejoin(ctx, zap.NewNop(), dial)
				if key != nil || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrRejoinRefused) {
					t.Fatalf("Rejoin() = %x, %v, want the context's end", key, err)
				}
				// 100, 200, 400, 800 ms, then a second each (each up to half longer): at least 7 rounds.
				if cp0 != nil && cp0.calls() < 7 {
					t.Fatalf("asked %d times in 10 s, want at least 7", cp0.calls())
				}
				if cp0 != nil && !strings.Contains(err.Error(), "198.51.100.10:9002: ") {
					t.Fatalf("error %q does not say what cp-0 answered", err)
				}
				t.Logf("error: %v", err)
			})
		})
	}
}

func TestRejoinBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Nothing answers for a minute: the rounds settle at one a second plus jitter.
		var (
			mu    sync.Mutex
			times []time.Time
		)
		dial := func(context.Context, string) (joinproto.JoinServiceClient, io.Closer, error) {
			mu.Lock()
			defer mu.Unlock()
			times = append(times, time.Now())
			return nil, nil, errors.New("connection refused")
		}
		meta := staticMeta{peers: []metadata.Instance{{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}}}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, _, err := Rejoin(ctx, zap.NewNop(), meta, dial, 9002, rejoinDiskUUID, rejoinBinding); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Rejoin() = %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		var jittered bool
		for i := 5; i < len(times); i++ {
			gap := times[i].Sub(times[i-1])
			if gap < rejoinMaxBackoff || gap > rejoinMaxBackoff*3/2 {
				t.Fatalf("round %d came %s after the one before, want within [%s, %s]", i, gap, rejoinMaxBackoff, rejoinMaxBackoff*3/2)
			}
			jittered = jittered || gap != rejoinMaxBackoff
		}
		if !jittered || len(times) < 40 {
			t.Fatalf("%d rounds in a minute, jittered %v", len(times), jittered)
		}
	})
}
