package attack

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
)

// claimsOnly is a flooding peer: no TPM at all, only claims (one random value per PCR) that the
// joinservice refuses in an identity probe, which costs the peer a TLS handshake.
type claimsOnly struct{}

func (claimsOnly) Variant() string { return "tpm" }
func (claimsOnly) Issue(context.Context, []byte, []byte) ([]byte, error) {
	return nil, errors.New("a flooding peer has no TPM")
}

func (claimsOnly) Claims(context.Context) (attestation.Measurements, error) {
	m := attestation.Measurements{}
	for i := range uint32(24) {
		m[i] = make([]byte, 32)
		_, _ = rand.Read(m[i])
	}
	return m, nil
}

// floodIP is the i-th flooding address: 127.10.0.1 and on, none of them an instance of the cluster.
func floodIP(i int) net.IP { return net.IPv4(127, 10, byte(i/250), byte(1+i%250)) }

// flood is one run of the flood harness.
type flood struct {
	duration  time.Duration
	addresses int
	workers   int
	joins     int
}

// floodResult is what a run measured.
type floodResult struct {
	probes, refused, rateLimited, failed int64
	joinLatencies                        []time.Duration
	joinErrors                           []error

	mu     sync.Mutex
	errors map[string]int // the other failures, by error text (the first few kinds)
}

// otherFailure counts a probe that ended neither in a refusal on claims nor in the rate limit.
func (r *floodResult) otherFailure(err error) {
	atomic.AddInt64(&r.failed, 1)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.errors == nil {
		r.errors = map[string]int{}
	}
	if _, ok := r.errors[err.Error()]; ok || len(r.errors) < 5 {
		r.errors[err.Error()]++
	}
}

