package joinclient

import (
	"context"
	"crypto"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type staticMeta struct {
	self  metadata.Instance
	peers []metadata.Instance
}

func (m staticMeta) Self(context.Context) (metadata.Instance, error)    { return m.self, nil }
func (m staticMeta) Peers(context.Context) ([]metadata.Instance, error) { return m.peers, nil }

// joinService rejects the first `rejections` calls, then issues a ticket.
type joinService struct {
	joinproto.UnimplementedJoinServiceServer
	mu         sync.Mutex
	rejections int
	calls      int
	lastCSR    *x509.CertificateRequest
}

func (s *joinService) IssueJoinTicket(_ context.Context, req *joinproto.IssueJoinTicketRequest) (*joinproto.IssueJoinTicketResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	csr, err := x509.ParseCertificateRequest(req.GetKubeletCsr())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "bad CSR")
	}
	s.lastCSR = csr
	if s.calls <= s.rejections {
		st, _ := status.New(codes.PermissionDenied, "PCR 4: expected aa.., got bb..").WithDetails(&errdetails.ErrorInfo{Reason: "MEASUREMENT_MISMATCH", Domain: "berth"})
		return nil, st.Err()
	}
	return &joinproto.IssueJoinTicketResponse{NodeName: "worker-0", ClusterId: []byte{1}}, nil
}

type recordingJoiner struct {
	mu     sync.Mutex
	ticket *joinproto.IssueJoinTicketResponse
}

func (r *recordingJoiner) Join(_ context.Context, _ metadata.Instance, t *joinproto.IssueJoinTicketResponse, _ crypto.Signer) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ticket = t
	return nil
}

func startJoinService(t *testing.T, svc *joinService) (host string, port int) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	joinproto.RegisterJoinServiceServer(srv, svc)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	h, p, _ := net.SplitHostPort(lis.Addr().String())
	port, _ = strconv.Atoi(p)
	return h, port
}

func dial(_ context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return joinproto.NewJoinServiceClient(conn), conn, nil
}

// startBufJoinService serves svc on an in-memory listener and returns a dial function that
// reaches it for the endpoint want. Inside a synctest bubble, everything it starts belongs to the
// bubble.
func startBufJoinService(t *testing.T, svc joinproto.JoinServiceServer, want string) dialFunc {
	t.Helper()
	lis := serveBuf(t, svc)
	return func(_ context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
		if endpoint != want {
			return nil, nil, fmt.Errorf("dialing %s, want %s", endpoint, want)
		}
		return dialBuf(lis, endpoint)
	}
}

// serveBuf serves svc on an in-memory listener until the test ends.
func serveBuf(t *testing.T, svc joinproto.JoinServiceServer) *bufconn.Listener {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	joinproto.RegisterJoinServiceServer(srv, svc)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return lis
}

// dialBuf connects a join client for endpoint to the service serveBuf serves on lis.
func dialBuf(lis *bufconn.Listener, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
	conn, err := grpc.NewClient("passthrough:///"+endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		return nil, nil, err
	}
	return joinproto.NewJoinServiceClient(conn), conn, nil
}

// The client runs in a synctest bubble against a gRPC joinservice on an in-memory connection: the
// waits between attempts pass in the bubble's time and can be measured exactly.
func TestRunLogsRejectionsAndJoins(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		svc := &joinService{rejections: 2}
		self := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}
		meta := staticMeta{self: self, peers: []metadata.Instance{
			self,
			{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}},
		}}
		dial := startBufJoinService(t, svc, "198.51.100.10:9002")
		core, logs := observer.New(zap.InfoLevel)
		joiner := &recordingJoiner{}
		c := New(zap.New(core), meta, dial, joiner, "disk-1").WithPort(9002)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		start := time.Now()
		if err := c.Run(ctx); err != nil {
			t.Fatalf("Run() = %v", err)
		}
		// Two waits after the rejections: 100 ms and 200 ms, each ±50 %. A rejection slows the
		// retries only as the backoff grows, so the node still joins well within a second.
		if took := time.Since(start); took < 150*time.Millisecond || took >= 450*time.Millisecond {
			t.Fatalf("joined %s after the first attempt, want two jittered waits of 100 ms and 200 ms", took)
		}
		if joiner.ticket.GetNodeName() != "worker-0" {
			t.Fatalf("joiner got ticket %v", joiner.ticket)
		}
		rejected := logs.FilterMessage("join ticket rejected").All()
		if len(rejected) != 2 {
			t.Fatalf("logged %d rejections, want 2", len(rejected))
		}
		fields := rejected[0].ContextMap()
		if fields["reason"] != "MEASUREMENT_MISMATCH" || fields["code"] != "PermissionDenied" || fields["message"] != "PCR 4: expected aa.., got bb.." {
			t.Fatalf("rejection log fields = %v", fields)
		}
		if received := logs.FilterMessage("join ticket received").All(); len(received) != 1 || received[0].ContextMap()["attempt"] != int64(3) {
			t.Fatalf("ticket logs = %v, want one at attempt 3", received)
		}
		if cn := svc.lastCSR.Subject.CommonName; cn != "system:node:worker-0" {
			t.Fatalf("CSR CN = %q", cn)
		}
	})
}

