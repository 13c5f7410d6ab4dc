package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/loadchart"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/ledger"
	"github.com/berth-k8s/berth/joinservice/metrics"
	"github.com/berth-k8s/berth/joinservice/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(proctest.Main(m))) }

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

type instances []metadata.Instance

func (i instances) Peers(context.Context) ([]metadata.Instance, error) { return i, nil }

// writePKI writes the cluster CA: ECDSA P-256 (kubeadm's ECDSA-P256, which berth init uses) or
// RSA-2048 (kubeadm's default encryptionAlgorithm).
func writePKI(t *testing.T, alg string) string {
	dir := t.TempDir()
	var signer crypto.Signer
	var keyPEM []byte
	switch alg {
	case "ecdsa":
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		der, _ := x509.MarshalECPrivateKey(key)
		signer, keyPEM = key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	default:
		key, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			t.Fatal(err)
		}
		signer, keyPEM = key, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, signer.Public(), signer)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "ca.key"), keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

// cpuSeconds is the user+system CPU time of this process and of pids.
func cpuSeconds(pids []int) float64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	total := float64(ru.Utime.Sec+ru.Stime.Sec) + float64(ru.Utime.Usec+ru.Stime.Usec)/1e6
	for _, pid := range pids {
		total += procCPU(pid)
	}
	return total
}

func heapMB() float64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapInuse) / (1 << 20)
}

// phaseResult is one phase: counts and latency from the client process, CPU of the server side.
type phaseResult struct {
	OK, Rejected, Failed int
	P50ms, P99ms         float64
	ClientCPU            float64
	// Accepted and Refused are the phase's accepted and refused attempts by second (the chart).
	Accepted, Refused []loadchart.Point
	elapsed           time.Duration
	cpu               float64
}

