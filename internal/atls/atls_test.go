package atls_test

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// serveGRPC serves the health service with creds on a loopback port and records the peer evidence
// that handlers see.
func serveGRPC(t *testing.T, creds *atls.Credentials) (addr string, seen func() *atls.Evidence) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var last *atls.Evidence
	srv := grpc.NewServer(grpc.Creds(creds), grpc.UnaryInterceptor(
		func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			ev, _ := atls.PeerEvidence(ctx)
			mu.Lock()
			last = ev
			mu.Unlock()
			return h(ctx, req)
		}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String(), func() *atls.Evidence {
		mu.Lock()
		defer mu.Unlock()
		return last
	}
}

func check(ctx context.Context, addr string, creds *atls.Credentials) error {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

func mustCreds(t *testing.T, issuer atls.Issuer, validator atls.Validator, opts ...atls.Option) *atls.Credentials {
	t.Helper()
	c, err := atls.NewCredentials(issuer, validator, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestGRPCModes(t *testing.T) {
	iss, val := atlstest.Issuer{}, atlstest.Validator{}
	testCases := map[string]struct {
		serverIssuer, clientIssuer       atls.Issuer
		serverValidator, clientValidator atls.Validator
	}{
		"server attests": {serverIssuer: iss, clientValidator: val},
		"client attests": {clientIssuer: iss, serverValidator: val},
		"mutual":         {serverIssuer: iss, serverValidator: val, clientIssuer: iss, clientValidator: val},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			addr, seen := serveGRPC(t, mustCreds(t, tc.serverIssuer, tc.serverValidator))
			var clientSaw *atls.Evidence
			creds := mustCreds(t, tc.clientIssuer, tc.clientValidator, atls.WithObserver(func(ev atls.Evidence, err error) {
				if err == nil {
					clientSaw = &ev
				}
			}))
			if err := check(ctx, addr, creds); err != nil {
				t.Fatalf("health check over aTLS: %v", err)
			}
			if (tc.serverValidator != nil) != (seen() != nil) {
				t.Errorf("server handler saw evidence %v, server validates: %v", seen(), tc.serverValidator != nil)
			}
			if (tc.clientValidator != nil) != (clientSaw != nil) {
				t.Errorf("client saw evidence %v, client validates: %v", clientSaw, tc.clientValidator != nil)
			}
		})
	}
}

// Misbehaving issuers for rejection tests.

// replayIssuer answers every nonce with the document it issued for the first one.
type replayIssuer struct {
	mu  sync.Mutex
	doc map[string][]byte
}

func (*replayIssuer) Variant() string { return atlstest.Variant }
func (r *replayIssuer) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if d, ok := r.doc["first"]; ok {
		return d, nil
	}
	d, err := atlstest.Issuer{}.Issue(ctx, userData, nonce)
	r.doc = map[string][]byte{"first": d}
	return d, err
}

// otherKeyIssuer binds the document to a key other than the TLS key.
type otherKeyIssuer struct{}

func (otherKeyIssuer) Variant() string { return atlstest.Variant }
func (otherKeyIssuer) Issue(ctx context.Context, _, nonce []byte) ([]byte, error) {
	return atlstest.Issuer{}.Issue(ctx, []byte("hash of another key"), nonce)
}

// rawIssuer returns fixed bytes under a chosen variant.
type rawIssuer struct {
	variant string
	doc     []byte
}

func (r rawIssuer) Variant() string { return r.variant }
func (r rawIssuer) Issue(context.Context, []byte, []byte) ([]byte, error) {
	return r.doc, nil
}

// rejectingValidator rejects every document's measurements.
type rejectingValidator struct{ atlstest.Validator }

func (v rejectingValidator) Validate(ctx context.Context, doc, nonce []byte) (attestation.Result, error) {
	res, err := v.Validator.Validate(ctx, doc, nonce)
	if err != nil {
		return res, err
	}
	return res, attestation.ErrMeasurementMismatch
}

