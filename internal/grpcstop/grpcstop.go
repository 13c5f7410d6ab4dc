// Package grpcstop stops a gRPC server gracefully within a bound: calls in flight may finish, but a
// call that outlasts the bound has its connection closed.
package grpcstop

import (
	"time"

	"google.golang.org/grpc"
)

// Gracefully stops srv gracefully (it takes no new calls and lets the running ones finish) and, once
// timeout passed, forcibly (every connection is closed). It returns when srv has stopped; the
// goroutine it runs GracefulStop in has ended by then.
func Gracefully(srv *grpc.Server, timeout time.Duration) {
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-stopped:
	case <-t.C:
		srv.Stop()
		<-stopped
	}
}
