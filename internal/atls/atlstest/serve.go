package atlstest

import (
	"context"
	"crypto/tls"
	"net"
	"sync"
	"testing"
	"time"
)

// Serve accepts connections on loopback until the test or benchmark ends and returns the
// listener's address. Each connection goes to handle on its own goroutine, as a server's do; handle
// closes it. The test's cleanup closes the listener and waits until every handle returned.
func Serve(tb testing.TB, handle func(net.Conn)) string {
	tb.Helper()
	var lc net.ListenConfig
	lis, err := lc.Listen(tb.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { handle(c) })
		}
	})
	tb.Cleanup(func() {
		_ = lis.Close()
		wg.Wait()
	})
	return lis.Addr().String()
}

// ServeTLS serves TLS handshakes with cfg (Serve): after a handshake that succeeded, the connection
// is held open until the client closes it; ten seconds bound each connection.
func ServeTLS(tb testing.TB, cfg *tls.Config) string {
	tb.Helper()
	testCtx := tb.Context()
	return Serve(tb, func(c net.Conn) {
		tc := tls.Server(c, cfg)
		defer func() { _ = tc.Close() }()
		ctx, cancel := context.WithTimeout(testCtx, 10*time.Second)
		defer cancel()
		_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
		if tc.HandshakeContext(ctx) == nil {
			_, _ = tc.Read(make([]byte, 1))
		}
	})
}
