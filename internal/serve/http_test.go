package serve

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// serveHTTP serves handler on a loopback port through HTTP until the returned cancel is called, and
// returns the server's URL and the result of HTTP.
func serveHTTP(t *testing.T, handler http.HandlerFunc, grace time.Duration) (url string, cancel func(), served <-chan error) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	go func() { errc <- HTTP(ctx, srv, lis, grace) }()
	t.Cleanup(cancel)
	return "http://" + lis.Addr().String(), cancel, errc
}

// get requests url and reports the outcome on the returned channel.
func get(url string) <-chan error {
	done := make(chan error, 1)
	go func() {
		resp, err := http.Get(url) //nolint:noctx // the test ends the request from the server's side
		if err != nil {
			done <- err
			return
		}
		defer resp.Body.Close()
		_, err = io.ReadAll(resp.Body)
		done <- err
	}()
	return done
}

func TestHTTPLetsARequestFinish(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	url, cancel, served := serveHTTP(t, func(w http.ResponseWriter, _ *http.Request) {
		close(entered)
		<-release
		_, _ = w.Write([]byte("ok"))
	}, time.Hour)
	done := get(url)
	<-entered
	cancel()
	time.Sleep(50 * time.Millisecond) // the stop is under way
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("the request in flight = %v, want it answered", err)
	}
	if err := <-served; err != nil {
		t.Fatalf("HTTP() = %v", err)
	}
}

func TestHTTPCutsARequestOffAfterTheGrace(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	url, cancel, served := serveHTTP(t, func(http.ResponseWriter, *http.Request) {
		close(entered)
		<-release // a request that does not end by itself
	}, 50*time.Millisecond)
	done := get(url)
	<-entered
	cancel()
	if err := <-served; err != nil {
		t.Fatalf("HTTP() = %v, want nil after a forced stop", err)
	}
	if err := <-done; err == nil {
		t.Fatal("the request in flight was answered, want it cut off")
	}
}

func TestHTTPReturnsAServeFailure(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis.Close()
	srv := &http.Server{ReadHeaderTimeout: time.Second}
	if err := HTTP(context.Background(), srv, lis, time.Hour); err == nil || errors.Is(err, http.ErrServerClosed) {
		t.Fatalf("HTTP() on a closed listener = %v, want the failure", err)
	}
}

func TestStopHTTPSaysWhenCutShort(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: time.Second, Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		close(entered)
		<-release
	})}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	done := get("http://" + lis.Addr().String())
	<-entered
	if err := StopHTTP(srv, 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("StopHTTP() = %v, want the deadline", err)
	}
	if err := <-done; err == nil {
		t.Fatal("the request in flight was answered, want it cut off by Close")
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		t.Fatalf("Serve() = %v", err)
	}
}
