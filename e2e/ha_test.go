//go:build e2e

package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/mini"
)

// haCluster is TestMiniHA's cluster: three control planes and a worker.
type haCluster struct {
	*cluster
	client kubernetes.Interface
	// times are the measured durations, printed at the end, in order.
	times []haTime
}

type haTime struct {
	what string
	d    time.Duration
}

func (h *haCluster) took(what string, d time.Duration) {
	h.t.Logf("TIME %s: %.1fs", what, d.Seconds())
	h.times = append(h.times, haTime{what, d})
}

// TestMiniHA brings up three control planes and a worker, with a cluster configuration that sets an
// audit policy, and shows: (1) a 3-member etcd, all nodes Ready, the audit policy in force on every
// control plane's API server (an event in each one's audit log on its state disk); (2) the control planes, asking for tickets at the same moment, joined one after the other
// (the ledger shows one waited for the other) and at no time had etcd two members that were
// learners or not started; (3) with the first control plane powered off for good the API serves,
// the webhook admits and denies, a new worker joins through the remaining joinservices, and berth
// node remove leaves a healthy 2-member etcd; (4) a removed worker's machine is refused with
// REVOKED when it asks to rejoin and to join anew, and joins once re-admitted; (5) on the cluster
// without its init node, the certificates renew themselves (certsSteps). It prints the times.
func TestMiniHA(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	root := repoRoot(t)
	for _, b := range []string{"berth", "bootstrapper", "joinservice", "berth-webhook"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Fatalf("bin/%s missing: run make build first (make test-e2e does): %v", b, err)
		}
	}
	c := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "cluster"), berth: filepath.Join(root, "bin", "berth")}
	kbin := strings.TrimSpace(c.must(30*time.Minute, filepath.Join(root, "scripts", "build-k8s.sh"), "k8s"))
	c.kubectl = filepath.Join(kbin, "kubectl")
	h := &haCluster{cluster: c}
	testStart := time.Now()

	// The etcd sampler watches the members from the moment the first control plane has etcd until
	// the joins are checked.
	// cp1's address as mini up will give it.
	cp1 := mini.Config{Subnet: netip.MustParsePrefix(subnet), ControlPlanes: 1}.Nodes()[0]
	sampler := &etcdSampler{h: h, node: cp1.Name, ip: cp1.IP.String()}
	sctx, stopSampling := context.WithCancel(context.Background())
	var sampling sync.WaitGroup
	sampling.Add(1)
	go func() {
		defer sampling.Done()
		sampler.run(sctx)
	}()
	defer func() { stopSampling(); sampling.Wait() }()

	start := time.Now()
	// The cluster configuration sets an audit policy: kubeadm uploads the API server's flags naming
	// its file, so every control plane that joins must get the file in its ticket.
	clusterConfig := writeSharedClusterConfig(t)
	out, err := c.run(30*time.Minute, c.berth, "mini", "up", "--dir", c.dir, "--name", clusterName, "--subnet", subnet,
		"--control-planes", "3", "--workers", "1", "--config", clusterConfig)
	upTook := time.Since(start)
	t.Logf("berth mini up (%.1fs):\n%s", upTook.Seconds(), out)
	procs := recordedProcs(t, c.dir)
	defer func() {
		if t.Failed() {
			c.diagnose()
		}
		start := time.Now()
		out, err := c.run(5*time.Minute, c.berth, "mini", "down", "--dir", c.dir)
		t.Logf("berth mini down (%.1fs):\n%s", time.Since(start).Seconds(), out)
		if err != nil {
			t.Errorf("berth mini down: %v", err)
		}
		checkNoResidue(t, c.dir, append(procs, recordedProcs(t, c.dir)...))
	}()
	if err != nil {
		dumpLogs(t, c.dir)
		t.Fatalf("berth mini up: %v", err)
	}
	h.took("3 control planes + 1 worker up (berth mini up, warm)", upTook)
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(c.dir, "admin.conf"))
	if err != nil {
		t.Fatal(err)
	}
	h.client = kubernetes.NewForConfigOrDie(cfg)

	h.checkEtcd("cp1", []string{"cp1", "cp2", "cp3"})
	h.checkAuditOnEveryControlPlane([]string{"cp1", "cp2", "cp3"})
	h.checkSerializedJoins()
	stopSampling()
	sampling.Wait()
	sampler.check()
	h.checkWebhookSpread()

	h.failover()
	h.checkRevocation()
	afterInitNodeGone(t, h)

	var sb strings.Builder
	for _, x := range h.times {
		fmt.Fprintf(&sb, "\n  %-70s %7.1fs", x.what, x.d.Seconds())
	}
	t.Logf("TestMiniHA times (whole test so far %.0fs):%s", time.Since(testStart).Seconds(), sb.String())
}