// runFlood attacks a joinservice: first the evidence the ledger must keep (accepted joins, a replay, a
// transplant, an untrusted EK, a lie about measurements refused on the verified quote), then f.workers
// goroutines send identity probes with random claims from f.addresses loopback addresses as fast as
// they can for f.duration, while f.joins genuine nodes from addresses metadata knows join at an even
// pace. It returns what it measured and checks that every genuine join succeeded and that the ledger
// still holds the evidence afterwards.
func runFlood(t *testing.T, c *joinCluster, f flood) *floodResult {
	t.Helper()
	ctx := context.Background()
	// The evidence, each from its own worker address.
	type evidence struct{ peer, reason string }
	var kept []evidence
	next := workers // the last workers' addresses; the genuine joins during the flood use the first
	ip := func() string { next--; return workerIP(next + 1) }
	for range 3 {
		addr := ip()
		if _, err := c.join(t, addr, softTPM(t, c.nodeCA, genuinePCRs()), workerRequest(t, diskA)); err != nil {
			t.Fatalf("genuine join before the flood: %v", err)
		}
		kept = append(kept, evidence{addr, ""})
	}
	addr := ip()
	r := &replaying{SoftTPM: softTPM(t, c.nodeCA, genuinePCRs())}
	if _, err := c.join(t, addr, r, workerRequest(t, diskA)); err != nil {
		t.Fatal(err)
	}
	_, _ = c.join(t, addr, r, workerRequest(t, diskA))
	kept = append(kept, evidence{addr, "NONCE_MISMATCH"})
	addr = ip()
	_, _ = c.join(t, addr, transplanting{softTPM(t, c.nodeCA, genuinePCRs())}, workerRequest(t, diskA))
	kept = append(kept, evidence{addr, "KEY_BINDING"})
	addr = ip()
	other, err := vtpmtest.NewCA("untrusted EK CA")
	if err != nil {
		t.Fatal(err)
	}
	// An EK under a CA of the peer's own is refused too, and recorded as unverified: it cost the peer
	// nothing a TPM verified, so the flood may evict it.
	_, _ = c.join(t, addr, softTPM(t, other, genuinePCRs()), workerRequest(t, diskA))
	addr = ip()
	_, _ = c.join(t, addr, lying{softTPM(t, c.nodeCA, tamperedPCRs())}, workerRequest(t, diskA))
	kept = append(kept, evidence{addr, "MEASUREMENT_MISMATCH"})
	for _, e := range kept {
		c.waitLedger(t, fmt.Sprintf("%s from %s before the flood", e.reason, e.peer), func(le joinledger.Entry) bool {
			return le.Peer == e.peer && (e.reason == "" && le.Outcome == joinledger.OutcomeAccepted || e.reason != "" && le.Reason == e.reason)
		})
	}

	// The genuine nodes' TPMs are made before the flood: their key generation is no part of a join.
	tpms := make([]*vtpmtest.SoftTPM, f.joins)
	for i := range tpms {
		tpms[i] = softTPM(t, c.nodeCA, genuinePCRs())
	}

	res := &floodResult{}
	cpu0 := processCPU(c.js.PID())
	floodCtx, stop := context.WithTimeout(ctx, f.duration)
	defer stop()
	deadline, _ := floodCtx.Deadline()
	var wg sync.WaitGroup
	var n atomic.Int64
	for range f.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for floodCtx.Err() == nil {
				i := int(n.Add(1))
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: floodIP(i % f.addresses)}}
				conn, err := d.DialContext(floodCtx, "tcp", c.addr)
				if err != nil {
					// Past the deadline a dial fails at once with an i/o timeout, and the context may
					// report its end only later: such a dial is cut off by the flood's end, no failure.
					if floodCtx.Err() == nil && time.Now().Before(deadline) {
						res.otherFailure(err)
					}
					continue
				}
				_, err = atls.ProbeIdentity(floodCtx, conn, claimsOnly{})
				atomic.AddInt64(&res.probes, 1)
				switch {
				case errors.Is(err, atls.ErrClaimsRejected):
					atomic.AddInt64(&res.refused, 1)
				case errors.Is(err, atls.ErrRateLimited):
					atomic.AddInt64(&res.rateLimited, 1)
				case floodCtx.Err() != nil: // cut off by the flood's end
				default:
					res.otherFailure(err)
				}
			}
		}()
	}
	// The genuine joins, at an even pace over the flood, each from a known address: every other one
	// with the image's policy (without the cluster's AK CA), which probes the joinservice's identity
	// and activates its key, the others with the cluster's certified policy.
	start := time.Now()
	pace := time.NewTicker(f.duration / time.Duration(f.joins+1))
	defer pace.Stop()
	activatingOK := 0
	for i, tpm := range tpms {
		<-pace.C
		t0 := time.Now()
		p := c.joinPolicy
		if i%2 == 1 {
			p = c.activating
		}
		_, err := c.joinWith(t, workerIP(1+i%(workers-10)), tpm, p, workerRequest(t, diskA))
		if err != nil {
			res.joinErrors = append(res.joinErrors, fmt.Errorf("join %d (%s): %w", i, policyName(i), err))
			continue
		}
		if i%2 == 1 {
			activatingOK++
		}
		res.joinLatencies = append(res.joinLatencies, time.Since(t0))
	}
	wg.Wait()
	elapsed := time.Since(start)
	cpu := processCPU(c.js.PID()) - cpu0
	t.Logf("flood: %d identity probes with random claims from %d addresses (%d goroutines) in %.1f s: %.0f/s; %d refused on claims, %d rate-limited, %d failed otherwise",
		res.probes, f.addresses, f.workers, elapsed.Seconds(), float64(res.probes)/elapsed.Seconds(), res.refused, res.rateLimited, res.failed)
	t.Logf("the joinservice's CPU during the flood: %.1f s of %.1f s (%.0f %% of one core; its limit: %d core), %.3f ms per probe (joins included); peak RSS %.0f MiB (limit %d MiB)",
		cpu, elapsed.Seconds(), 100*cpu/elapsed.Seconds(), berthsystem.JoinServiceCPUs, 1000*cpu/float64(max(res.probes, 1)),
		processPeakRSS(c.js.PID())/(1<<20), berthsystem.JoinServiceMemoryLimitBytes>>20)
	for text, n := range res.errors {
		t.Logf("  failed otherwise: %d× %s", n, text)
	}
	slices.Sort(res.joinLatencies)
	if len(res.joinLatencies) > 0 {
		t.Logf("genuine joins from known addresses during the flood: %d of %d accepted (with the image's policy: %d of %d), p50 %s, p99 %s, max %s",
			len(res.joinLatencies), f.joins, activatingOK, f.joins/2, percentile(res.joinLatencies, 50), percentile(res.joinLatencies, 99), res.joinLatencies[len(res.joinLatencies)-1])
	}
	for _, err := range res.joinErrors {
		t.Errorf("a genuine join failed during the flood: %v", err)
	}
	if res.refused == 0 {
		t.Errorf("no probe was refused on its claims: the flood did not reach the joinservice")
	}

	// The ledger after the flood: the evidence from before it is all there.
	ledgerCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	es, err := joinledger.Read(ledgerCtx, c.admin, joinconfig.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	for _, e := range es {
		kinds[joinledger.KindOf(e)]++
	}
	t.Logf("the ledger after the flood: %d entries (%d accepted, %d evidence, %d unverified)", len(es), kinds[joinledger.KindAccepted], kinds[joinledger.KindEvidence], kinds[joinledger.KindUnverified])
	for _, want := range kept {
		found := false
		for _, e := range es {
			if e.Peer == want.peer && (want.reason == "" && e.Outcome == joinledger.OutcomeAccepted || want.reason != "" && e.Reason == want.reason) {
				found = true
				t.Logf("  kept: %s %-9s %-8s %-20s %s", e.Time.Format(time.TimeOnly), e.Peer, e.Outcome, e.Reason, oneLine(e.Message, 90))
			}
		}
		if !found {
			t.Errorf("the flood evicted %s of %s from the ledger", orAccepted(want.reason), want.peer)
		}
	}
	return res
}

