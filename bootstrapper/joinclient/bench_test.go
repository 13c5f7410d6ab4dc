package joinclient

import (
	"context"
	"crypto"
	"io"
	"net"
	"sort"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// capAttempts is the attempt after which the wait is at its cap (100, 200, 400, then 500 ms).
const capAttempts = 5

// signalingService records when its first ticket request arrived.
type signalingService struct {
	joinproto.UnimplementedJoinServiceServer
	first chan time.Time
}

func (s *signalingService) IssueJoinTicket(context.Context, *joinproto.IssueJoinTicketRequest) (*joinproto.IssueJoinTicketResponse, error) {
	select {
	case s.first <- time.Now():
	default:
	}
	return &joinproto.IssueJoinTicketResponse{NodeName: "worker-0", ClusterId: []byte{1}}, nil
}

// closeNotifier closes closed after closing its Closer.
type closeNotifier struct {
	io.Closer
	closed chan struct{}
}

func (c closeNotifier) Close() error {
	defer close(c.closed)
	return c.Closer.Close()
}

type doneJoiner struct{}

func (doneJoiner) Join(context.Context, metadata.Instance, *joinproto.IssueJoinTicketResponse, crypto.Signer) error {
	return nil
}

// BenchmarkJoinReaction measures how long after a joinservice starts answering a waiting node asks
// it for a ticket (the design goal is under 1 s). Each iteration starts the joinservice just after
// the node's capAttempts-th attempt failed: the node's backoff is at its cap and its whole wait lies
// ahead, so this measures the slowest reaction (a joinservice starting at a random moment of the
// wait is seen sooner). Run: go test -run '^$' -bench JoinReaction -benchtime 10x ./bootstrapper/joinclient/
func BenchmarkJoinReaction(b *testing.B) {
	var reactions []time.Duration
	for range b.N {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		addr := lis.Addr().String()
		lis.Close()
		host, portStr, _ := net.SplitHostPort(addr)
		port, _ := strconv.Atoi(portStr)
		self := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.20"}}
		meta := staticMeta{self: self, peers: []metadata.Instance{self, {Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{host}}}}
		atCap := make(chan struct{})
		attempts := 0
		// The capAttempts-th attempt is over when its connection is closed: the node then waits.
		countingDial := func(ctx context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
			client, conn, err := dial(ctx, endpoint)
			if attempts++; attempts == capAttempts && err == nil {
				conn = closeNotifier{Closer: conn, closed: atCap}
			}
			return client, conn, err
		}
		c := New(zap.NewNop(), meta, countingDial, doneJoiner{}, "").WithPort(port)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		<-atCap

		svc := &signalingService{first: make(chan time.Time, 1)}
		srv := grpc.NewServer()
		joinproto.RegisterJoinServiceServer(srv, svc)
		lis, err = net.Listen("tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		started := time.Now()
		go func() { _ = srv.Serve(lis) }()
		reactions = append(reactions, (<-svc.first).Sub(started))
		<-done
		cancel()
		srv.Stop()
	}
	sort.Slice(reactions, func(i, j int) bool { return reactions[i] < reactions[j] })
	b.ReportMetric(float64(reactions[len(reactions)/2].Milliseconds()), "p50_ms")
	b.ReportMetric(float64(reactions[len(reactions)-1].Milliseconds()), "max_ms")
}
