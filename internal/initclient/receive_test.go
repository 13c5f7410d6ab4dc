package initclient

import (
	"context"
	"errors"
	"io"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/initproto"
)

// fakeStream replays responses, then ends with end.
type fakeStream struct {
	grpc.ClientStream
	resps []*initproto.InitResponse
	end   error
}

func (s *fakeStream) Recv() (*initproto.InitResponse, error) {
	if len(s.resps) == 0 {
		return nil, s.end
	}
	r := s.resps[0]
	s.resps = s.resps[1:]
	return r, nil
}

// TestReceive: progress and output reach the handler in order; the result or the stream's end
// becomes the error the CLI tells apart.
func TestReceive(t *testing.T) {
	progress := &initproto.InitResponse{Kind: &initproto.InitResponse_Progress{Progress: &initproto.Progress{Phase: "kubeadm", Index: 1, Total: 2}}}
	logged := &initproto.InitResponse{Kind: &initproto.InitResponse_Log{Log: &initproto.LogChunk{Data: []byte("out\n")}}}
	success := &initproto.InitSuccess{Kubeconfig: []byte("kc"), ClusterId: []byte{1}}
	failure := &initproto.InitFailure{Message: "boom", Retryable: true}

	var seen []string
	h := Handler{
		Progress: func(p *initproto.Progress) { seen = append(seen, "progress "+p.GetPhase()) },
		Log:      func(b []byte) { seen = append(seen, "log "+string(b)) },
	}
	got, err := Receive(&fakeStream{resps: []*initproto.InitResponse{progress, logged, {Kind: &initproto.InitResponse_Success{Success: success}}}}, h)
	if err != nil || got != success {
		t.Fatalf("Receive = %v, %v; want the success", got, err)
	}
	if want := []string{"progress kubeadm", "log out\n"}; !reflect.DeepEqual(seen, want) {
		t.Errorf("handler saw %q, want %q", seen, want)
	}

	var fe *FailureError
	if _, err := Receive(&fakeStream{resps: []*initproto.InitResponse{{Kind: &initproto.InitResponse_Failure{Failure: failure}}}}, Handler{}); !errors.As(err, &fe) || fe.Failure != failure {
		t.Errorf("Receive(failure) = %v, want the node's failure", err)
	}
	broken := status.Error(codes.Unavailable, "gone")
	for name, tc := range map[string]struct{ end, want error }{
		"eof":          {io.EOF, ErrNoResult},
		"denied":       {status.Error(codes.PermissionDenied, "no"), ErrRejected},
		"rate-limited": {status.Error(codes.ResourceExhausted, "slow down"), ErrRateLimited},
		"broken":       {broken, broken},
	} {
		if _, err := Receive(&fakeStream{end: tc.end}, Handler{}); !errors.Is(err, tc.want) {
			t.Errorf("%s: Receive = %v, want %v", name, err, tc.want)
		}
	}
}

// TestWaitConnected: a node that never answers ends the wait after the timeout, naming it; one that
// accepts connections is reached.
func TestWaitConnected(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // nothing listens there now
	conn, verdict, err := NewConn(addr, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = WaitConnected(context.Background(), conn, 300*time.Millisecond, verdict)
	_ = conn.Close()
	if err == nil || !strings.HasPrefix(err.Error(), "could not reach the node within 300ms") {
		t.Errorf("WaitConnected(nobody) = %v", err)
	}

	l, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()
	conn, verdict, err = NewConn(l.Addr().String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if err := WaitConnected(context.Background(), conn, 10*time.Second, verdict); err != nil {
		t.Errorf("WaitConnected(server) = %v", err)
	}
	if verdict.Accepted() != nil {
		t.Errorf("evidence without attestation: %v", verdict.Accepted())
	}
}
