package atls_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tpmsim"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// mutualParties is a mutual setup as at a join: the server attests with a TPM and validates clients,
// the clients attest with software TPMs (vtpmtest.SoftTPM) and validate the server.
type mutualParties struct {
	server          atls.Issuer
	serverValidator atls.Validator
	clients         []atls.Issuer
	// clientPolicy is what a client's validator judges the server by.
	clientPolicy *policy.Policy
}

// newMutualParties puts the server on the reference simulator (backend "simulator") or on swtpm.
// With certified, the server's AK is certified by a cluster AK CA that the clients' policy lists, and
// the server serves a session proof.
func newMutualParties(tb testing.TB, backend string, clients int, certified bool) (mutualParties, []atls.Option) {
	tb.Helper()
	var open vtpm.OpenFunc
	var serverRoots []byte
	switch backend {
	case "simulator":
		sim, err := tpmsim.New()
		if errors.Is(err, tpmsim.ErrUnavailable) {
			vtpmtest.Unavailable(tb, "TPM simulator needs cgo")
		}
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { _ = sim.Close() })
		ca, err := vtpmtest.NewCA("server EK CA")
		if err != nil {
			tb.Fatal(err)
		}
		if err := vtpmtest.ProvisionEKCert(tb.Context(), sim.Open, ca); err != nil {
			tb.Fatal(err)
		}
		open, serverRoots = sim.Open, ca.PEM()
	default:
		ca := vtpmtest.NewSwtpmCA(tb)
		sw := vtpmtest.StartSwtpm(tb, ca)
		open, serverRoots = sw.Open, append(ca.RootPEM(tb), ca.IssuerPEM(tb)...)
	}
	nodeCA, err := vtpmtest.NewCA("node EK CA")
	if err != nil {
		tb.Fatal(err)
	}
	pcrs := map[uint32][]byte{}
	for i := range uint32(24) {
		pcrs[i] = make([]byte, 32)
	}
	server := vtpm.NewIssuer(open, zap.NewNop())
	p := mutualParties{
		server:          server,
		serverValidator: tpmValidator(tb, nodeCA.PEM(), "  4: {expected: "+strings.Repeat("00", 32)+"}\n"),
		clientPolicy:    tpmValidator(tb, serverRoots, "").(*vtpm.Validator).Policy(),
	}
	var opts []atls.Option
	if certified {
		akCA, err := vtpm.NewAKCA(make([]byte, 32), "bench AK CA")
		if err != nil {
			tb.Fatal(err)
		}
		if err := server.CertifyAK(tb.Context(), akCA.Certify); err != nil {
			tb.Fatal(err)
		}
		cp := *p.clientPolicy
		cp.AKRoots = []*x509.Certificate{akCA.Cert}
		p.clientPolicy = &cp
		sp := atls.NewSessionProof(server, zap.NewNop())
		ctx, stop := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = sp.Run(ctx) }()
		tb.Cleanup(func() { stop(); <-done })
		if err := sp.Renew(tb.Context()); err != nil {
			tb.Fatal(err)
		}
		opts = append(opts, atls.WithSessionProof(sp))
	}
	for range clients {
		s, err := vtpmtest.NewSoftTPM(nodeCA, pcrs)
		if err != nil {
			tb.Fatal(err)
		}
		p.clients = append(p.clients, s)
	}
	return p, opts
}