// checkAuditOnEveryControlPlane: the cluster configuration's audit policy is in force on the API
// server of every control plane in nodes, the joined ones too (their tickets carried the policy
// file): a ConfigMap created through each API server directly has its audit event in that control
// plane's own audit log, on its state disk.
func (h *haCluster) checkAuditOnEveryControlPlane(nodes []string) {
	h.t.Helper()
	for _, n := range nodes {
		name := "audit-probe-" + n
		h.kube("--server", "https://"+nodeIP(h.t, h.dir, n)+":6443", "create", "configmap", name, "-n", "default", "--from-literal=k=v")
		line := checkAuditEvent(h.t, h.cluster, n, name)
		checkAuditLogOnStateDisk(h.t, h.cluster, n)
		h.t.Logf("AUDIT %s: %s", n, line)
	}
}

// afterInitNodeGone runs on the cluster whose init node (cp1) is powered off for good and removed:
// two control planes, the API served through the remaining ones. It checks that state (a healthy
// 2-member etcd, every remaining node Ready, the webhook deciding) and is where later checks on a
// cluster that lost its init node belong, before the cluster is torn down.
func afterInitNodeGone(t *failureLog, h *haCluster) {
	t.Helper()
	h.checkEtcd("cp2", []string{"cp2", "cp3"})
	h.kube("wait", "--for=condition=Ready", "node/cp2", "node/cp3", "node/w1", "node/w2", "--timeout=120s")
	h.webhookDecides(time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	start := time.Now()
	certsSteps(t, ctx, h.cluster, filepath.Join(filepath.Dir(h.kubectl), "kubeadm"), []string{"cp2", "cp3"}, []string{"w1", "w2"})
	h.took("certificates: kubelet serving CSRs, caBundle repair, webhook chain under load and control-plane renewals", time.Since(start))
}

// etcdClient returns a client of node's etcd member (at ip) with the API server's etcd client
// certificate, read from the node's state disk through its mount namespace.
func (h *haCluster) etcdClient(node, ip string) (*clientv3.Client, error) {
	read := func(p string) ([]byte, error) {
		out, err := h.run(30*time.Second, "nsenter", "--mount="+filepath.Join(h.dir, "ns", node+".mnt"), "--", "cat", filepath.Join("/etc/kubernetes/pki", p))
		if err != nil {
			return nil, fmt.Errorf("reading %s of %s: %w", p, node, err)
		}
		return []byte(out), nil
	}
	ca, err := read("etcd/ca.crt")
	if err != nil {
		return nil, err
	}
	crt, err := read("apiserver-etcd-client.crt")
	if err != nil {
		return nil, err
	}
	key, err := read("apiserver-etcd-client.key")
	if err != nil {
		return nil, err
	}
	pair, err := tls.X509KeyPair(crt, key)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	return clientv3.New(clientv3.Config{
		Endpoints: []string{"https://" + ip + ":2379"}, DialTimeout: 3 * time.Second,
		TLS:    &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: pool, MinVersion: tls.VersionTLS12},
		Logger: zap.NewNop(),
	})
}

