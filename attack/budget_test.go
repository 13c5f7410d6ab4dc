package attack

import (
	"context"
	crand "crypto/rand"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/joinproto"
)

// strangerTPMs is how many software TPMs the attested strangers share (an RSA EK takes a while to
// make; the joinservice validates each stranger's handshake all the same).
const strangerTPMs = 25

// TestAttestedStrangersLeaveTickets: 500 machines with trusted EKs (half of them running another
// image) at addresses metadata does not know hold an attested connection each and call the join RPC
// five times a second, their timing spread out, while 20 genuine nodes from known addresses join at
// an even pace. The strangers pass the handshake (their EKs are trusted) and are refused by the cheap
// checks (UNKNOWN_PEER, MEASUREMENT_MISMATCH): charged to the refused budget, they never spend the
// tickets budget, which only calls that pass every cheap check draw from; every genuine join gets its
// ticket on its first call. (Charged to the tickets budget before the checks, as they were, they left
// 2 of 20.) The joinservice's handshake budget for unknown peers is raised so that the 500 strangers
// connect within seconds: this test is about the join RPC's budgets, not the handshakes'.
func TestAttestedStrangersLeaveTickets(t *testing.T) {
	const (
		strangers = 500
		perSecond = 5
		genuine   = 20
		duration  = 10 * time.Second
	)
	c := startJoinCluster(t, "--attest-rate-global=5000", "--attest-rate-global-burst=5000", "--attest-rate-per-peer-burst=20")
	tpms := make([]*vtpmtest.SoftTPM, strangerTPMs)
	for i := range tpms {
		pcrs := genuinePCRs()
		if i%2 == 1 {
			pcrs = tamperedPCRs()
		}
		tpms[i] = softTPM(t, c.nodeCA, pcrs)
	}
	genuineTPMs := make([]*vtpmtest.SoftTPM, genuine)
	for i := range genuineTPMs {
		genuineTPMs[i] = softTPM(t, c.nodeCA, genuinePCRs())
	}

	// The strangers connect first, 32 at a time.
	conns := make([]*grpc.ClientConn, strangers)
	defer func() {
		for _, conn := range conns {
			if conn != nil {
				_ = conn.Close()
			}
		}
	}()
	connectStart := time.Now()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	var connected atomic.Int64
	var mu sync.Mutex
	connectErrors := map[string]int{}
	strangerReq := &joinproto.IssueJoinTicketRequest{KubeletCsr: newCSR(t, pkix.Name{CommonName: "system:node:stranger"}), Role: joinproto.Role_ROLE_WORKER, DiskUuid: diskA}
	for i := range conns {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			var issuer atls.Issuer = tpms[i%len(tpms)]
			if i%len(tpms)%2 == 1 {
				issuer = lying{tpms[i%len(tpms)]} // another image, claiming the genuine one's PCRs
			}
			conn, err := c.dial(floodIP(i).String(), issuer, c.joinPolicy)
			if err != nil {
				return
			}
			conns[i] = conn
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			// The stranger's first call opens its connection.
			_, err = joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, strangerReq)
			if conn.GetState() != connectivity.Ready {
				mu.Lock()
				connectErrors[oneLine(err.Error(), 160)]++
				mu.Unlock()
				return
			}
			connected.Add(1)
		}()
	}
	wg.Wait()
	t.Logf("%d of %d attested strangers connected in %.1f s", connected.Load(), strangers, time.Since(connectStart).Seconds())
	for text, n := range connectErrors {
		t.Logf("  not connected: %d× %s", n, text)
	}
	if connected.Load() < strangers*9/10 {
		t.Fatalf("only %d of %d strangers connected: the attack did not take place", connected.Load(), strangers)
	}

	// The strangers call, each five times a second from a random phase, for the whole run.
	req := strangerReq
	floodCtx, stop := context.WithTimeout(context.Background(), duration)
	defer stop()
	var calls atomic.Int64
	reasons := map[string]int{}
	cpu0 := processCPU(c.js.PID())
	start := time.Now()
	for _, conn := range conns {
		if conn == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := joinproto.NewJoinServiceClient(conn)
			period := time.Second / perSecond
			phase := time.NewTimer(rand.N(period))
			select {
			case <-floodCtx.Done():
				phase.Stop()
				return
			case <-phase.C:
			}
			tick := time.NewTicker(period)
			defer tick.Stop()
			for {
				_, err := client.IssueJoinTicket(floodCtx, req)
				calls.Add(1)
				if floodCtx.Err() == nil {
					reason := reasonOf(err)
					switch {
					case err == nil:
						reason = "a ticket"
					case reason == "":
						reason = status.Code(err).String()
					}
					mu.Lock()
					reasons[reason]++
					mu.Unlock()
				}
				select {
				case <-floodCtx.Done():
					return
				case <-tick.C:
				}
			}
		}()
	}

	// The genuine nodes, each from its own known address, at an even pace; one call each.
	var latencies []time.Duration
	var failures []error
	pace := time.NewTicker(duration / (genuine + 1))
	for i, tpm := range genuineTPMs {
		<-pace.C
		t0 := time.Now()
		if _, err := c.join(t, workerIP(1+i), tpm, workerRequest(t, diskA)); err != nil {
			failures = append(failures, err)
			continue
		}
		latencies = append(latencies, time.Since(t0))
	}
	pace.Stop()
	<-floodCtx.Done()
	wg.Wait()
	elapsed := time.Since(start)
	cpu := processCPU(c.js.PID()) - cpu0
	slices.Sort(latencies)
	t.Logf("strangers: %d join calls in %.1f s (%.0f/s) from %d addresses; answers: %v",
		calls.Load(), elapsed.Seconds(), float64(calls.Load())/elapsed.Seconds(), connected.Load(), reasons)
	t.Logf("the joinservice's CPU during the run: %.1f s of %.1f s (%.0f %% of one core; its limit: %d core); peak RSS %.0f MiB (limit %d MiB)",
		cpu, elapsed.Seconds(), 100*cpu/elapsed.Seconds(), berthsystem.JoinServiceCPUs, processPeakRSS(c.js.PID())/(1<<20), berthsystem.JoinServiceMemoryLimitBytes>>20)
	if len(latencies) > 0 {
		t.Logf("genuine joins: %d of %d got their ticket on the first call, p50 %s, p99 %s",
			len(latencies), genuine, percentile(latencies, 50).Round(time.Millisecond), percentile(latencies, 99).Round(time.Millisecond))
	} else {
		t.Logf("genuine joins: 0 of %d got their ticket", genuine)
	}
	for _, err := range failures {
		t.Errorf("a genuine join failed among the strangers: %s: %v", reasonOf(err), err)
	}
	if reasons["a ticket"] > 0 {
		t.Errorf("%d stranger calls got a ticket", reasons["a ticket"])
	}
}

