package atls_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
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
func newMutualParties(tb testing.TB, backend string, clients int) mutualParties {
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
	p := mutualParties{
		server:          vtpm.NewIssuer(open, zap.NewNop()),
		serverValidator: tpmValidator(tb, nodeCA.PEM(), "  4: {expected: "+strings.Repeat("00", 32)+"}\n"),
		clientPolicy:    tpmValidator(tb, serverRoots, "").(*vtpm.Validator).Policy(),
	}
	for range clients {
		s, err := vtpmtest.NewSoftTPM(nodeCA, pcrs)
		if err != nil {
			tb.Fatal(err)
		}
		p.clients = append(p.clients, s)
	}
	return p
}

// BenchmarkMutualHandshake measures attested mutual handshakes as a join makes them, on 8 client
// goroutines: each handshake is a new node's first contact with the server (a new client validator,
// so the server's key is challenged), the server validates the node's document (nodes it has seen
// before: 32 identities in turn). Reported: handshakes per second over the whole run.
func BenchmarkMutualHandshake(b *testing.B) {
	for _, backend := range []string{"simulator", "swtpm"} {
		b.Run("tpm-"+backend, func(b *testing.B) {
			p := newMutualParties(b, backend, 32)
			srv, err := atls.NewServerConfig(p.server, p.serverValidator, atls.WithLimiter(unlimited()))
			if err != nil {
				b.Fatal(err)
			}
			addr := benchServer(b, srv)
			ctx := context.Background()
			// Every identity once, so that the server's activation of the nodes is not measured.
			for _, c := range p.clients {
				mutualHandshake(ctx, b, addr, c, p.clientPolicy)
			}
			const goroutines = 8
			b.SetParallelism((goroutines + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			var next atomic.Int64
			start := time.Now()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					mutualHandshake(ctx, b, addr, p.clients[int(next.Add(1))%len(p.clients)], p.clientPolicy)
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "handshakes/s")
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