// checkEtcd checks, through node's etcd member, that etcd has exactly the members want, all
// started voters whose endpoints answer (etcdctl member list and endpoint health).
func (h *haCluster) checkEtcd(node string, want []string) {
	h.t.Helper()
	cli, err := h.etcdClient(node, nodeIP(h.t, h.dir, node))
	if err != nil {
		h.t.Fatal(err)
	}
	defer cli.Close()
	var lines []string
	var names []string
	err = wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		lines, names = nil, nil
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		resp, err := cli.MemberList(lctx)
		if err != nil {
			lines = []string{err.Error()}
			return false, nil
		}
		healthy := true
		for _, m := range resp.Members {
			state := "voter"
			if m.IsLearner {
				state, healthy = "learner", false
			}
			health := "healthy"
			if len(m.ClientURLs) == 0 {
				health, healthy = "not started", false
			} else if _, err := cli.Status(lctx, m.ClientURLs[0]); err != nil {
				health, healthy = "unhealthy: "+err.Error(), false
			}
			names = append(names, m.Name)
			lines = append(lines, fmt.Sprintf("%x %s %s %v %s", m.ID, m.Name, state, m.PeerURLs, health))
		}
		sort.Strings(names)
		return healthy && strings.Join(names, " ") == strings.Join(want, " "), nil
	})
	h.t.Logf("etcd members (through %s):\n  %s", node, strings.Join(lines, "\n  "))
	if err != nil {
		h.t.Fatalf("etcd members %v, want %v, all started voters answering", names, want)
	}
}

// statusReport is the part of berth status -o json TestMiniHA reads.
type haStatus struct {
	Rejected        []haRecord `json:"rejected"`
	Accepted        []haRecord `json:"accepted"`
	Membership      []haRecord `json:"membership"`
	RemovedMachines []struct {
		Node     string `json:"node"`
		Identity string `json:"identity"`
		Etcd     string `json:"etcd"`
	} `json:"removedMachines"`
}

type haRecord struct {
	Time    time.Time `json:"time"`
	Peer    string    `json:"peer"`
	Node    string    `json:"node"`
	RPC     string    `json:"rpc"`
	Outcome string    `json:"outcome"`
	Reason  string    `json:"reason"`
	Message string    `json:"message"`
}

func (h *haCluster) status() haStatus {
	h.t.Helper()
	out := h.must(time.Minute, h.berth, "status", "--kubeconfig", filepath.Join(h.dir, "admin.conf"), "--limit", "0", "-o", "json")
	var s haStatus
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		h.t.Fatalf("berth status -o json: %v\n%s", err, out)
	}
	return s
}

// joinedEvent is a control-plane-join event of the ledger with when its ticket was issued.
type joinedEvent struct {
	Node         string    `json:"node"`
	Time         time.Time `json:"time"`
	TicketIssued time.Time `json:"ticketIssued"`
	Outcome      string    `json:"outcome"`
	Message      string    `json:"message"`
}

