package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/internal/loadchart"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinproto"
)

// Phase kinds of the attested harness.
const (
	kindGenuine   = "genuine"            // accepted joins
	kindTampered  = "tampered"           // PCR 4 deviates; the node claims its PCRs up front
	kindUnclaimed = "tampered-unclaimed" // PCR 4 deviates; the node makes no claims (full handshake)
)

// TestJoinLoadAttested is the load harness of `make bench-join` (see doc.go): the real joinservice
// binary, attesting with swtpm, against a real kube-apiserver + etcd, driven by software attesters
// producing TPM-format evidence over mutual attested TLS.
func TestJoinLoadAttested(t *testing.T) {
	if os.Getenv("BERTH_BENCH_JOIN") != "1" {
		t.Skip("load harness: run with BERTH_BENCH_JOIN=1 (make bench-join)")
	}
	duration, _ := time.ParseDuration(envOr("BENCH_JOIN_DURATION", "10s"))
	clients, _ := strconv.Atoi(envOr("BENCH_JOIN_CLIENTS", "16"))
	ctx := context.Background()

	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm
	env := apiservertest.Shared(t) // skips without kube-apiserver and etcd
	serviceTPM := vtpmtest.StartSwtpm(t, swCA)
	if err := vtpm.NewLockRegister(serviceTPM.Open, 15).MarkBootstrapped(ctx, apiservertest.ClusterID()); err != nil {
		t.Fatal(err)
	}
	nodeCA, err := vtpmtest.NewCA("bench EK CA")
	if err != nil {
		t.Fatal(err)
	}
	zero := strings.Repeat("00", 32)
	// The cluster's policy trusts the EK CAs of all its machines: the joinservice checks its own EK
	// against it before its attestation key is certified.
	clusterPolicy := "variant: tpm\nmeasurements:\n  4: {expected: " + zero + ", source: the image}\n  15: {expected: " + zero + ", source: fresh node}\n" +
		"trustRoots:\n  - pem: |\n" + indent(string(nodeCA.PEM())+string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	if err := env.InstallBerth(ctx, clusterPolicy); err != nil {
		t.Fatal(err)
	}
	joinPolicy := "variant: tpm\nmeasurements:\n  4: {expected: " + zero + ", source: the image}\n  15: {nonZero: true, source: bootstrapped}\n" +
		"trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	// BENCH_JOIN_SESSION=1 (default): the nodes' join policy lists the cluster's attestation-key CA,
	// which certified the joinservice's AK at its start: the nodes take its session proof, no probe,
	// no activation, no quote per join. 0: they activate the joinservice's key on every join.
	session := envOr("BENCH_JOIN_SESSION", "1") == "1"
	if session {
		keys := apiservertest.ClusterKeys()
		akCA, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
		if err != nil {
			t.Fatal(err)
		}
		joinPolicy += "akRoots:\n  - pem: |\n" + indent(string(akCA.PEM()), "      ")
	}

	dir := t.TempDir()
	var meta strings.Builder
	meta.WriteString("self: {name: cp-0, role: control-plane, ips: [198.51.100.10]}\npeers:\n")
	for i := range clients {
		fmt.Fprintf(&meta, "  - {name: worker-%d, role: worker, ips: [%s]}\n", i, addrFor(i))
	}
	files := map[string][]byte{"metadata.yaml": []byte(meta.String()), "join-policy.yaml": []byte(joinPolicy), "ek-ca.pem": caPEM(t, nodeCA)}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.JoinServiceUser)
	if err != nil {
		t.Fatal(err)
	}
	addr, metricsAddr := proctest.FreeAddr(t), proctest.FreeAddr(t)
	// The harness measures capacity, not the limiters: every limit is lifted.
	lifted := []string{"--rate-per-peer=1e9", "--rate-per-peer-burst=1000000000", "--rate-global=1e9", "--rate-global-burst=1000000000",
		"--attest-rate-per-peer=1e9", "--attest-rate-per-peer-burst=1000000000", "--attest-rate-global=1e9", "--attest-rate-global-burst=1000000000",
		"--attest-rate-known=1e9", "--attest-rate-known-burst=1000000000", "--attest-rate-unauthenticated=0"}
	// As many cores as its DaemonSet's CPU limit gives it (Go sizes GOMAXPROCS to the limit there).
	js := proctest.Start(t, proctest.Cmd{
		Name: "joinservice", Path: proctest.Build(t, "github.com/berth-k8s/berth/joinservice/cmd/joinservice"), Grace: 20 * time.Second,
		Env: []string{fmt.Sprintf("GOMAXPROCS=%d", berthsystem.JoinServiceCPUs)},
		Args: append([]string{"--attestation=tpm", "--tpm=" + serviceTPM.Spec, "--metadata=static",
			"--metadata-file=" + filepath.Join(dir, "metadata.yaml"), "--kubeconfig=" + kubeconfig, "--listen=" + addr,
			"--metrics-listen=" + metricsAddr, "--pki-dir=" + writePKI(t, "ecdsa"), "--replica=cp-0"}, lifted...),
	})
	if err := proctest.WaitReady(ctx, 100*time.Millisecond, 2*time.Minute, proctest.HTTPOK("http://"+metricsAddr+"/readyz"), js); err != nil {
		t.Fatalf("waiting for the joinservice's /readyz: %v", err)
	}

	jsPID, tpmPID, apiPIDs := js.PID(), serviceTPM.PID(), env.PIDs()
	type cpu struct{ js, tpm, api float64 }
	sample := func() cpu {
		c := cpu{js: procCPU(jsPID), tpm: procCPU(tpmPID)}
		for _, p := range apiPIDs {
			c.api += procCPU(p)
		}
		return c
	}
	clientEnv := []string{"BENCH_JOIN_EK_CA=" + filepath.Join(dir, "ek-ca.pem"), "BENCH_JOIN_POLICY=" + filepath.Join(dir, "join-policy.yaml"),
		"BENCH_JOIN_IDENTITIES=" + envOr("BENCH_JOIN_IDENTITIES", "4")}
	type phase struct {
		phaseResult
		cpu cpu
	}
	run := func(kind string, d time.Duration, sampleMemory bool) phase {
		child := startClientProcess(t, "TestJoinLoadAttestedClients", addr, clients, d, append(clientEnv, "BENCH_JOIN_KIND="+kind)...)
		stop := func() {}
		if sampleMemory {
			stop = sampleEvery(30*time.Second, func(at time.Duration) {
				fmt.Printf("t=%.0fs joinservice %s; swtpm RSS %.0f MB%s\n", at.Seconds(), scrapeMemory(metricsAddr), rssMB(tpmPID), apiRSS(apiPIDs))
			})
		}
		c0, start := sample(), time.Now()
		res := child.wait(t)
		stop()
		c1 := sample()
		res.elapsed = time.Since(start)
		return phase{phaseResult: res, cpu: cpu{js: c1.js - c0.js, tpm: c1.tpm - c0.tpm, api: c1.api - c0.api}}
	}

	fmt.Printf("joinservice at start: %s\n", scrapeMemory(metricsAddr))
	acc := run(kindGenuine, duration, true)
	rej := run(kindTampered, duration/2, false)
	full := run(kindUnclaimed, duration/2, false)

	per := func(p phase, n int) (js, tpm, api float64) {
		n = max(n, 1)
		return p.cpu.js / float64(n) * 1000, p.cpu.tpm / float64(n) * 1000, p.cpu.api / float64(n) * 1000
	}
	accJS, accTPM, accAPI := per(acc, acc.OK)
	rejJS, rejTPM, rejAPI := per(rej, rej.Rejected)
	fullJS, fullTPM, fullAPI := per(full, full.Rejected)
	joinsPerSec := float64(acc.OK) / acc.elapsed.Seconds()
	fmt.Printf("attested: real joinservice binary + swtpm, kube-apiserver + etcd, clients=%d duration=%s identities/client=%s session=%v cpus=%d\n",
		clients, duration, envOr("BENCH_JOIN_IDENTITIES", "4"), session, runtime.NumCPU())
	line := func(name string, n, other int, el time.Duration, js, tpm, api, client float64) {
		fmt.Printf("%-31s %6d (%d other), %6.0f/s; server ms each: joinservice %.3f + swtpm %.3f + API %.3f = %.3f (clients %.3f)\n",
			name, n, other, float64(n)/el.Seconds(), js, tpm, api, js+tpm+api, client)
	}
	line("accepted joins:", acc.OK, acc.Failed+acc.Rejected, acc.elapsed, accJS, accTPM, accAPI, acc.ClientCPU/float64(max(acc.OK, 1))*1000)
	line("rejected on claims:", rej.Rejected, rej.Failed+rej.OK, rej.elapsed, rejJS, rejTPM, rejAPI, rej.ClientCPU/float64(max(rej.Rejected, 1))*1000)
	line("rejected after full validation:", full.Rejected, full.Failed+full.OK, full.elapsed, fullJS, fullTPM, fullAPI, full.ClientCPU/float64(max(full.Rejected, 1))*1000)
	fmt.Printf("joinservice at end: %s\n", scrapeMemory(metricsAddr))
	accCost, rejCost := accJS+accTPM+accAPI, rejJS+rejTPM+rejAPI
	fmt.Printf("reject cost without claims: %.3f of an accepted join; joinservice process alone: %.3f (claimed) / %.3f (unclaimed)\n",
		(fullJS+fullTPM+fullAPI)/accCost, rejJS/accJS, fullJS/accJS)
	if acc.OK == 0 || rej.Rejected == 0 {
		t.Fatalf("a phase made no progress: %d accepted, %d rejected", acc.OK, rej.Rejected)
	}
	writeChart(t, fmt.Sprintf("make bench-join, attested (%d clients)", clients), loadchart.Series{Name: "accepted joins", Points: acc.Accepted},
		loadchart.Series{Name: "rejected on claims", Points: rej.Refused}, loadchart.Series{Name: "rejected after validation", Points: full.Refused})
	fmt.Printf("joins/s=%.0f p50_ms=%.2f p99_ms=%.2f reject_cost_ratio=%.3f server_ms_per_join=%.3f\n", joinsPerSec, acc.P50ms, acc.P99ms, rejCost/accCost, accCost)
}