func TestJoinLoad(t *testing.T) {
	if os.Getenv("BERTH_BENCH_JOIN") != "1" {
		t.Skip("load harness: run with BERTH_BENCH_JOIN=1 (make bench-join)")
	}
	duration, _ := time.ParseDuration(envOr("BENCH_JOIN_DURATION", "10s"))
	clients, _ := strconv.Atoi(envOr("BENCH_JOIN_CLIENTS", "16"))
	mode := envOr("BENCH_JOIN_API", "apiserver")

	fakeKube := fake.NewClientset()
	var kube kubernetes.Interface = fakeKube
	var pids []int
	if mode == "apiserver" {
		env := apiservertest.Shared(t)
		kube = env.Client(t, apiservertest.AdminUser)
		if _, err := kube.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "berth-system"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pids = env.PIDs()
	}

	zero, ones := strings.Repeat("00", 32), strings.Repeat("11", 32)
	pol, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: image}\n  15: {nonZero: true, source: lock}\n"), "bench policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	// Each client address has measurements: genuine (PCR 4 = zeros) or tampered (PCR 4 = ones).
	var measMu sync.RWMutex
	meas := map[string]attestation.Measurements{}
	check := func(ctx context.Context) ([]string, error) {
		p, _ := peer.FromContext(ctx)
		host, _, _ := net.SplitHostPort(p.Addr.String())
		measMu.RLock()
		m := meas[host]
		measMu.RUnlock()
		return pol.Evaluate(m)
	}
	var insts instances
	addrs := make([]string, clients)
	for i := range clients {
		addrs[i] = addrFor(i)
		insts = append(insts, metadata.Instance{Name: fmt.Sprintf("worker-%d", i), Role: metadata.RoleWorker, IPs: []string{addrs[i]}})
	}
	setMeasurements := func(pcr4 string) {
		measMu.Lock()
		defer measMu.Unlock()
		v, _ := hex.DecodeString(pcr4)
		for _, a := range addrs {
			meas[a] = attestation.Measurements{4: v, 15: bytes.Repeat([]byte{7}, 32)}
		}
	}

	caAlg := envOr("BENCH_JOIN_CA", "ecdsa")
	authority, err := ca.Load(writePKI(t, caAlg))
	if err != nil {
		t.Fatal(err)
	}
	keys, _ := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	journal := ledger.NewWriter(kube, "berth-system", "bench", zap.NewNop())
	m := metrics.New(journal)
	srv := server.New(server.Config{APIServerEndpoint: "198.51.100.10:6443", KubernetesVersion: "v1.34.2"}, productionLogger(), keys,
		bytes.Repeat([]byte{2}, 32), authority, insts, check,
		server.WithJournal(journal), server.WithObserver(m),
		server.WithLimits(atlsLimitsOff()))
	ctx, cancel := context.WithCancel(context.Background())
	ledgerDone := make(chan struct{})
	go func() { defer close(ledgerDone); _ = journal.Run(ctx) }()
	defer func() { cancel(); <-ledgerDone }()

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(server.GRPCServerOptions()...)
	joinproto.RegisterJoinServiceServer(g, srv)
	served := make(chan struct{})
	go func() { defer close(served); _ = g.Serve(lis) }()
	defer func() { g.Stop(); <-served }()

	// The clients run in a child process (TestJoinLoadClients), so that this process's CPU time is
	// the server's (and its ledger's and metrics') alone.
	run := func(d time.Duration) phaseResult {
		child := startClients(t, lis.Addr().String(), clients, d)
		cpu0, start := cpuSeconds(pids), time.Now()
		res := child.wait(t)
		res.elapsed, res.cpu = time.Since(start), cpuSeconds(pids)-cpu0
		return res
	}

	setMeasurements(zero)
	heap0 := heapMB()
	// Long runs sample the heap every 30 s to show whether memory stays flat.
	sampleCtx, stopSampling := context.WithCancel(context.Background())
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(30 * time.Second)
		defer tick.Stop()
		// The fake clientset records every call with its object forever (the ledger's 100 KB
		// ConfigMap twice a second): forget them, so the samples show the server's memory.
		forget := time.NewTicker(time.Second)
		defer forget.Stop()
		start := time.Now()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-forget.C:
				fakeKube.ClearActions()
			case <-tick.C:
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				fmt.Printf("t=%.0fs heap in use %.1f MB, goroutines %d, RSS %.0f MB%s\n", time.Since(start).Seconds(), float64(ms.HeapInuse)/(1<<20),
					runtime.NumGoroutine(), rssMB(os.Getpid()), apiRSS(pids))
			}
		}
	}()
	stopProfile := startCPUProfile(t, os.Getenv("BENCH_JOIN_CPUPROFILE"))
	acc := run(duration)
	stopProfile()
	stopSampling()
	<-sampled
	heap1 := heapMB()
	setMeasurements(ones)
	stopProfile = func() {}
	if path := os.Getenv("BENCH_JOIN_CPUPROFILE"); path != "" {
		stopProfile = startCPUProfile(t, path+".rejected")
	}
	rej := run(duration / 2)
	stopProfile()

	joinsPerSec := float64(acc.OK) / acc.elapsed.Seconds()
	cpuAcc, cpuRej := acc.cpu/float64(max(acc.OK, 1)), rej.cpu/float64(max(rej.Rejected, 1))
	fmt.Printf("api=%s ca=%s clients=%d duration=%s cpus=%d bootstrap tokens written=%d\n", mode, caAlg, clients, duration, runtime.NumCPU(), countTokens(t, kube, mode))
	fmt.Printf("accepted phase: %d tickets, %d failed, %.0f/s, server cpu %.3f ms/ticket (clients %.3f); heap in use %.1f MB before, %.1f MB after\n",
		acc.OK, acc.Failed, joinsPerSec, cpuAcc*1000, acc.ClientCPU/float64(max(acc.OK, 1))*1000, heap0, heap1)
	fmt.Printf("rejected phase: %d MEASUREMENT_MISMATCH, %d other, %.0f/s, server cpu %.3f ms/rejection (clients %.3f)\n",
		rej.Rejected, rej.Failed+rej.OK, float64(rej.Rejected)/rej.elapsed.Seconds(), cpuRej*1000, rej.ClientCPU/float64(max(rej.Rejected, 1))*1000)
	fmt.Printf("ledger: %d entries dropped (queue full), %d superseded (more than %d per write interval)\n", journal.Dropped(), journal.Superseded(), ledger.Capacity)
	writeChart(t, fmt.Sprintf("make bench-join, in process (api=%s, %d clients)", mode, clients),
		loadchart.Series{Name: "accepted joins", Points: acc.Accepted}, loadchart.Series{Name: "rejections", Points: rej.Refused})
	fmt.Printf("joins/s=%.0f p50_ms=%.2f p99_ms=%.2f reject_cost_ratio=%.3f\n", joinsPerSec, acc.P50ms, acc.P99ms, cpuRej/cpuAcc)
}

// chartInterval is the width of a point of the chart.
const chartInterval = time.Second

// writeChart draws the phases one after the other (throughput, p50 and p99 latency by second) into
// the PNG file BENCH_JOIN_CHART names, if it names one, and says where.
func writeChart(t *testing.T, title string, phases ...loadchart.Series) {
	path := os.Getenv("BENCH_JOIN_CHART")
	if path == "" {
		return
	}
	var at float64
	var series []loadchart.Series
	for _, p := range phases {
		series = append(series, p.Shift(at))
		at += p.End(chartInterval)
	}
	if err := loadchart.WritePNG(path, title, series...); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("chart (throughput and latency by second, the phases one after the other): %s\n", path)
}