// checkSerializedJoins checks the ledger: both joining control planes have a control-plane-join
// event (the slot freed when each had joined), their slots [ticket, joined] do not overlap, and the
// one that came second waited for the first (a CONTROL_PLANE_JOIN_BUSY rejection or an accepted join
// that names the wait).
func (h *haCluster) checkSerializedJoins() {
	h.t.Helper()
	// The events carry ticketIssued, which berth status does not print: read the ledger itself. A
	// control plane's join ends when a joinservice sees its API server ready too, which may come after
	// its etcd member votes, and the ledger is written in batches: read it until both joins ended.
	var joins []joinedEvent
	waited := map[string]string{}
	err := wait.PollUntilContextTimeout(context.Background(), 2*time.Second, 2*time.Minute, true, func(context.Context) (bool, error) {
		raw := h.kube("-n", "berth-system", "get", "configmap", "berth-join-ledger", "-o", "jsonpath={.data.entries\\.json}")
		var entries []struct {
			joinedEvent
			RPC    string `json:"rpc"`
			Reason string `json:"reason"`
		}
		if err := json.Unmarshal([]byte(raw), &entries); err != nil {
			return false, fmt.Errorf("reading the ledger: %w", err)
		}
		joins, waited = nil, map[string]string{}
		for _, e := range entries {
			switch {
			case e.RPC == "control-plane-join":
				joins = append(joins, e.joinedEvent)
			case e.RPC == "join" && e.Reason == "CONTROL_PLANE_JOIN_BUSY", e.RPC == "join" && strings.Contains(e.Message, "for the control-plane slot"):
				waited[e.Node] = e.Message
			}
		}
		return len(joins) >= 2, nil
	})
	if err != nil && !wait.Interrupted(err) {
		h.t.Fatal(err)
	}
	sort.Slice(joins, func(i, j int) bool { return joins[i].TicketIssued.Before(joins[j].TicketIssued) })
	for _, j := range joins {
		h.t.Logf("ledger: %s joined (%s): ticket %s, slot freed %s: %s", j.Node, j.Outcome, j.TicketIssued.Format("15:04:05.000"), j.Time.Format("15:04:05.000"), j.Message)
		h.took("control plane "+j.Node+" join (ticket -> etcd member voting, API server ready)", j.Time.Sub(j.TicketIssued))
	}
	if len(joins) != 2 || joins[0].Outcome != "accepted" || joins[1].Outcome != "accepted" {
		h.t.Fatalf("control-plane-join events %+v, want cp2's and cp3's, accepted", joins)
	}
	first, second := joins[0], joins[1]
	if second.TicketIssued.Before(first.Time) {
		h.t.Fatalf("%s's ticket (%s) was issued before %s had joined (%s): the joins overlapped", second.Node, second.TicketIssued, first.Node, first.Time)
	}
	msg, ok := waited[second.Node]
	if !ok || !strings.Contains(msg, first.Node) {
		h.t.Fatalf("the ledger does not show that %s waited for %s (entries of %s: %q)", second.Node, first.Node, second.Node, msg)
	}
	h.t.Logf("ledger: %s waited for %s: %s", second.Node, first.Node, msg)
}

// etcdSampler samples etcd's members every samplePeriod while the control planes join.
type etcdSampler struct {
	h        *haCluster
	node, ip string

	mu        sync.Mutex
	samples   int
	learners  int // samples that saw a learner or an unstarted member
	max       int // the most learners and unstarted members one sample saw
	maxSample string
	history   []string // every change of the member list
}

const samplePeriod = 200 * time.Millisecond

func (s *etcdSampler) run(ctx context.Context) {
	var cli *clientv3.Client
	defer func() {
		if cli != nil {
			_ = cli.Close()
		}
	}()
	last := ""
	_ = wait.PollUntilContextCancel(ctx, samplePeriod, true, func(ctx context.Context) (bool, error) {
		if cli == nil {
			// The first control plane has no etcd until kubeadm init made its certificates.
			if _, err := os.Stat(filepath.Join(s.h.dir, "ns", s.node+".mnt")); err != nil {
				return false, nil
			}
			c, err := s.h.etcdClient(s.node, s.ip)
			if err != nil {
				return false, nil
			}
			cli = c
		}
		lctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		resp, err := cli.MemberList(lctx, clientv3.WithSerializable())
		if err != nil {
			return false, nil
		}
		notVoting := 0
		var parts []string
		for _, m := range resp.Members {
			name := m.Name
			if name == "" {
				name = "(unstarted)"
				notVoting++
			} else if m.IsLearner {
				name += "(learner)"
				notVoting++
			}
			parts = append(parts, name)
		}
		sort.Strings(parts)
		sample := strings.Join(parts, " ")
		s.mu.Lock()
		defer s.mu.Unlock()
		s.samples++
		if notVoting > 0 {
			s.learners++
		}
		if notVoting > s.max {
			s.max, s.maxSample = notVoting, sample
		}
		if sample != last {
			s.history = append(s.history, time.Now().Format("15:04:05.000")+" "+sample)
			last = sample
		}
		return false, nil
	})
}

// check fails when a sample saw two members that were learners or not started.
func (s *etcdSampler) check() {
	s.h.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.h.t.Logf("etcd sampled every %v through cp1: %d samples, %d with a learner or unstarted member, at most %d at once; member lists:\n  %s",
		samplePeriod, s.samples, s.learners, s.max, strings.Join(s.history, "\n  "))
	if s.samples == 0 {
		s.h.t.Fatal("the etcd sampler never read etcd's members")
	}
	if s.max > 1 {
		s.h.t.Fatalf("etcd had %d members that were learners or not started at once: %s", s.max, s.maxSample)
	}
}