// TestJoinLoadAttestedClients is the client side of TestJoinLoadAttested, run as a child process:
// BENCH_JOIN_CLIENTS concurrent nodes, each a loop of joins from its own loopback address with
// software TPMs (BENCH_JOIN_IDENTITIES per client, used in turn), each join a new gRPC connection,
// a new validator (a new node has never seen the joinservice) and so a full mutual handshake with
// activation of the joinservice's key.
func TestJoinLoadAttestedClients(t *testing.T) {
	if os.Getenv("BERTH_BENCH_JOIN_CLIENT") != "1" {
		t.Skip("client process of TestJoinLoadAttested")
	}
	clients, _ := strconv.Atoi(os.Getenv("BENCH_JOIN_CLIENTS"))
	perClient, _ := strconv.Atoi(os.Getenv("BENCH_JOIN_IDENTITIES"))
	phase, _ := time.ParseDuration(os.Getenv("BENCH_JOIN_PHASE"))
	kind, target := os.Getenv("BENCH_JOIN_KIND"), os.Getenv("BENCH_JOIN_TARGET")
	ca := loadCA(t, os.Getenv("BENCH_JOIN_EK_CA"))
	text, err := os.ReadFile(os.Getenv("BENCH_JOIN_POLICY"))
	if err != nil {
		t.Fatal(err)
	}
	joinPolicy, err := policy.Parse(text, "join policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	pcrs := map[uint32][]byte{}
	for i := range uint32(24) {
		pcrs[i] = make([]byte, 32)
	}
	if kind != kindGenuine {
		pcrs[4] = bytes.Repeat([]byte{0x11}, 32)
	}
	ids := make([][]atls.Issuer, clients)
	csrs := make([][]byte, clients)
	for i := range clients {
		for range max(perClient, 1) {
			s, err := vtpmtest.NewSoftTPM(ca, pcrs)
			if err != nil {
				t.Fatal(err)
			}
			if kind == kindUnclaimed {
				ids[i] = append(ids[i], unclaimed{s})
			} else {
				ids[i] = append(ids[i], s)
			}
		}
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if csrs[i], err = x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "x"}}, key); err != nil {
			t.Fatal(err)
		}
	}
	bound := joindial.LockRegisterCheck(15, vtpm.ExpectedLockValue)
	var failMu sync.Mutex
	failures := 0
	join := func(i, n int) outcome {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		validator, err := choose.NewValidator(joinPolicy, zap.NewNop())
		if err != nil {
			t.Error(err)
			return failed
		}
		creds, err := atls.NewCredentials(ids[i][n%len(ids[i])], validator)
		if err != nil {
			t.Error(err)
			return failed
		}
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(addrFor(i))}}
		conn, err := grpc.NewClient("passthrough:///"+target, grpc.WithTransportCredentials(creds),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
		if err != nil {
			t.Error(err)
			return failed
		}
		defer conn.Close()
		var p peer.Peer
		resp, err := joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx,
			&joinproto.IssueJoinTicketRequest{KubeletCsr: csrs[i], Role: joinproto.Role_ROLE_WORKER, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"}, grpc.Peer(&p))
		if err == nil {
			// What the JoinClient checks before it uses a ticket: the joinservice is bound to the cluster.
			info, isATLS := p.AuthInfo.(atls.AuthInfo)
			if !isATLS || info.Evidence == nil {
				err = errors.New("joinservice presented no attestation")
			} else {
				err = bound(info.Evidence, resp.GetClusterId())
			}
		}
		msg := status.Convert(err).Message()
		if r, isRej := atls.ParseRejection(msg); isRej && r.Reason == "MEASUREMENT_MISMATCH" {
			return refused
		}
		if status.Code(err) == codes.PermissionDenied && strings.Contains(msg, "index 4") {
			return refused
		}
		if err != nil {
			failMu.Lock()
			if failures++; failures <= 3 {
				fmt.Fprintf(os.Stderr, "join failed: %v\n", err)
			}
			failMu.Unlock()
			return failed
		}
		return accepted
	}
	runClientPhase(t, clients, 2*time.Second, phase, join) // warm-up: every identity activated once
}