// TestRunAgainstTCPJoinService is the same exchange over a real loopback listener, in real time.
func TestRunAgainstTCPJoinService(t *testing.T) {
	svc := &joinService{}
	host, port := startJoinService(t, svc)
	self := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}
	meta := staticMeta{self: self, peers: []metadata.Instance{self, {Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{host}}}}
	joiner := &recordingJoiner{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := New(zap.NewNop(), meta, dial, joiner, "").WithPort(port).Run(ctx); err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if joiner.ticket.GetNodeName() != "worker-0" {
		t.Fatalf("joiner got ticket %v", joiner.ticket)
	}
}

func TestRunStopsWhenCancelled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		self := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}
		// The first control plane has nobody to join: it waits until init wins and cancels it.
		c := New(zap.NewNop(), staticMeta{self: self, peers: []metadata.Instance{self}}, dial, &recordingJoiner{}, "")
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		synctest.Wait() // Run waits between attempts
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run() after cancel = %v, want nil", err)
		}
	})
}

func TestRetryDelay(t *testing.T) {
	for range 100 {
		d := newRetryDelay()
		if w := d.next(); w < initialBackoff/2 || w >= initialBackoff*3/2 {
			t.Fatalf("first wait %s outside [%s, %s)", w, initialBackoff/2, initialBackoff*3/2)
		}
		for range 10 {
			if w := d.next(); w < initialBackoff/2 || w > maxBackoff {
				t.Fatalf("wait %s outside [%s, %s]", w, initialBackoff/2, maxBackoff)
			}
		}
		d.rejected = true
		var longest time.Duration
		for range 20 {
			w := d.next()
			if w > maxRejectedWait {
				t.Fatalf("wait after a rejection %s above %s", w, maxRejectedWait)
			}
			longest = max(longest, w)
		}
		if longest < maxRejectedWait/2 {
			t.Fatalf("waits after rejections reached only %s, want up to %s", longest, maxRejectedWait)
		}
		// A round without a rejection: back within the short cap at once.
		d.rejected = false
		if w := d.next(); w < maxBackoff/2 || w > maxBackoff {
			t.Fatalf("wait after rejections stopped = %s, want within [%s, %s]", w, maxBackoff/2, maxBackoff)
		}
	}
}

// A joinservice that refuses the node's claimed measurements does so in the TLS handshake; the node
// still logs it as a rejection with the joinservice's reason, not as an unreachable endpoint.
func TestRejectionInHandshake(t *testing.T) {
	verdict := &atls.Rejection{Reason: "MEASUREMENT_MISMATCH", Message: "claimed measurements do not satisfy the cluster policy"}
	err := status.Error(codes.Unavailable, fmt.Sprintf("connection error: desc = %q", "transport: authentication handshake failed: attested TLS handshake: "+verdict.Error()))
	r, ok := asRejection(err)
	if !ok || !r.unverified || r.reason != "MEASUREMENT_MISMATCH" || r.message != verdict.Message || r.code != codes.PermissionDenied {
		t.Fatalf("asRejection = %+v, %v", r, ok)
	}
	if _, ok := asRejection(status.Error(codes.Unavailable, "connection refused")); ok {
		t.Fatal("an unreachable endpoint counted as a rejection")
	}
}