// webhookPodNodes returns the nodes of the webhook's ready pods.
func (h *haCluster) webhookPodNodes(ctx context.Context) []string {
	list, err := h.client.CoreV1().Pods("berth-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=berth-webhook"})
	if err != nil {
		return nil
	}
	var nodes []string
	for _, p := range list.Items {
		ready := false
		for _, c := range p.Status.Conditions {
			ready = ready || c.Type == "Ready" && c.Status == "True"
		}
		if p.DeletionTimestamp == nil && ready {
			nodes = append(nodes, p.Spec.NodeName)
		}
	}
	sort.Strings(nodes)
	return nodes
}

// checkWebhookSpread waits until the webhook's two replicas run on different nodes: the scheduler
// placed them when only some nodes were Ready, the joinservice moves one if they share a node.
func (h *haCluster) checkWebhookSpread() {
	h.t.Helper()
	start := time.Now()
	var nodes []string
	err := wait.PollUntilContextTimeout(context.Background(), time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		nodes = h.webhookPodNodes(ctx)
		return len(nodes) == 2 && nodes[0] != nodes[1], nil
	})
	h.t.Logf("webhook replicas on %v (%.1fs after the cluster was up)", nodes, time.Since(start).Seconds())
	if err != nil {
		h.t.Fatalf("the webhook's replicas never ran on two nodes: %v", nodes)
	}
}

// webhookDecides waits until the webhook denies a disallowed image and admits an allowed one five
// times in a row, and returns how long that took.
func (h *haCluster) webhookDecides(timeout time.Duration) time.Duration {
	h.t.Helper()
	start := time.Now()
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	inRow, last := 0, ""
	err := wait.PollUntilContextTimeout(context.Background(), 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		_, denied := h.client.CoreV1().Pods("default").Create(ctx, whPod("default", "ha-denied", whDenied), dry)
		_, allowed := h.client.CoreV1().Pods("default").Create(ctx, whPod("default", "ha-allowed", whAllowed), dry)
		if denied != nil && strings.Contains(denied.Error(), whMarker) && allowed == nil {
			inRow++
		} else {
			inRow, last = 0, fmt.Sprintf("denied: %v; allowed: %v", denied, allowed)
		}
		return inRow >= 5, nil
	})
	if err != nil {
		h.t.Fatalf("the webhook did not decide within %v (last: %s)", timeout, last)
	}
	return time.Since(start)
}

// failover powers cp1 off for good and checks the cluster without it.
func (h *haCluster) failover() {
	h.t.Helper()
	h.webhookDecides(time.Minute)
	start := time.Now()
	out := h.must(time.Minute, h.berth, "mini", "stop", "--dir", h.dir, "cp1")
	h.t.Logf("berth mini stop cp1:\n%s", out)
	stopped := time.Now()

	// The API through the control-plane endpoint.
	if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := h.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil, nil
	}); err != nil {
		h.t.Fatal("the API never served after cp1 was powered off")
	}
	h.took("failover: cp1 powered off -> API ready through the endpoint", time.Since(stopped))
	h.took("failover: cp1 powered off -> webhook admits and denies (5 in a row)", time.Since(stopped)+h.webhookDecides(3*time.Minute))

	// A new worker joins through the remaining joinservices.
	t0 := time.Now()
	out = h.must(10*time.Minute, h.berth, "mini", "add", "--dir", h.dir, "--workers", "1")
	h.t.Logf("berth mini add --workers 1 without cp1:\n%s", out)
	h.took("failover: a new worker (w2) joins and is Ready without cp1", time.Since(t0))
	if s := h.status(); !hasRecord(s.Accepted, "w2", "join", "") {
		h.t.Fatalf("the ledger has no accepted join of w2: %+v", s.Accepted)
	}

	// The dead control plane is removed: its etcd member goes, its machine is revoked.
	t0 = time.Now()
	out = h.must(5*time.Minute, h.berth, "node", "remove", "cp1", "--kubeconfig", filepath.Join(h.dir, "admin.conf"))
	h.t.Logf("berth node remove cp1:\n%s", out)
	h.took("removal: berth node remove cp1 (dead control plane, etcd member removed)", time.Since(t0))
	h.checkEtcd("cp2", []string{"cp2", "cp3"})
	h.took("failover total: cp1 powered off -> new worker joined, cp1 removed, 2-member etcd healthy", time.Since(start))
}