// productionLogger logs like the joinservice binary (zap.NewProduction: JSON, info level, sampled to
// 100 lines per second per message and every 100th beyond) into io.Discard, so that the server pays
// for encoding what it logs, as in production.
func productionLogger() *zap.Logger {
	core := zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zapcore.InfoLevel)
	return zap.New(zapcore.NewSamplerWithOptions(core, time.Second, 100, 100))
}

// addrFor is client i's loopback address: each client is a distinct peer.
func addrFor(i int) string { return fmt.Sprintf("127.0.%d.%d", 1+i/250, 1+i%250) }

// clientProcess is a running TestJoinLoadClients child.
type clientProcess struct {
	cmd *exec.Cmd
	out *bufio.Scanner
	in  io.WriteCloser
}

const resultPrefix = "BENCH_CLIENT_RESULT "

// startClients starts the client process for one phase of d against target and returns once its
// clients are connected and warmed up; the phase starts with wait.
func startClients(t *testing.T, target string, clients int, d time.Duration) *clientProcess {
	return startClientProcess(t, "TestJoinLoadClients", target, clients, d)
}

// startClientProcess runs test (a client side) as a child process with the phase's settings and env.
func startClientProcess(t *testing.T, test, target string, clients int, d time.Duration, env ...string) *clientProcess {
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1")
	cmd.Env = append(append(os.Environ(), "BERTH_BENCH_JOIN_CLIENT=1", "BENCH_JOIN_TARGET="+target,
		"BENCH_JOIN_CLIENTS="+strconv.Itoa(clients), "BENCH_JOIN_PHASE="+d.String()), env...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &clientProcess{cmd: cmd, out: bufio.NewScanner(stdout), in: stdin}
	for p.out.Scan() {
		if p.out.Text() == "READY" {
			return p
		}
	}
	_ = cmd.Wait()
	t.Fatal("the client process ended before it was ready")
	return nil
}

// wait starts the phase and returns the client process's result.
func (p *clientProcess) wait(t *testing.T) phaseResult {
	if _, err := io.WriteString(p.in, "GO\n"); err != nil {
		t.Fatal(err)
	}
	var res phaseResult
	found := false
	for p.out.Scan() {
		if line, ok := strings.CutPrefix(p.out.Text(), resultPrefix); ok {
			if err := json.Unmarshal([]byte(line), &res); err != nil {
				t.Fatal(err)
			}
			found = true
		}
	}
	_ = p.in.Close()
	if err := p.cmd.Wait(); err != nil || !found {
		t.Fatalf("client process: %v (result found: %v)", err, found)
	}
	return res
}

// TestJoinLoadClients is the client side of TestJoinLoad, run by it as a child process: it connects
// its clients, warms up for a second, says READY, waits for GO on stdin, runs the phase and prints
// its result as JSON.
func TestJoinLoadClients(t *testing.T) {
	if os.Getenv("BERTH_BENCH_JOIN_CLIENT") != "1" {
		t.Skip("client process of TestJoinLoad")
	}
	clients, _ := strconv.Atoi(os.Getenv("BENCH_JOIN_CLIENTS"))
	phase, _ := time.ParseDuration(os.Getenv("BENCH_JOIN_PHASE"))
	conns := make([]joinproto.JoinServiceClient, clients)
	csrs := make([][]byte, clients)
	for i := range clients {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(addrFor(i))}}
		conn, err := grpc.NewClient("passthrough:///"+os.Getenv("BENCH_JOIN_TARGET"), grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conns[i] = joinproto.NewJoinServiceClient(conn)
		// The bootstrapper's kubelet key: ECDSA P-256 (bootstrapper/joinclient).
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if csrs[i], err = x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "x"}}, key); err != nil {
			t.Fatal(err)
		}
	}
	runClientPhase(t, clients, time.Second, phase, func(i, _ int) outcome {
		_, err := conns[i].IssueJoinTicket(context.Background(), &joinproto.IssueJoinTicketRequest{KubeletCsr: csrs[i], Role: joinproto.Role_ROLE_WORKER, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"})
		switch {
		case err == nil:
			return accepted
		case strings.Contains(err.Error(), "index 4"):
			return refused
		default:
			return failed
		}
	})
}

// outcome is how one attempt of a client process ended.
type outcome int

const (
	accepted outcome = iota
	refused
	failed
)

// runClientPhase is the body of a client process: clients goroutines call attempt(client, n) in a
// closed loop for warmup, then it says READY, waits for GO on stdin, runs the phase and prints the
// result (counts, latency of accepted attempts, this process's CPU) as JSON.
func runClientPhase(t *testing.T, clients int, warmup, phase time.Duration, attempt func(client, n int) outcome) {
	drive := func(d time.Duration) (res phaseResult, lat *histogram) {
		lat = newHistogram()
		var mu sync.Mutex
		start := time.Now()
		deadline := start.Add(d)
		acceptedAt, _ := loadchart.NewRecorder(start, chartInterval)
		refusedAt, _ := loadchart.NewRecorder(start, chartInterval)
		var wg sync.WaitGroup
		for i := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var mine phaseResult
				for n := 0; time.Now().Before(deadline); n++ {
					t0 := time.Now()
					o := attempt(i, n)
					took := time.Since(t0)
					switch o {
					case accepted:
						mine.OK++
						lat.add(took)
						acceptedAt.Add(t0, took)
					case refused:
						mine.Rejected++
						refusedAt.Add(t0, took)
					default:
						mine.Failed++
					}
				}
				mu.Lock()
				res.OK, res.Rejected, res.Failed = res.OK+mine.OK, res.Rejected+mine.Rejected, res.Failed+mine.Failed
				mu.Unlock()
			}()
		}
		wg.Wait()
		acceptedAt.Stop(deadline)
		refusedAt.Stop(deadline)
		res.Accepted, res.Refused = acceptedAt.Points(), refusedAt.Points()
		return res, lat
	}
	_, _ = drive(warmup) // connections, caches, activations
	fmt.Println("READY")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cpu0 := cpuSeconds(nil)
	res, lat := drive(phase)
	ms := func(q float64) float64 { return float64(lat.quantile(q).Microseconds()) / 1000 }
	res.P50ms, res.P99ms, res.ClientCPU = ms(0.50), ms(0.99), cpuSeconds(nil)-cpu0
	out, _ := json.Marshal(res)
	fmt.Println(resultPrefix + string(out))
}

