// Package serve runs a gRPC or an HTTP server until its context ends, then stops it: gracefully
// first (no new calls or requests, the running ones may finish), forcibly once a bound passed (every
// connection is closed). GRPC and HTTP serve and stop; StopGRPC and StopHTTP only stop, for a server
// whose owner ends it on more than its context (the recovery server, the webhook's drain).
package serve

import (
	"context"
	"errors"
	"net"
	"time"

	"google.golang.org/grpc"
)

// GRPC serves srv on lis until ctx ends, then stops it with StopGRPC(srv, grace). It returns nil
// once srv stopped because ctx ended; Serve's error when the server failed, before or while it
// stopped. A stop that came before Serve began (grpc.ErrServerStopped) is no failure.
func GRPC(ctx context.Context, srv *grpc.Server, lis net.Listener, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	StopGRPC(srv, grace)
	// Serve returns nil once GracefulStop or Stop ran; anything else is a failure of its own.
	if err := <-errc; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// StopGRPC stops srv gracefully (it takes no new calls and lets the running ones finish) and, once
// grace passed, forcibly (every connection is closed, every running call's context ends). It
// returns when srv has stopped; the goroutine it runs GracefulStop in has ended by then, which
// after a forced stop means once the cut-off handlers returned: a handler must end with its context.
func StopGRPC(srv *grpc.Server, grace time.Duration) {
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-stopped:
	case <-t.C:
		srv.Stop()
		<-stopped
	}
}