func hasRecord(rs []haRecord, node, rpc, reason string) bool {
	for _, r := range rs {
		if r.Node == node && r.RPC == rpc && r.Reason == reason {
			return true
		}
	}
	return false
}

// waitRecord waits until berth status shows a rejection of node's rpc with reason.
func (h *haCluster) waitRecord(node, rpc, reason string, timeout time.Duration) haRecord {
	h.t.Helper()
	var found haRecord
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, timeout, true, func(context.Context) (bool, error) {
		for _, r := range h.status().Rejected {
			if r.Node == node && r.RPC == rpc && r.Reason == reason {
				found = r
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		h.t.Fatalf("berth status never showed %s's %s refused with %s", node, rpc, reason)
	}
	return found
}

// checkRevocation removes w1, then its machine asks to rejoin (TPM cleared: its sealed disk key is
// gone) and to join anew (reinstalled: a blank state disk); both are refused with REVOKED. After
// berth node readmit it joins.
func (h *haCluster) checkRevocation() {
	h.t.Helper()
	kubeconfig := filepath.Join(h.dir, "admin.conf")
	t0 := time.Now()
	out := h.must(5*time.Minute, h.berth, "node", "remove", "w1", "--drain", "--kubeconfig", kubeconfig)
	h.t.Logf("berth node remove w1 --drain:\n%s", out)
	h.took("removal: berth node remove w1 --drain (worker)", time.Since(t0))
	s := h.status()
	if !hasRecord(s.Membership, "w1", "remove", "") || len(s.RemovedMachines) != 2 {
		h.t.Fatalf("berth status after removing w1: membership %+v, removed machines %+v", s.Membership, s.RemovedMachines)
	}

	out = h.must(5*time.Minute, h.berth, "mini", "restart", "--dir", h.dir, "w1", "--clear-tpm", "w1", "--no-wait")
	h.t.Logf("w1 restarted with its TPM cleared:\n%s", out)
	r := h.waitRecord("w1", "rejoin", "REVOKED", 2*time.Minute)
	h.t.Logf("w1's rejoin refused: %s", r.Message)

	out = h.must(5*time.Minute, h.berth, "mini", "restart", "--dir", h.dir, "w1", "--wipe-disk", "w1", "--no-wait")
	h.t.Logf("w1 reinstalled:\n%s", out)
	r = h.waitRecord("w1", "join", "REVOKED", 2*time.Minute)
	h.t.Logf("w1's join refused: %s", r.Message)
	if _, err := h.client.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{}); err == nil {
		h.t.Fatal("the removed w1 is a node of the cluster again")
	}

	t0 = time.Now()
	out = h.must(time.Minute, h.berth, "node", "readmit", "w1", "--kubeconfig", kubeconfig)
	h.t.Logf("berth node readmit w1:\n%s", out)
	h.kube("wait", "--for=create", "node/w1", "--timeout=120s")
	h.kube("wait", "--for=condition=Ready", "node/w1", "--timeout=120s")
	h.took("re-admission: berth node readmit w1 -> w1 joined and Ready", time.Since(t0))
	s = h.status()
	joinedAgain := false
	for _, r := range s.Accepted {
		joinedAgain = joinedAgain || r.Node == "w1" && r.RPC == "join" && r.Time.After(t0.Add(-time.Second))
	}
	if !hasRecord(s.Membership, "w1", "readmit", "") || !joinedAgain {
		h.t.Fatalf("berth status after the re-admission: membership %+v, accepted %+v", s.Membership, s.Accepted)
	}
}
