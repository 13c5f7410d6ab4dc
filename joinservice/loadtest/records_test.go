package loadtest

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/cli"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
	"github.com/berth-k8s/berth/joinservice/registry"
)

// recordsChunk is how many machines the records harness admits between two measurements.
const recordsChunk = 500

// countingTransport counts the requests a client sends.
type countingTransport struct {
	next  http.RoundTripper
	n     *atomic.Int64
	bytes *atomic.Int64
}

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	if r.ContentLength > 0 {
		c.bytes.Add(r.ContentLength)
	}
	return c.next.RoundTrip(r)
}

// counted counts the requests (n) and the request bodies' bytes (sent) of cfg's clients.
func counted(cfg *rest.Config, n, sent *atomic.Int64) *rest.Config {
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = 1000, 2000 // the API server's cost is measured, not client-go's throttle
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return countingTransport{next: rt, n: n, bytes: sent} })
	return cfg
}

func heapMiB() float64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapAlloc) / (1 << 20)
}

// TestRecordsLoad admits BENCH_RECORDS_MACHINES distinct machines (default 10,000) through a real
// kube-apiserver, in chunks of recordsChunk, first into the record API (recordwriter: one Machine per
// machine), then into the machine record ConfigMap (registry, the record before the record API), and
// prints per chunk the admissions per second and the API requests per admission, the harness
// process's heap, and the latency of `berth status` with the machines recorded. It measures the
// records' write path, not attestation (make bench-join does). make bench-records runs it.
func TestRecordsLoad(t *testing.T) {
	if os.Getenv("BERTH_BENCH_RECORDS") != "1" {
		t.Skip("load harness: run with BERTH_BENCH_RECORDS=1 (make bench-records)")
	}
	n := 10000
	if v := os.Getenv("BENCH_RECORDS_MACHINES"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < recordsChunk {
			t.Fatalf("BENCH_RECORDS_MACHINES=%q: want a number of at least %d", v, recordsChunk)
		}
	}
	env := apiservertest.Start(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.AdminUser)
	if err != nil {
		t.Fatal(err)
	}
	status := func() time.Duration {
		start := time.Now()
		var out, errOut bytes.Buffer
		if code := cli.Execute(ctx, []string{"status", "--kubeconfig", kubeconfig, "--limit", "20"}, &out, &errOut); code != 0 {
			t.Fatalf("berth status: exit %d: %s", code, errOut.String())
		}
		return time.Since(start)
	}
	identity := func(prefix string, i int) string {
		return fmt.Sprintf("%s%0*x", prefix, 64-len(prefix), i)
	}
	evidence := recordwriter.NewEvidence(strings.Repeat("ab", 32), "tpm", map[uint32][]byte{
		4: bytes.Repeat([]byte{1}, 32), 9: bytes.Repeat([]byte{2}, 32), 11: bytes.Repeat([]byte{3}, 32), 15: bytes.Repeat([]byte{4}, 32)})

	// The record API.
	var requests, sent atomic.Int64
	cfg := counted(env.Config(apiservertest.JoinServiceUser), &requests, &sent)
	rc, err := clientset.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := recordwriter.New(rc, kc, joinconfig.Namespace, "bench", nil)
	heap0 := heapMiB()
	fmt.Printf("record API (Machines): %d machines in chunks of %d\n", n, recordsChunk)
	fmt.Printf("%10s %12s %14s %12s %12s\n", "machines", "joins/s", "requests/join", "bytes/join", "heap MiB")
	var first, last float64
	for done := 0; done < n; done += recordsChunk {
		before, sentBefore := requests.Load(), sent.Load()
		start := time.Now()
		for i := done; i < done+recordsChunk; i++ {
			w.Admit(recordwriter.Admission{Time: time.Now(), Identity: identity("", i), Node: fmt.Sprintf("w%d", i), Role: machines.RoleWorker,
				RPC: "join", Peer: "198.51.100.1", Evidence: evidence})
		}
		w.Flush(ctx, nil)
		rate := recordsChunk / time.Since(start).Seconds()
		if done == 0 {
			first = rate
		}
		last = rate
		fmt.Printf("%10d %12.0f %14.2f %12.0f %12.1f\n", done+recordsChunk, rate, float64(requests.Load()-before)/recordsChunk,
			float64(sent.Load()-sentBefore)/recordsChunk, heapMiB())
	}
	if d := w.Dropped(); d > 0 {
		t.Errorf("the writer dropped %d admissions", d)
	}
	fmt.Printf("record API: joins/s first chunk %.0f, last chunk %.0f (%.0f%%); heap growth %.1f MiB; berth status at %d machines: %v\n",
		first, last, 100*last/first, heapMiB()-heap0, n, status().Round(time.Millisecond))

	// The machine record ConfigMap, as main keeps it: the registry batches admissions into one
	// read-modify-write of the whole list.
	var cmRequests, cmSent atomic.Int64
	cmClient, err := kubernetes.NewForConfig(counted(env.Config(apiservertest.JoinServiceUser), &cmRequests, &cmSent))
	if err != nil {
		t.Fatal(err)
	}
	reg := registry.New(cmClient, joinconfig.Namespace, nil)
	rctx, cancel := context.WithCancel(ctx)
	regDone := make(chan error, 1)
	go func() { regDone <- reg.Run(rctx) }()
	defer func() {
		cancel()
		<-regDone
	}()
	fmt.Printf("machine record ConfigMap: %d machines in chunks of %d\n", n, recordsChunk)
	fmt.Printf("%10s %12s %14s %12s\n", "machines", "joins/s", "requests/join", "bytes/join")
	for done := 0; done < n; done += recordsChunk {
		before, sentBefore := cmRequests.Load(), cmSent.Load()
		start := time.Now()
		for i := done; i < done+recordsChunk; i++ {
			reg.Admit(machines.Machine{Identity: identity("c", i), Node: fmt.Sprintf("w%d", i), Role: machines.RoleWorker, Admitted: time.Now().UTC().Truncate(time.Second)})
		}
		lastID := identity("c", done+recordsChunk-1)
		// The registry's cache fills from its watch of the ConfigMap.
		recorded := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			_, ok, _ := reg.Lookup(lastID)
			return ok, nil
		}) == nil
		if !recorded {
			fmt.Printf("machine record ConfigMap: admissions stop being recorded between %d and %d machines (30 s without the chunk)\n", done, done+recordsChunk)
			break
		}
		fmt.Printf("%10d %12.0f %14.2f %12.0f\n", done+recordsChunk, recordsChunk/time.Since(start).Seconds(), float64(cmRequests.Load()-before)/recordsChunk,
			float64(cmSent.Load()-sentBefore)/recordsChunk)
	}
	fmt.Printf("machine record ConfigMap: berth status at %d machines: %v\n", len(reg.Machines()), status().Round(time.Millisecond))
}
