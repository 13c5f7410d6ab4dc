// Package webhook is Berth's image-policy validating admission webhook: it admits or denies pods and
// workloads by the registries of their images, with a deny message naming the deciding rule.
//
// The server is built so that the API server never sees it fail while it is listed as ready:
//   - the serving keypair is read from files and hot-swapped through tls.Config.GetCertificate;
//   - /readyz (plain HTTP on the probe port) is 200 only when a fresh TLS connection to the server's own
//     port serves exactly the loaded leaf certificate, the policy is loaded and the server is not
//     draining; it never depends on cluster-wide facts such as the webhook configuration;
//   - on the first stop request it fails readiness, answers every request with "Connection: close",
//     keeps serving for a delay so the endpoints can drop it, then shuts down gracefully;
//   - DELETE and CONNECT, UPDATEs of objects already being deleted, exempt namespaces and unhandled
//     subresources are always allowed, whatever the webhook configuration says;
//   - before a policy is loaded every checked request is denied with a retryable message.
package webhook

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/serve"
)

// Config configures a Server.
type Config struct {
	// CertFile and KeyFile hold the serving keypair (PEM); they are re-read every ReloadInterval.
	CertFile, KeyFile string
	// PolicyFile holds the image policy (YAML); it is re-read every ReloadInterval.
	PolicyFile string
	// ReloadInterval between checks of the files (default 2 s).
	ReloadInterval time.Duration
	// ShutdownDelay is how long the server keeps serving after a stop request (default 10 s).
	ShutdownDelay time.Duration
	// ShutdownTimeout bounds the graceful shutdown after the delay (default 10 s).
	ShutdownTimeout time.Duration
	// HandlerDeadline bounds one decision: the webhook's timeoutSeconds minus one second (default 4 s).
	HandlerDeadline time.Duration
	// ExemptNamespaces are always allowed (the webhook's own namespace, kube-system, ...).
	ExemptNamespaces []string
}

// Errors the readiness check reports.
var (
	ErrDraining     = errors.New("draining")
	ErrNoPolicy     = errors.New("image policy not loaded")
	ErrNoCert       = errors.New("serving certificate not loaded")
	ErrCertMismatch = errors.New("the listener serves a different certificate than the loaded one")
)

type keypair struct {
	cert     tls.Certificate
	leaf     *x509.Certificate
	certPEM  []byte
	keyPEM   []byte
	loadedAt time.Time
}

// Server is the webhook server.
type Server struct {
	cfg      Config
	log      *zap.Logger
	handler  *Handler
	metrics  *Metrics
	keypair  atomic.Pointer[keypair]
	draining atomic.Bool

	reloadMu  sync.Mutex
	policyRaw []byte
	// rejected is the last policy file content that did not parse; it is reported once.
	rejected []byte

	selfAddr atomic.Pointer[string]
}

// New returns a server; call Serve to run it.
func New(cfg Config, log *zap.Logger) *Server {
	if cfg.ReloadInterval == 0 {
		cfg.ReloadInterval = 2 * time.Second
	}
	if cfg.ShutdownDelay == 0 {
		cfg.ShutdownDelay = 10 * time.Second
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 10 * time.Second
	}
	if cfg.HandlerDeadline == 0 {
		cfg.HandlerDeadline = 4 * time.Second
	}
	m := NewMetrics()
	return &Server{cfg: cfg, log: log, metrics: m, handler: NewHandler(log, cfg.ExemptNamespaces, cfg.HandlerDeadline, m)}
}

// Reload re-reads the keypair and the policy files; a file that changed and does not load keeps the
// previous version in service. It returns the errors of this round.
func (s *Server) Reload() error {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	return errors.Join(s.reloadKeypair(), s.reloadPolicy())
}