// TestInitThroughWrongSecretFlood: twelve addresses, each with an attested connection to a fresh node
// and four callers on it, send Init calls with wrong secrets as fast as they can; the operator's
// berth init with the right secret (retrying once a second on RESOURCE_EXHAUSTED, as berth init does)
// starts on its first call. Each flooding address is held to its own limit, and the wrong secrets
// draw from a budget of their own; charged to a budget shared with the right secret, as they were,
// they kept every berth init out.
func TestInitThroughWrongSecretFlood(t *testing.T) {
	const (
		addresses = 12
		callers   = 4
		maxFlood  = 15 * time.Second
	)
	n := startInitNode(t, "control-plane")
	conns := make([]*grpc.ClientConn, addresses)
	for i := range conns {
		if conns[i] = n.ready(t, fmt.Sprintf("127.0.8.%d", i+1)); conns[i] == nil {
			t.Fatalf("flooding address %d never connected", i)
		}
	}
	operator := n.ready(t, "127.0.8.200")
	if operator == nil {
		t.Fatal("the operator never connected")
	}
	floodCtx, stop := context.WithTimeout(context.Background(), maxFlood)
	defer stop()
	var wg sync.WaitGroup
	var calls, rejected, limited atomic.Int64
	cpu0 := processCPU(n.proc.PID())
	start := time.Now()
	for i, conn := range conns {
		for range callers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req := initRequest([]byte(fmt.Sprintf("wrong secret of address %d", i)), 1)
				for floodCtx.Err() == nil {
					o := runInit(floodCtx, conn, req)
					calls.Add(1)
					switch o.code {
					case codes.PermissionDenied:
						rejected.Add(1)
					case codes.ResourceExhausted:
						limited.Add(1)
					}
				}
			}()
		}
	}
	// The operator's berth init, once the flood used up what it can reach (the budget of wrong
	// secrets, which refuses a wrong secret once it is empty): first two runs whose request the node
	// refuses after the secret check (INVALID_REQUEST, nothing changed), then the real one. Each gets
	// one call.
	if err := wait.PollUntilContextCancel(floodCtx, 10*time.Millisecond, true, func(context.Context) (bool, error) {
		return limited.Load() > 1000, nil
	}); err != nil {
		t.Fatalf("the flood never reached the wrong secrets' budget: %d answered RESOURCE_EXHAUSTED", limited.Load())
	}
	invalid := initRequest(n.secret, 1)
	invalid.ClusterName = "Not A DNS Label"
	var o outcome
	reached := 0
	t0 := time.Now()
	for i, req := range []*initproto.InitRequest{invalid, invalid, initRequest(n.secret, 1)} {
		o = runInit(floodCtx, operator, req)
		if o.started || o.failure == initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST {
			reached++
		} else {
			t.Errorf("berth init run %d with the right secret under the flood: %+v, want it to reach init", i+1, o)
		}
	}
	took := time.Since(t0)
	stop()
	wg.Wait()
	elapsed := time.Since(start)
	cpu := processCPU(n.proc.PID()) - cpu0
	t.Logf("flood: %d wrong-secret Init calls from %d addresses in %.1f s (%.0f/s): %d answered PERMISSION_DENIED, %d RESOURCE_EXHAUSTED",
		calls.Load(), addresses, elapsed.Seconds(), float64(calls.Load())/elapsed.Seconds(), rejected.Load(), limited.Load())
	t.Logf("the bootstrapper's CPU during the flood: %.1f s of %.1f s (%.0f %% of one core)", cpu, elapsed.Seconds(), 100*cpu/elapsed.Seconds())
	t.Logf("berth init with the right secret under the flood: %d of 3 runs reached init on their one call (%s for the three); the last started its phases: %v",
		reached, took.Round(time.Millisecond), o.started)
	if !o.started {
		t.Fatalf("berth init with the right secret did not start under the flood: %+v", o)
	}
}