// policyName names the policy of the i-th genuine join of a flood.
func policyName(i int) string {
	if i%2 == 1 {
		return "the image's policy"
	}
	return "the certified policy"
}

// processPeakRSS is the peak resident set of process pid so far, in bytes (VmHWM).
func processPeakRSS(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb * 1024
		}
	}
	return 0
}

// processCPU is the user and system CPU seconds process pid used so far.
func processCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	user, _ := strconv.ParseFloat(f[11], 64)
	system, _ := strconv.ParseFloat(f[12], 64)
	return (user + system) / 100 // USER_HZ
}

func orAccepted(reason string) string {
	if reason == "" {
		return "the accepted join"
	}
	return reason
}

func oneLine(s string, n int) string {
	if len(s) > n {
		s = s[:n] + "..."
	}
	return strconv.Quote(s)
}

// percentile is the p-th percentile of sorted durations (nearest rank).
func percentile(sorted []time.Duration, p int) time.Duration {
	i := (len(sorted)*p + 99) / 100
	return sorted[max(0, min(i, len(sorted))-1)]
}

// TestFloodKeepsGenuineJoins is the suite's short flood: 500 addresses, 8 s, 12 genuine joins (6 with the
// image's policy, which probe).
func TestFloodKeepsGenuineJoins(t *testing.T) {
	c := startJoinCluster(t)
	runFlood(t, c, flood{duration: 8 * time.Second, addresses: 500, workers: 4 * runtime.GOMAXPROCS(0), joins: 12})
}

// TestFloodHarness is the flood of issue 20's must-show 1 and 2 (make attack-flood): FLOOD_ADDRESSES
// (default 500) addresses, FLOOD_DURATION (default 30s), FLOOD_WORKERS goroutines (default 16 per
// CPU), FLOOD_JOINS genuine joins (default 24).
func TestFloodHarness(t *testing.T) {
	if os.Getenv("BERTH_ATTACK_FLOOD") != "1" {
		t.Skip("flood harness: run with BERTH_ATTACK_FLOOD=1 (make attack-flood)")
	}
	f := flood{duration: 30 * time.Second, addresses: 500, workers: 16 * runtime.GOMAXPROCS(0), joins: 24}
	if v, err := time.ParseDuration(os.Getenv("FLOOD_DURATION")); err == nil {
		f.duration = v
	}
	for env, dst := range map[string]*int{"FLOOD_ADDRESSES": &f.addresses, "FLOOD_WORKERS": &f.workers, "FLOOD_JOINS": &f.joins} {
		if v, err := strconv.Atoi(os.Getenv(env)); err == nil && v > 0 {
			*dst = v
		}
	}
	c := startJoinCluster(t)
	res := runFlood(t, c, f)
	fmt.Printf("flood_probes_per_s=%.0f addresses=%d joins_ok=%d/%d join_p50_ms=%.1f join_p99_ms=%.1f\n",
		float64(res.probes)/f.duration.Seconds(), f.addresses, len(res.joinLatencies), f.joins,
		ms(res.joinLatencies, 50), ms(res.joinLatencies, 99))
}

func ms(sorted []time.Duration, p int) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(percentile(sorted, p).Microseconds()) / 1000
}
