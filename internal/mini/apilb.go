package mini

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
)

// APIPort is the Kubernetes API's port on every control plane and on the cluster's control-plane
// endpoint.
const APIPort = 6443

// ControlPlaneEndpoint is the cluster's Kubernetes API as every node and the operator reach it: the
// agent's load balancer on the host's bridge address, in front of every control plane's API server,
// as a cloud's load balancer stands in front of a real cluster's control planes. kubeadm puts it in
// every kubeconfig it writes and in the API servers' certificates.
func (c Config) ControlPlaneEndpoint() netip.AddrPort {
	return netip.AddrPortFrom(c.HostAddr(), APIPort)
}

// The balancer's numbers: a backend is checked every healthInterval, each check and each dial of a
// backend for a client gives up after backendTimeout.
const (
	healthInterval = time.Second
	backendTimeout = time.Second
)

// apiBalancer is the mini platform's TCP load balancer for the control-plane endpoint. It forwards
// every connection, unopened (TLS ends at the API server, which clients verify), to a control plane
// whose API server reports ready (GET /readyz answers 200), as a cloud's load balancer in front of
// kubeadm control planes does. A connection whose backend cannot be dialed tries the next one; with
// no backend ready it tries all of them, as cloud load balancers fail open. A control plane that is
// powered off, or whose API server stops being ready (its etcd member still a learner, lost quorum,
// shutting down), stops getting new connections within about a health interval; its open
// connections break, and clients reconnect through the balancer.
type apiBalancer struct {
	log *zap.Logger

	mu       sync.Mutex
	backends []string
	ready    map[string]bool
	next     int
}

func newAPIBalancer(log *zap.Logger) *apiBalancer {
	return &apiBalancer{log: log, ready: map[string]bool{}}
}

// setBackends replaces the control planes' API server addresses (HOST:PORT).
func (b *apiBalancer) setBackends(addrs []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if slices.Equal(addrs, b.backends) {
		return
	}
	b.backends = slices.Clone(addrs)
	b.log.Info("control-plane endpoint backends", zap.Strings("backends", addrs))
}

// candidates returns the backends to try for one connection: the ready ones, starting with the
// next in turn, then the others.
func (b *apiBalancer) candidates() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := len(b.backends)
	var ready, rest []string
	for i := range n {
		addr := b.backends[(b.next+i)%n]
		if b.ready[addr] {
			ready = append(ready, addr)
		} else {
			rest = append(rest, addr)
		}
	}
	b.next++
	return append(ready, rest...)
}

// serve accepts connections on lis and forwards them until ctx ends; then it closes lis and every
// forwarded connection and returns once they are done.
func (b *apiBalancer) serve(ctx context.Context, lis net.Listener) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	stop := context.AfterFunc(ctx, func() { _ = lis.Close() })
	defer stop()
	for {
		conn, err := lis.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accepting API connections: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			b.forward(ctx, conn)
		}()
	}
}

// forward connects client to the first backend that answers and copies both ways until either side
// closes or ctx ends.
func (b *apiBalancer) forward(ctx context.Context, client net.Conn) {
	defer client.Close()
	var backend net.Conn
	for _, addr := range b.candidates() {
		d := net.Dialer{Timeout: backendTimeout}
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			backend = conn
			break
		}
		b.log.Debug("control-plane endpoint backend refused", zap.String("backend", addr), zap.Error(err))
	}
	if backend == nil {
		return
	}
	defer backend.Close()
	stop := context.AfterFunc(ctx, func() { _ = client.Close(); _ = backend.Close() })
	defer stop()
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src) // ends when either side closes; the other direction is closed below
		done <- struct{}{}
	}
	go pipe(backend, client)
	go pipe(client, backend)
	<-done
	_ = client.Close()
	_ = backend.Close()
	<-done
}

// checkHealth checks every backend every healthInterval until ctx ends.
func (b *apiBalancer) checkHealth(ctx context.Context) {
	t := time.NewTicker(healthInterval)
	defer t.Stop()
	for {
		b.checkOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// checkOnce checks every backend at once and records which are ready.
func (b *apiBalancer) checkOnce(ctx context.Context) {
	b.mu.Lock()
	backends := slices.Clone(b.backends)
	b.mu.Unlock()
	results := make([]bool, len(backends))
	var wg sync.WaitGroup
	for i, addr := range backends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = backendReady(ctx, addr) == nil
		}()
	}
	wg.Wait()
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, addr := range backends {
		if was, ok := b.ready[addr]; !ok || was != results[i] {
			b.log.Info("control-plane endpoint backend", zap.String("backend", addr), zap.Bool("ready", results[i]))
		}
		b.ready[addr] = results[i]
	}
}

// errNotReady is a backend whose /readyz did not answer 200.
var errNotReady = errors.New("API server not ready")

// backendReady checks one API server: GET /readyz. The check does not verify the server's
// certificate: it sends nothing and only decides where connections go, and every client verifies
// the API server it reaches through the balancer.
func backendReady(ctx context.Context, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, backendTimeout)
	defer cancel()
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}, //nolint:gosec // a health probe: nothing is sent, nothing is trusted
		DisableKeepAlives: true,
	}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+addr+"/readyz", nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w: %s", errNotReady, resp.Status)
	}
	return nil
}
