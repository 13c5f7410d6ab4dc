package serve

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"
)

// HTTP serves srv on lis until ctx ends, then stops it with StopHTTP(srv, grace). It returns nil
// once srv stopped because ctx ended, whether the stop was graceful or forced; Serve's error when
// the server failed first.
func HTTP(ctx context.Context, srv *http.Server, lis net.Listener, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	_ = StopHTTP(srv, grace) // a forced stop is the bound doing its work, not a failure
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// StopHTTP stops srv gracefully (it closes its listeners and idle connections and lets running
// requests finish) and, once grace passed, forcibly (srv.Close closes every connection). It returns
// nil when the graceful stop finished in time, else why it did not.
func StopHTTP(srv *http.Server, grace time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := srv.Shutdown(ctx)
	if err == nil {
		return nil
	}
	_ = srv.Close()
	return fmt.Errorf("stopping gracefully: %w", err)
}