// handshake dials addr with cfg and returns the client-side handshake error.
func handshake(t *testing.T, addr string, cfg *tls.Config) error {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(c, cfg)
	defer tc.Close()
	_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
	if err := tc.Handshake(); err != nil {
		return err
	}
	// TLS 1.3 client certificates are checked after the client's handshake returns; a read surfaces
	// the server's verdict.
	_, err = tc.Write([]byte{0})
	if err == nil {
		_ = tc.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = tc.Read(make([]byte, 1))
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

func TestServerAttestationRejected(t *testing.T) {
	ctx := context.Background()
	val := atlstest.Validator{}
	limited := atls.NewLimiter(atls.Limits{PerPeer: 0.001, PerPeerBurst: 1, Global: 100, GlobalBurst: 100})
	testCases := map[string]struct {
		issuer  atls.Issuer
		val     atls.Validator
		opts    []atls.Option
		rounds  int
		wantErr error
	}{
		"accepted":                      {issuer: atlstest.Issuer{}, val: val},
		"replayed document":             {issuer: &replayIssuer{}, val: val, rounds: 2, wantErr: attestation.ErrNonceMismatch},
		"document bound to another key": {issuer: otherKeyIssuer{}, val: val, wantErr: attestation.ErrKeyBinding},
		"garbage document":              {issuer: rawIssuer{variant: atlstest.Variant, doc: []byte("\x00garbage")}, val: val, wantErr: attestation.ErrMalformed},
		"unknown variant":               {issuer: rawIssuer{variant: "sev-snp", doc: []byte("{}")}, val: val, wantErr: attestation.ErrUnknownVariant},
		"policy rejects measurements":   {issuer: atlstest.Issuer{}, val: rejectingValidator{}, wantErr: attestation.ErrMeasurementMismatch},
		"rate limited":                  {issuer: atlstest.Issuer{}, val: val, opts: []atls.Option{atls.WithLimiter(limited)}, rounds: 2, wantErr: atls.ErrRateLimited},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			srv, err := atls.NewServerConfig(tc.issuer, nil, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			addr := atlstest.ServeTLS(t, srv)
			var err2 error
			for i := 0; i < max(tc.rounds, 1); i++ {
				cfg, err := atls.NewClientConfig(ctx, nil, tc.val)
				if err != nil {
					t.Fatal(err)
				}
				err2 = handshake(t, addr, cfg)
			}
			if tc.wantErr == nil {
				if err2 != nil {
					t.Fatalf("handshake: %v", err2)
				}
				return
			}
			if !errors.Is(err2, tc.wantErr) {
				t.Fatalf("got %v, want %v", err2, tc.wantErr)
			}
		})
	}
}

func TestPlainServerHasNoAttestation(t *testing.T) {
	// A server that validates clients but does not attest itself.
	srv, err := atls.NewServerConfig(nil, atlstest.Validator{})
	if err != nil {
		t.Fatal(err)
	}
	addr := atlstest.ServeTLS(t, srv)
	cfg, err := atls.NewClientConfig(context.Background(), nil, atlstest.Validator{})
	if err != nil {
		t.Fatal(err)
	}
	if err := handshake(t, addr, cfg); !errors.Is(err, atls.ErrNoAttestation) {
		t.Fatalf("got %v, want ErrNoAttestation", err)
	}
}

func TestClientAttestationRejected(t *testing.T) {
	testCases := map[string]struct {
		issuer  atls.Issuer
		wantErr error
	}{
		"accepted":                      {issuer: atlstest.Issuer{}},
		"document bound to another key": {issuer: otherKeyIssuer{}, wantErr: attestation.ErrKeyBinding},
		"replayed document":             {issuer: &replayIssuer{}, wantErr: attestation.ErrNonceMismatch},
		"no client attestation":         {issuer: nil, wantErr: atls.ErrNoAttestation},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			var mu sync.Mutex
			var serverErr error
			observed := false
			srv, err := atls.NewServerConfig(nil, atlstest.Validator{}, atls.WithObserver(func(_ atls.Evidence, err error) {
				mu.Lock()
				defer mu.Unlock()
				serverErr, observed = err, true
			}))
			if err != nil {
				t.Fatal(err)
			}
			addr := atlstest.ServeTLS(t, srv)
			for i := 0; i < 2; i++ { // twice, so the replay issuer replays
				cfg, err := atls.NewClientConfig(context.Background(), tc.issuer, nil)
				if err != nil {
					t.Fatal(err)
				}
				clientErr := handshake(t, addr, cfg)
				if _, replay := tc.issuer.(*replayIssuer); replay && i == 0 {
					continue // the first document is genuine
				}
				if (tc.wantErr == nil) != (clientErr == nil) {
					t.Fatalf("round %d: client handshake error %v, want failure: %v", i, clientErr, tc.wantErr != nil)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if errors.Is(tc.wantErr, atls.ErrNoAttestation) {
				// crypto/tls rejects a missing certificate before VerifyPeerCertificate runs.
				return
			}
			if !observed || !errors.Is(serverErr, tc.wantErr) {
				t.Fatalf("server verdict %v (observed %v), want %v", serverErr, observed, tc.wantErr)
			}
		})
	}
}

func TestServerRefusesClientWithoutNonce(t *testing.T) {
	srv, err := atls.NewServerConfig(atlstest.Issuer{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := atlstest.ServeTLS(t, srv)
	cfg := &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13}
	if err := handshake(t, addr, cfg); err == nil {
		t.Fatal("plain TLS client got a handshake with an attesting server")
	}
}

// TestOptionalClientAttestation: a validating server with WithOptionalClientAttestation serves a
// client that presents no certificate, whose handlers see no evidence, still validates a client that
// attests and refuses one whose attestation fails; without the option the certificate-less client is
// refused in the handshake.
func TestOptionalClientAttestation(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	iss, val := atlstest.Issuer{}, atlstest.Validator{}
	addr, seen := serveGRPC(t, mustCreds(t, iss, val, atls.WithOptionalClientAttestation()))
	if err := check(ctx, addr, mustCreds(t, nil, val)); err != nil {
		t.Fatalf("a client without attestation: %v", err)
	}
	if ev := seen(); ev != nil {
		t.Fatalf("the handler saw evidence %v from a client that presented none", ev)
	}
	if err := check(ctx, addr, mustCreds(t, iss, val)); err != nil {
		t.Fatalf("an attesting client: %v", err)
	}
	if seen() == nil {
		t.Fatal("the handler saw no evidence of an attesting client")
	}
	if err := check(ctx, addr, mustCreds(t, otherKeyIssuer{}, val)); err == nil {
		t.Fatal("a client with a document bound to another key was served")
	}
	strict, _ := serveGRPC(t, mustCreds(t, iss, val))
	if err := check(ctx, strict, mustCreds(t, nil, val)); err == nil {
		t.Fatal("without the option a client without attestation was served")
	}
}