func (s *Server) reloadKeypair() error {
	certPEM, err := os.ReadFile(s.cfg.CertFile)
	if err != nil {
		return fmt.Errorf("reading serving certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(s.cfg.KeyFile)
	if err != nil {
		return fmt.Errorf("reading serving key: %w", err)
	}
	if cur := s.keypair.Load(); cur != nil && bytes.Equal(cur.certPEM, certPEM) && bytes.Equal(cur.keyPEM, keyPEM) {
		return nil
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		// Certificate and key are written one after the other; the next round sees both.
		return fmt.Errorf("loading serving keypair: %w", err)
	}
	leaf, err := x509.ParseCertificate(cert.Certificate[0])
	if err != nil {
		return fmt.Errorf("parsing serving certificate: %w", err)
	}
	cert.Leaf = leaf
	s.keypair.Store(&keypair{cert: cert, leaf: leaf, certPEM: certPEM, keyPEM: keyPEM, loadedAt: time.Now()})
	s.metrics.setCertExpiry(leaf.NotAfter)
	s.log.Info("serving certificate loaded", zap.String("serial", leaf.SerialNumber.String()), zap.Time("notAfter", leaf.NotAfter))
	return nil
}

func (s *Server) reloadPolicy() error {
	raw, err := os.ReadFile(s.cfg.PolicyFile)
	if err != nil {
		return fmt.Errorf("reading image policy: %w", err)
	}
	if s.policyRaw != nil && bytes.Equal(raw, s.policyRaw) {
		return nil
	}
	if s.rejected != nil && bytes.Equal(raw, s.rejected) {
		return nil
	}
	p, err := ParsePolicy(raw)
	if err != nil {
		s.rejected = raw
		return err
	}
	s.rejected = nil
	s.policyRaw = raw
	s.handler.SetPolicy(p)
	s.log.Info("image policy loaded", zap.Int("rules", len(p.Rules)))
	return nil
}

func (s *Server) getCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	kp := s.keypair.Load()
	if kp == nil {
		return nil, ErrNoCert
	}
	return &kp.cert, nil
}

// TLSConfig is the serving TLS configuration: TLS 1.2 or newer, HTTP/1.1 only, the hot-swapped keypair.
func (s *Server) TLSConfig() *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: s.getCertificate, NextProtos: []string{"http/1.1"}}
}

// Handler returns the admission handler (for benchmarks and tests).
func (s *Server) Handler() *Handler { return s.handler }

// Serve serves admission reviews on ln (TLS is added here) and probes and metrics on probeLn (plain
// HTTP) until ctx ends; then it drains: readiness fails at once, responses carry "Connection: close",
// serving goes on for ShutdownDelay, and a graceful shutdown bounded by ShutdownTimeout follows.
func (s *Server) Serve(ctx context.Context, ln, probeLn net.Listener) error {
	if err := s.Reload(); err != nil {
		s.log.Warn("initial load incomplete", zap.Error(err))
	}
	s.setSelfAddr(ln.Addr())
	mux := http.NewServeMux()
	mux.Handle(Path, s.handler)
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	errLog, _ := zap.NewStdLogAt(s.log.Named("http"), zap.DebugLevel)
	srv := &http.Server{
		Handler:           mux,
		TLSConfig:         s.TLSConfig(),
		TLSNextProto:      map[string]func(*http.Server, *tls.Conn, http.Handler){}, // no HTTP/2
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       s.cfg.HandlerDeadline + 10*time.Second,
		WriteTimeout:      s.cfg.HandlerDeadline + 10*time.Second,
		// Longer than the clients' idle timeout (90 s in client-go), so clients close idle connections
		// first and a request never races the server closing one.
		IdleTimeout: 150 * time.Second,
		ErrorLog:    errLog,
	}
	probeMux := http.NewServeMux()
	probeMux.HandleFunc("/readyz", s.serveReadyz)
	probeMux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	probeMux.Handle("/metrics", s.metrics)
	probe := &http.Server{Handler: probeMux, ReadHeaderTimeout: 5 * time.Second, ErrorLog: errLog}

	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Add(3)
	go func() {
		defer wg.Done()
		if err := srv.Serve(tls.NewListener(ln, srv.TLSConfig)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errs <- fmt.Errorf("serving admission reviews: %w", err)
		}
	}()
	go func() {
		defer wg.Done()
		if err := probe.Serve(probeLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errs <- fmt.Errorf("serving probes: %w", err)
		}
	}()
	reloadCtx, stopReload := context.WithCancel(context.Background())
	go func() {
		defer wg.Done()
		s.reloadLoop(reloadCtx)
	}()
	defer wg.Wait()
	defer stopReload()
	s.log.Info("serving", zap.String("address", ln.Addr().String()), zap.String("probeAddress", probeLn.Addr().String()))

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errs:
		s.log.Error("server failed", zap.Error(serveErr))
	}
	// Responses close their connections before readiness fails: whoever sees the failed readiness
	// (the kubelet, a test) sees only responses that ask the client to reconnect elsewhere.
	s.handler.SetClosing()
	s.draining.Store(true)
	s.metrics.setReady(false)
	if serveErr == nil {
		s.log.Info("draining", zap.Duration("delay", s.cfg.ShutdownDelay))
		time.Sleep(s.cfg.ShutdownDelay)
	}
	if err := serve.StopHTTP(srv, s.cfg.ShutdownTimeout); err != nil {
		s.log.Warn("graceful shutdown cut short", zap.Error(err))
	}
	_ = probe.Close()
	s.log.Info("stopped")
	return serveErr
}