// noTPM presents a garbage certificate: random bytes as a TPM document, and no key to activate.
type noTPM struct{}

func (noTPM) Variant() string { return "tpm" }
func (noTPM) Issue(context.Context, []byte, []byte) ([]byte, error) {
	b := make([]byte, 512)
	_, _ = crand.Read(b)
	return b, nil
}

// TestGarbageLeavesLedgerEvidence: a replay and a transplant are refused and recorded; then 250
// addresses each send one handshake that costs them nothing a TPM verified: half a garbage
// certificate and no TPM at all (NOT_ACTIVATED), half a software key under an EK CA of their own
// (UNTRUSTED_ROOT). Those are unverified refusals now, which never evict the evidence share; recorded
// as evidence, as they were, they evicted the replay and the transplant. The joinservice's handshake
// budget for unknown peers is raised so that every one of the 250 handshakes is judged.
func TestGarbageLeavesLedgerEvidence(t *testing.T) {
	const addresses = 250
	c, _, replayIP, transplantIP := startWithEvidence(t)

	other, err := vtpmtest.NewCA("the attacker's own EK CA")
	if err != nil {
		t.Fatal(err)
	}
	untrusted := make([]*vtpmtest.SoftTPM, 5)
	for i := range untrusted {
		untrusted[i] = softTPM(t, other, genuinePCRs())
	}
	start := time.Now()
	reasons := floodTally(addresses, func(i int) error {
		var issuer atls.Issuer = noTPM{}
		if i%2 == 1 {
			issuer = untrusted[i%len(untrusted)]
		}
		return c.askTicket(t, floodIP(i).String(), issuer)
	})
	t.Logf("%d handshakes with garbage certificates or untrusted EKs from %d addresses in %.1f s: %v",
		addresses, addresses, time.Since(start).Seconds(), reasons)
	// One more from a last address: once the ledger shows it, it shows every refusal before it.
	last := floodIP(addresses).String()
	_ = c.askTicket(t, last, noTPM{})
	c.waitLedger(t, "the last garbage certificate", ledgerRefusal(last, "NOT_ACTIVATED"))

	if flood := c.checkEvidenceKept(t, "garbage", replayIP, transplantIP); len(flood) == 0 {
		t.Fatal("no refusal of the garbage reached the ledger: the attack did not take place")
	}
}

