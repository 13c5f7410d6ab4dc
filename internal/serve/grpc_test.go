package serve

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/emptypb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serve starts a server on an in-memory listener whose every call runs handler, and returns it with
// a call to it (which reports its outcome on the returned channel once it ends) and the result of
// Serve.
func serve(t *testing.T, handler func(ctx context.Context) error) (srv *grpc.Server, call func() <-chan error, served <-chan error) {
	t.Helper()
	lis := bufconn.Listen(1 << 16)
	srv = grpc.NewServer(grpc.UnknownServiceHandler(func(_ any, stream grpc.ServerStream) error {
		if err := stream.RecvMsg(&emptypb.Empty{}); err != nil {
			return err
		}
		if err := handler(stream.Context()); err != nil {
			return err
		}
		return stream.SendMsg(&emptypb.Empty{})
	}))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufnet", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	call = func() <-chan error {
		done := make(chan error, 1)
		go func() {
			done <- conn.Invoke(context.Background(), "/test.Service/Call", &emptypb.Empty{}, &emptypb.Empty{})
		}()
		return done
	}
	return srv, call, errc
}

func TestStopGRPCLetsACallFinish(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	srv, call, served := serve(t, func(context.Context) error {
		close(entered)
		<-release
		return nil
	})
	done := call()
	<-entered
	stopped := make(chan struct{})
	go func() {
		StopGRPC(srv, time.Hour)
		close(stopped)
	}()
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("the call in flight = %v, want it answered", err)
	}
	<-stopped
	if err := <-served; err != nil {
		t.Fatalf("Serve() = %v", err)
	}
}

func TestStopGRPCCutsACallOffAfterTheTimeout(t *testing.T) {
	entered := make(chan struct{})
	srv, call, served := serve(t, func(ctx context.Context) error {
		close(entered)
		<-ctx.Done() // a call that never ends by itself
		return ctx.Err()
	})
	done := call()
	<-entered
	StopGRPC(srv, 50*time.Millisecond)
	if err := <-done; status.Code(err) != codes.Unavailable && status.Code(err) != codes.Canceled {
		t.Fatalf("the call in flight = %v, want it cut off", err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve() = %v", err)
	}
}

func TestStopGRPCWithoutCalls(t *testing.T) {
	srv, _, served := serve(t, func(context.Context) error { return nil })
	StopGRPC(srv, time.Hour)
	// The stop may come before Serve began to serve: then Serve says so.
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		t.Fatalf("Serve() = %v", err)
	}
}

func TestGRPCStopsWhenCtxEnds(t *testing.T) {
	lis := bufconn.Listen(1 << 16)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- GRPC(ctx, grpc.NewServer(), lis, time.Hour) }()
	cancel()
	if err := <-served; err != nil {
		t.Fatalf("GRPC() = %v, want nil after ctx ended", err)
	}
}

func TestGRPCReturnsAServeFailure(t *testing.T) {
	lis := bufconn.Listen(1 << 16)
	lis.Close()
	err := GRPC(context.Background(), grpc.NewServer(), lis, time.Hour)
	if err == nil {
		t.Fatal("GRPC() on a closed listener = nil, want the failure")
	}
}