func (s *Server) reloadLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.ReloadInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := s.Reload(); err != nil {
				s.log.Warn("reloading files failed, keeping the loaded versions", zap.Error(err))
			}
		}
	}
}

func (s *Server) setSelfAddr(a net.Addr) {
	addr := a.String()
	if tcp, ok := a.(*net.TCPAddr); ok && (tcp.IP == nil || tcp.IP.IsUnspecified()) {
		host := "127.0.0.1"
		if tcp.IP != nil && tcp.IP.To4() == nil {
			host = "::1"
		}
		addr = net.JoinHostPort(host, fmt.Sprint(tcp.Port))
	}
	s.selfAddr.Store(&addr)
}

// CheckReady returns nil when the server is ready to take admission traffic: not draining, policy
// loaded, and a fresh TLS connection to its own port serves exactly the loaded leaf and answers HTTP.
func (s *Server) CheckReady(ctx context.Context) error {
	if s.draining.Load() {
		return ErrDraining
	}
	if !s.handler.PolicyLoaded() {
		return ErrNoPolicy
	}
	kp := s.keypair.Load()
	if kp == nil {
		return ErrNoCert
	}
	addr := s.selfAddr.Load()
	if addr == nil {
		return errors.New("not listening yet")
	}
	want := kp.leaf.Raw
	tr := &http.Transport{
		DisableKeepAlives: true,
		TLSClientConfig: &tls.Config{
			MinVersion: tls.VersionTLS12,
			// Identity is checked by comparing the served leaf with the loaded one byte for byte,
			// which is stricter than chain verification: a stale or foreign certificate fails.
			InsecureSkipVerify: true, //nolint:gosec // verified in VerifyConnection
			VerifyConnection: func(cs tls.ConnectionState) error {
				if len(cs.PeerCertificates) == 0 || !bytes.Equal(cs.PeerCertificates[0].Raw, want) {
					return ErrCertMismatch
				}
				return nil
			},
		},
	}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+*addr+"/livez", nil)
	if err != nil {
		return err
	}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		if errors.Is(err, ErrCertMismatch) {
			return ErrCertMismatch
		}
		return fmt.Errorf("probing own listener: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("probing own listener: HTTP %d", resp.StatusCode)
	}
	if s.draining.Load() {
		return ErrDraining
	}
	return nil
}

func (s *Server) serveReadyz(w http.ResponseWriter, r *http.Request) {
	err := s.CheckReady(r.Context())
	s.metrics.setReady(err == nil)
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = fmt.Fprintf(w, "not ready: %v\n", err)
		return
	}
	_, _ = w.Write([]byte("ok"))
}