// unclaimed is a software TPM that makes no claims, so its handshake runs in full before the
// joinservice judges its measurements (as a TDX node's does).
type unclaimed struct{ s *vtpmtest.SoftTPM }

func (u unclaimed) Variant() string { return u.s.Variant() }
func (u unclaimed) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	return u.s.Issue(ctx, userData, nonce)
}
func (u unclaimed) Identity(ctx context.Context) ([]byte, error) { return u.s.Identity(ctx) }
func (u unclaimed) Activate(ctx context.Context, challenge []byte) ([]byte, error) {
	return u.s.Activate(ctx, challenge)
}

// caPEM encodes the EK CA's certificate and key for the client process.
func caPEM(t *testing.T, ca *vtpmtest.CA) []byte {
	der, err := x509.MarshalECPrivateKey(ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return append(ca.PEM(), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})...)
}

func loadCA(t *testing.T, path string) *vtpmtest.CA {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	ca := &vtpmtest.CA{}
	for blk, rest := pem.Decode(b); blk != nil; blk, rest = pem.Decode(rest) {
		switch blk.Type {
		case "CERTIFICATE":
			ca.Cert, err = x509.ParseCertificate(blk.Bytes)
		case "EC PRIVATE KEY":
			ca.Key, err = x509.ParseECPrivateKey(blk.Bytes)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if ca.Cert == nil || ca.Key == nil {
		t.Fatalf("%s holds no CA certificate and key", path)
	}
	return ca
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

// scrapeMemory summarizes the joinservice's heap, goroutines and resident memory from its metrics.
func scrapeMemory(metricsAddr string) string {
	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		return "metrics unavailable: " + err.Error()
	}
	defer resp.Body.Close()
	want := map[string]float64{"go_memstats_heap_inuse_bytes": -1, "go_goroutines": -1, "process_resident_memory_bytes": -1}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, val, ok := strings.Cut(sc.Text(), " ")
		if _, tracked := want[name]; ok && tracked {
			want[name], _ = strconv.ParseFloat(val, 64)
		}
	}
	return fmt.Sprintf("heap in use %.1f MB, goroutines %.0f, RSS %.0f MB", want["go_memstats_heap_inuse_bytes"]/(1<<20),
		want["go_goroutines"], want["process_resident_memory_bytes"]/(1<<20))
}

// procCPU is the user+system CPU seconds of process pid.
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseFloat(fields[11], 64)
	st, _ := strconv.ParseFloat(fields[12], 64)
	return (ut + st) / 100 // USER_HZ
}

// sampleEvery calls f every interval until the returned stop runs.
func sampleEvery(interval time.Duration, f func(at time.Duration)) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		start := time.Now()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				f(time.Since(start))
			}
		}
	}()
	return func() { cancel(); <-done }
}