// startCPUProfile profiles the process into path (empty: no profile) until the returned func runs.
func startCPUProfile(t *testing.T, path string) func() {
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		t.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}
}

// rssMB is the resident set size of process pid.
func rssMB(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// apiRSS describes the resident set sizes of etcd and kube-apiserver, if they run.
func apiRSS(pids []int) string {
	var parts []string
	for _, pid := range pids {
		parts = append(parts, fmt.Sprintf("%.0f", rssMB(pid)))
	}
	if len(parts) == 0 {
		return ""
	}
	return "; etcd, kube-apiserver RSS " + strings.Join(parts, ", ") + " MB"
}

// countTokens counts the bootstrap token Secrets in the API server: a worker join writes none.
func countTokens(t *testing.T, kube kubernetes.Interface, mode string) int {
	if mode != "apiserver" {
		return 0
	}
	l, err := kube.CoreV1().Secrets("kube-system").List(context.Background(), metav1.ListOptions{FieldSelector: "type=bootstrap.kubernetes.io/token"})
	if err != nil {
		t.Fatal(err)
	}
	return len(l.Items)
}

// atlsLimitsOff lifts the server's rate limits: the harness measures capacity, not the limiter.
func atlsLimitsOff() atls.Limits {
	return atls.Limits{PerPeer: 1e9, PerPeerBurst: 1 << 30, Global: 1e9, GlobalBurst: 1 << 30}
}

// histogram counts latencies in 10 µs buckets up to 2 s (the last bucket holds everything above), so
// that a long run's memory does not grow with the number of requests.
type histogram struct{ buckets []atomic.Uint64 }

const histBucket = 10 * time.Microsecond

func newHistogram() *histogram { return &histogram{buckets: make([]atomic.Uint64, 200_000)} }

func (h *histogram) add(d time.Duration) {
	i := min(int(d/histBucket), len(h.buckets)-1)
	h.buckets[i].Add(1)
}

// quantile returns the upper bound of the bucket holding quantile q.
func (h *histogram) quantile(q float64) time.Duration {
	var total uint64
	for i := range h.buckets {
		total += h.buckets[i].Load()
	}
	if total == 0 {
		return 0
	}
	want := uint64(q*float64(total-1)) + 1
	var seen uint64
	for i := range h.buckets {
		if seen += h.buckets[i].Load(); seen >= want {
			return time.Duration(i+1) * histBucket
		}
	}
	return time.Duration(len(h.buckets)) * histBucket
}