// TestInitThroughProbeFlood: 500 addresses send identity probes to a fresh node's InitServer as fast
// as they can while the operator's berth init connects (probing the node's identity, activating its
// key) and runs. The node has no peers it knows: the operator's probe competes with the flood for
// the unauthenticated budget, and berth init dials again while it is refused (once a second, as it
// does); the test prints how many dials and how long it took.
func TestInitThroughProbeFlood(t *testing.T) {
	const (
		addresses = 500
		maxFlood  = 20 * time.Second
	)
	n := startInitNode(t, "control-plane")
	floodCtx, stop := context.WithTimeout(context.Background(), maxFlood)
	defer stop()
	pf := startProbeFlood(floodCtx, n.addr, addresses, 8)
	defer pf.stop()
	if err := pf.waitGoing(floodCtx); err != nil {
		t.Fatal(err)
	}
	probes, limited := &pf.probes, &pf.limited
	t.Logf("berth init starts with the flood at %d probes, %d rate-limited", probes.Load(), limited.Load())
	cpu0 := processCPU(n.proc.PID())
	start := time.Now()
	conn := n.ready(t, "127.0.8.201")
	connected := time.Since(start)
	if conn == nil {
		t.Fatal("berth init never connected under the probe flood")
	}
	o := runInit(floodCtx, conn, initRequest(n.secret, 1))
	took := time.Since(start)
	pf.stop()
	cpu := processCPU(n.proc.PID()) - cpu0
	t.Logf("probe flood: %d probes from %d addresses, %d rate-limited; the bootstrapper's CPU %.1f s over %.1f s",
		probes.Load(), addresses, limited.Load(), cpu, took.Seconds())
	t.Logf("berth init under the probe flood: connected after %s, init answered after %s, started: %v (%s %q)",
		connected.Round(time.Millisecond), took.Round(time.Millisecond), o.started, o.code, o.msg)
	if !o.started {
		t.Fatalf("berth init did not start under the probe flood: %+v", o)
	}
}

// probeFlood sends identity probes with random claims (claimsOnly) to a node's attested server from
// addresses loopback addresses (floodIP), from workers goroutines, as fast as they can.
type probeFlood struct {
	addresses       int
	probes, limited atomic.Int64
	cancel          context.CancelFunc
	wg              sync.WaitGroup
}

// startProbeFlood starts a probe flood against addr that lasts until ctx ends or stop.
func startProbeFlood(ctx context.Context, addr string, addresses, workers int) *probeFlood {
	ctx, cancel := context.WithCancel(ctx)
	f := &probeFlood{addresses: addresses, cancel: cancel}
	var next atomic.Int64
	for range workers {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			for ctx.Err() == nil {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: floodIP(int(next.Add(1)) % addresses)}}
				conn, err := d.DialContext(ctx, "tcp", addr)
				if err != nil {
					continue
				}
				_, err = atls.ProbeIdentity(ctx, conn, claimsOnly{})
				f.probes.Add(1)
				if errors.Is(err, atls.ErrRateLimited) {
					f.limited.Add(1)
				}
			}
		}()
	}
	return f
}

// waitGoing returns once the flood is refused by the node's budget, or has kept the node answering
// probes for a while: on a slow machine (the race detector, a loaded CI) the node's CPU is spent
// before the budget's 500 probes a second are, which is as hard on the operator.
func (f *probeFlood) waitGoing(ctx context.Context) error {
	if err := wait.PollUntilContextCancel(ctx, 10*time.Millisecond, true, func(context.Context) (bool, error) {
		return f.limited.Load() > 100 || f.probes.Load() > 2000, nil
	}); err != nil {
		return fmt.Errorf("the probe flood never got going: %d probes, %d rate-limited", f.probes.Load(), f.limited.Load())
	}
	return nil
}

// stop ends the flood and waits for its goroutines; calling it again does nothing.
func (f *probeFlood) stop() {
	f.cancel()
	f.wg.Wait()
}