// BenchmarkMutualHandshake measures attested mutual handshakes as a join makes them, on 8 client
// goroutines: each handshake is a new node's first contact with the server (a new client validator,
// so the server's key is challenged), the server validates the node's document (nodes it has seen
// before: 32 identities in turn). Reported: handshakes per second over the whole run, and the
// process's CPU per handshake (clients and server: the software TPMs, and the simulator's TPM work;
// swtpm's is in its own process).
//
// activated: the clients' policy has no akRoots, so each probes the server and challenges its key,
// and the server activates and quotes per handshake. certified-session: the server's AK is certified
// by a CA the clients' policy lists, and it serves a session proof: no probe, no TPM command per
// handshake on the server.
func BenchmarkMutualHandshake(b *testing.B) {
	for _, c := range []struct {
		backend, mode string
	}{{"simulator", "activated"}, {"simulator", "certified-session"}, {"swtpm", "activated"}, {"swtpm", "certified-session"}} {
		b.Run("tpm-"+c.backend+"/"+c.mode, func(b *testing.B) {
			p, opts := newMutualParties(b, c.backend, 32, c.mode == "certified-session")
			srv, err := atls.NewServerConfig(p.server, p.serverValidator, append(opts, atls.WithLimiter(unlimited()))...)
			if err != nil {
				b.Fatal(err)
			}
			addr := atlstest.ServeTLS(b, srv)
			ctx := context.Background()
			// Every identity once, so that the server's activation of the nodes is not measured.
			for _, c := range p.clients {
				mutualHandshake(ctx, b, addr, c, p.clientPolicy)
			}
			const goroutines = 8
			b.SetParallelism((goroutines + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			var next atomic.Int64
			start, cpu0 := time.Now(), processCPU()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					mutualHandshake(ctx, b, addr, p.clients[int(next.Add(1))%len(p.clients)], p.clientPolicy)
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "handshakes/s")
			b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N)/1e6, "cpu-ms/handshake")
		})
	}
}

// mutualHandshake dials addr as a node that has never seen the server.
func mutualHandshake(ctx context.Context, b *testing.B, addr string, issuer atls.Issuer, p *policy.Policy) {
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		b.Error(err)
		return
	}
	var d net.Dialer
	tc, err := atls.Dial(ctx, &d, addr, issuer, v)
	if err != nil {
		b.Error(fmt.Errorf("mutual handshake: %w", err))
		return
	}
	// A TLS 1.3 client finishes before the server has checked its certificate: read until the
	// server has, so that a refusal counts.
	_ = tc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := tc.Read(make([]byte, 1)); err != nil && !errors.Is(err, net.ErrClosed) && !isEOF(err) {
		b.Error(fmt.Errorf("mutual handshake: server side: %w", err))
	}
	_ = tc.Close()
}

func isEOF(err error) bool { return err != nil && strings.Contains(err.Error(), "EOF") }

// processCPU is the CPU time this process has used, in nanoseconds.
func processCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// BenchmarkClaimRefusal measures refusals on claimed measurements, one client after the other: the
// server (its transport credentials' handshake, as the joinservice runs it) judges the claims in the
// ClientHello and answers with its alert, no key exchange, no quote, no validation. Reported: the
// process's CPU per refusal (client and server).
func BenchmarkClaimRefusal(b *testing.B) {
	nodeCA, err := vtpmtest.NewCA("node EK CA")
	if err != nil {
		b.Fatal(err)
	}
	pcrs := map[uint32][]byte{}
	for i := range uint32(24) {
		pcrs[i] = make([]byte, 32)
	}
	pcrs[4] = bytes.Repeat([]byte{0x11}, 32)
	node, err := vtpmtest.NewSoftTPM(nodeCA, pcrs)
	if err != nil {
		b.Fatal(err)
	}
	refuse := atls.ClaimCheck(func(context.Context, string, atls.Claims) error {
		return errors.New("index 4: claimed 1111...")
	})
	srv, err := atls.NewCredentials(atlstest.Issuer{}, tpmValidator(b, nodeCA.PEM(), ""), atls.WithLimiter(unlimited()), atls.WithClaimCheck(refuse))
	if err != nil {
		b.Fatal(err)
	}
	addr := credentialsServer(b, srv)
	ctx := context.Background()
	var d net.Dialer
	cpu0 := processCPU()
	b.ResetTimer()
	for range b.N {
		if _, err := atls.Dial(ctx, &d, addr, node, atlstest.Validator{}); !errors.Is(err, atls.ErrClaimsRejected) {
			b.Fatalf("got %v, want a refusal on claims", err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N)/1e6, "cpu-ms/refusal")
}

// credentialsServer runs creds' server handshake on every connection to the returned address, as a
// gRPC server does before it speaks HTTP/2.
func credentialsServer(b *testing.B, creds *atls.Credentials) string {
	b.Helper()
	return atlstest.Serve(b, func(c net.Conn) {
		if conn, _, err := creds.ServerHandshake(c); err == nil {
			_ = conn.Close()
		}
		_ = c.Close()
	})
}
