package joinclient

import (
	"context"
	"crypto"
	"crypto/x509"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

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

func TestRunLogsRejectionsAndJoins(t *testing.T) {
	svc := &joinService{rejections: 2}
	host, port := startJoinService(t, svc)
	self := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}
	meta := staticMeta{self: self, peers: []metadata.Instance{
		self,
		{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{host}},
	}}
	core, logs := observer.New(zap.InfoLevel)
	joiner := &recordingJoiner{}
	c := New(zap.New(core), meta, dial, joiner, "disk-1").WithPort(port)
	c.sleep = func(ctx context.Context, d time.Duration) error {
		if d > maxRejectedWait {
			t.Errorf("backoff %s exceeds cap %s", d, maxRejectedWait)
		}
		return ctx.Err()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.Run(ctx); err != nil {
		t.Fatalf("Run() = %v", err)
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
	if cn := svc.lastCSR.Subject.CommonName; cn != "system:node:worker-0" {
		t.Fatalf("CSR CN = %q", cn)
	}
}

func TestRunStopsWhenCancelled(t *testing.T) {
	self := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}
	// The first control plane has nobody to join: it waits until init wins and cancels it.
	c := New(zap.NewNop(), staticMeta{self: self, peers: []metadata.Instance{self}}, dial, &recordingJoiner{}, "")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	time.Sleep(50 * time.Millisecond)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() after cancel = %v, want nil", err)
	}
}

func TestBackoffBounds(t *testing.T) {
	var d time.Duration
	for range 100 {
		d = nextBackoff(d, false)
		if d < initialBackoff/2 || d > maxBackoff {
			t.Fatalf("backoff %s outside [%s, %s]", d, initialBackoff/2, maxBackoff)
		}
	}
	for range 100 {
		d = nextBackoff(d, true)
		if d > maxRejectedWait {
			t.Fatalf("rejected backoff %s above %s", d, maxRejectedWait)
		}
	}
}

// A joinservice that refuses the node's claimed measurements does so in the TLS handshake; the node
// still logs it as a rejection with the joinservice's reason, not as an unreachable endpoint.
func TestRejectionInHandshake(t *testing.T) {
	err := status.Error(codes.Unavailable, `connection error: desc = "transport: authentication handshake failed: attested TLS handshake: `+
		`attestation refused on claimed measurements: MEASUREMENT_MISMATCH: index 4: expected aa.., got bb.."`)
	r, ok := asRejection(err)
	if !ok || !r.unverified || r.reason != "MEASUREMENT_MISMATCH" || r.message != "index 4: expected aa.., got bb.." || r.code != codes.PermissionDenied {
		t.Fatalf("asRejection = %+v, %v", r, ok)
	}
	if _, ok := asRejection(status.Error(codes.Unavailable, "connection refused")); ok {
		t.Fatal("an unreachable endpoint counted as a rejection")
	}
}
