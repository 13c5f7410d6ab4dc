//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/mini"
	"github.com/berth-k8s/berth/internal/prereq"
)

const (
	clusterName = "e2e"
	// subnet is disjoint from berth mini's default and from internal/mini's integration test, so
	// the e2e can run next to either.
	subnet = "203.0.113.128/26"
)

// repoRoot is the repository root (the e2e package lives one level below it).
func repoRoot(t testing.TB) string {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Dir(wd)
}

type cluster struct {
	t       testing.TB
	root    string
	dir     string
	berth   string
	kubectl string
}

func (c *cluster) run(timeout time.Duration, name string, args ...string) (string, error) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = c.root
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

func (c *cluster) must(timeout time.Duration, name string, args ...string) string {
	c.t.Helper()
	out, err := c.run(timeout, name, args...)
	if err != nil {
		c.t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

func (c *cluster) kube(args ...string) string {
	c.t.Helper()
	return c.must(2*time.Minute, c.kubectl, append([]string{"--kubeconfig", filepath.Join(c.dir, "admin.conf")}, args...)...)
}

// diagnose logs what explains a failure before the cluster goes: the nodes with their pod ranges,
// every pod with its node and address, the newest events, the end of every daemon's log, and each
// node's routes.
func (c *cluster) diagnose() {
	c.t.Helper()
	kc := filepath.Join(c.dir, "admin.conf")
	for _, args := range [][]string{
		{"get", "nodes", "-o", "custom-columns=NAME:.metadata.name,READY:.status.conditions[?(@.type==\"Ready\")].status,PODCIDR:.spec.podCIDR,IP:.status.addresses[0].address"},
		{"get", "pods", "-A", "-o", "wide"},
		{"get", "events", "-A", "--sort-by=.lastTimestamp"},
	} {
		out, err := c.run(time.Minute, c.kubectl, append([]string{"--kubeconfig", kc}, args...)...)
		if lines := strings.Split(out, "\n"); len(lines) > 60 {
			out = strings.Join(lines[len(lines)-60:], "\n")
		}
		c.t.Logf("diagnosis: kubectl %s (%v):\n%s", strings.Join(args, " "), err, out)
	}
	dumpLogs(c.t, c.dir)
	entries, _ := os.ReadDir("/run/netns")
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "berth-"+clusterName+"-") {
			out, err := c.run(time.Minute, "ip", "-n", e.Name(), "route")
			c.t.Logf("diagnosis: routes of %s (%v):\n%s", e.Name(), err, out)
		}
	}
}

// kubeEventually runs kubectl until its output contains want or timeout passes; it returns the last
// output and whether want appeared.
func (c *cluster) kubeEventually(timeout time.Duration, want string, args ...string) (string, bool) {
	c.t.Helper()
	var out string
	var err error
	if wait.PollUntilContextTimeout(context.Background(), time.Second, timeout, true, func(context.Context) (bool, error) {
		out, err = c.run(time.Minute, c.kubectl, append([]string{"--kubeconfig", filepath.Join(c.dir, "admin.conf")}, args...)...)
		return err == nil && strings.Contains(out, want), nil
	}) != nil {
		return fmt.Sprintf("%s (%v)", out, err), false
	}
	return out, true
}

// TestMiniCluster brings up 1 control plane and 2 workers with berth mini up --config (berth init on
// the first node with an operator's cluster configuration, checkClusterConfigInForce; the workers
// join through the joinservice by themselves), runs a pod on every node,
// gets a fresh admin kubeconfig with the master secret after a short one expired
// (checkKubeconfigWithMasterSecret), checks logs, exec, Service DNS and pod-to-pod traffic across nodes, removes w2 and checks that its
// restart does not bring it back (checkRevocationHolds), boots w2 while no joinservice answers it
// and checks that it checks in later, REVOKED then locking it (checkCheckInAfterBootWithoutAnswer),
// power-cycles all nodes, rolls w2 onto a new image under a widened policy and checks that berth
// policy diff names exactly w2 for a policy that retires that image (checkPolicyDiffNamesOne), and
// checks that berth mini down leaves nothing behind.
func TestMiniCluster(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root")
	}
	root := repoRoot(t)
	c := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "cluster"), berth: filepath.Join(root, "bin", "berth")}
	for _, b := range []string{"berth", "bootstrapper", "joinservice"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Fatalf("bin/%s missing: run make build first (make test-e2e does): %v", b, err)
		}
	}
	kbin := strings.TrimSpace(c.must(30*time.Minute, filepath.Join(root, "scripts", "build-k8s.sh"), "k8s"))
	c.kubectl = filepath.Join(kbin, "kubectl")

	start := time.Now()
	clusterConfig := writeSharedClusterConfig(t)
	out, err := c.run(30*time.Minute, c.berth, "mini", "up", "--dir", c.dir, "--name", clusterName, "--subnet", subnet,
		"--control-planes", "1", "--workers", "2", "--config", clusterConfig)
	t.Logf("berth mini up (%.1fs):\n%s", time.Since(start).Seconds(), out)
	var procs []mini.Proc
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
		checkNoResidue(t, c.dir, procs)
		// down is idempotent.
		if out, err := c.run(time.Minute, c.berth, "mini", "down", "--dir", c.dir); err != nil {
			t.Errorf("second berth mini down: %v\n%s", err, out)
		}
	}()
	procs = recordedProcs(t, c.dir)
	if err != nil {
		dumpLogs(t, c.dir)
		t.Fatalf("berth mini up: %v", err)
	}

	nodes := strings.Fields(c.kube("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"))
	if strings.Join(nodes, " ") != "cp1 w1 w2" {
		t.Fatalf("nodes = %v, want cp1 w1 w2", nodes)
	}
	// The default cluster runs the default release, on the API server and every kubelet.
	checkServerVersion(t, c, k8sversion.Default().Kubernetes)
	// w1 and w2 started before berth init, with the image's join policy (no attestation-key CA): the
	// joinservice's TPM activated its key for each of them. berth init wrote the cluster's join
	// policy, which nodes added later get (checkDayTwo: w3 joins without TPM work on the joinservice).
	if _, a := tpmWork(t, nodeIP(t, c.dir, "cp1")); a < 2 {
		t.Errorf("the joinservice activated its key %v times for w1 and w2, want at least 2", a)
	}
	if b, err := os.ReadFile(filepath.Join(c.dir, "join-policy.yaml")); err != nil || !strings.Contains(string(b), "akRoots:") {
		t.Errorf("berth init wrote no cluster join policy with the attestation-key CA: %v\n%s", err, b)
	}
	checkInClusterConventions(t, c)
	checkRecordAPI(t, c)
	checkSupportBundle(t, c)
	// The operator's way back in after the admin credential expired: berth kubeconfig with the
	// master secret.
	start = time.Now()
	checkKubeconfigWithMasterSecret(t, c)
	t.Logf("berth kubeconfig checks took %.1fs", time.Since(start).Seconds())
	start = time.Now()
	checkClusterConfigInForce(t, c)
	t.Logf("cluster configuration checks took %.1fs", time.Since(start).Seconds())

	applyTestApp(t, c)
	c.kube("rollout", "status", "daemonset/testapp", "--timeout=120s")
	pods := podsByNode(t, c)
	for _, n := range nodes {
		if pods[n].name == "" {
			t.Fatalf("no testapp pod on %s (pods: %v)", n, pods)
		}
	}
	// Logs and exec work through the API server to each kubelet.
	for _, n := range nodes {
		if logs := c.kube("logs", pods[n].name); !strings.Contains(logs, "testapp serving on :8080") {
			t.Errorf("logs of %s on %s = %q", pods[n].name, n, logs)
		}
	}
	if got := c.kube("exec", pods["w1"].name, "--", "/testapp", "echo", "exec works"); strings.TrimSpace(got) != "exec works" {
		t.Errorf("exec = %q", got)
	}
	// A Secret passed to a pod is readable on the node and in no host-side backing file.
	start = time.Now()
	checkPodSecretAtRest(t, c, "w1")
	t.Logf("pod Secret checks took %.1fs", time.Since(start).Seconds())
	// Pod to pod across nodes, and a Service by DNS name (CoreDNS + kube-proxy nftables). The data
	// path converges after the pods run (endpoints, kube-proxy's rules, CoreDNS), so each check may
	// take up to a minute to pass; a path that never works fails.
	if got, ok := c.kubeEventually(time.Minute, pods["w2"].name, "exec", pods["w1"].name, "--", "/testapp", "get", "http://"+pods["w2"].ip+":8080/"); !ok {
		t.Errorf("w1 -> w2 pod = %q", got)
	}
	if got, ok := c.kubeEventually(time.Minute, "testapp on ", "exec", pods["w2"].name, "--", "/testapp", "get", "http://testapp.default.svc.cluster.local/"); !ok {
		t.Errorf("service by DNS = %q", got)
	}
	// The control plane's host network reaches pods on every node: the API server's pod proxy dials
	// from the node address, the path it also takes to call webhooks.
	for _, n := range nodes {
		if got, ok := c.kubeEventually(time.Minute, pods[n].name, "get", "--raw", "/api/v1/namespaces/default/pods/"+pods[n].name+":8080/proxy/"); !ok {
			t.Errorf("API server -> pod on %s = %q", n, got)
		}
	}
	// Prometheus in the cluster reaches every Berth metrics target (deploy/monitoring).
	checkMetricsReachableFromPods(t, c, pods["w1"].name)

	// A removed worker that keeps its TPM, state disk and kubelet certificate stays out.
	start = time.Now()
	checkRevocationHolds(t, c)
	t.Logf("revocation checks took %.1fs", time.Since(start).Seconds())
	// A worker that booted while no joinservice answered checks in once one does; REVOKED then locks it.
	start = time.Now()
	checkCheckInAfterBootWithoutAnswer(t, c)
	t.Logf("check-in after a boot without an answer took %.1fs", time.Since(start).Seconds())

	// Secrets at rest, through cp1's KMS plugin: etcd holds them encrypted (and its files no master
	// secret), the API server's health follows the plugin's, and the key rotates under load.
	start = time.Now()
	checkSecretsAtRest(t, c, 1)
	checkPluginStopAndHeal(t, c)
	checkRotationUnderLoad(t, c)
	t.Logf("KMS checks took %.1fs", time.Since(start).Seconds())

	// Power cut of all nodes; the cluster comes back by itself.
	start = time.Now()
	out = c.must(15*time.Minute, c.berth, "mini", "restart", "--dir", c.dir)
	t.Logf("berth mini restart (%.1fs):\n%s", time.Since(start).Seconds(), out)
	procs = append(procs, recordedProcs(t, c.dir)...)
	c.kube("rollout", "status", "daemonset/testapp", "--timeout=180s")
	var got string
	var runErr error
	if err := wait.PollUntilContextTimeout(context.Background(), 2*time.Second, 3*time.Minute, true, func(context.Context) (bool, error) {
		got, runErr = c.run(time.Minute, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "exec", "daemonset/testapp", "--",
			"/testapp", "get", "http://testapp.default.svc.cluster.local/")
		return runErr == nil && strings.Contains(got, "testapp on "), nil
	}); err != nil {
		t.Fatalf("service after restart: %v %q", runErr, got)
	}
	checkSecretsAfterRestart(t, c, 2)
	checkDayTwo(t, c, out)
	checkPolicyDiffNamesOne(t, c)
}

type pod struct{ name, ip string }

func podsByNode(t testing.TB, c *cluster) map[string]pod {
	t.Helper()
	var list struct {
		Items []struct {
			Metadata struct{ Name string } `json:"metadata"`
			Spec     struct {
				NodeName string `json:"nodeName"`
			} `json:"spec"`
			Status struct {
				PodIP string `json:"podIP"`
				Phase string `json:"phase"`
			} `json:"status"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(c.kube("get", "pods", "-l", "app=testapp", "-o", "json")), &list); err != nil {
		t.Fatal(err)
	}
	out := map[string]pod{}
	for _, p := range list.Items {
		if p.Status.Phase == "Running" {
			out[p.Spec.NodeName] = pod{name: p.Metadata.Name, ip: p.Status.PodIP}
		}
	}
	return out
}

func applyTestApp(t testing.TB, c *cluster) {
	t.Helper()
	manifest := `apiVersion: apps/v1
kind: DaemonSet
metadata: {name: testapp, namespace: default}
spec:
  selector: {matchLabels: {app: testapp}}
  template:
    metadata: {labels: {app: testapp}}
    spec:
      tolerations: [{operator: Exists}]
      containers:
      - name: testapp
        image: berth.local/testapp:v1
        imagePullPolicy: Never
        args: [serve]
        ports: [{containerPort: 8080}]
        readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 2}
---
apiVersion: v1
kind: Service
metadata: {name: testapp, namespace: default}
spec:
  selector: {app: testapp}
  ports: [{port: 80, targetPort: 8080}]
`
	f := filepath.Join(t.TempDir(), "testapp.yaml")
	if err := os.WriteFile(f, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	c.kube("apply", "-f", f)
}

// recordedProcs returns every daemon the cluster's state file records, with its start time: a PID
// this host reused for another process (pid_max is 32768 here) is not the daemon.
func recordedProcs(t testing.TB, dir string) []mini.Proc {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		return nil
	}
	var st struct {
		Agent *mini.Proc             `json:"agent"`
		Procs map[string][]mini.Proc `json:"procs"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	var procs []mini.Proc
	if st.Agent != nil {
		procs = append(procs, *st.Agent)
	}
	for _, ps := range st.Procs {
		procs = append(procs, ps...)
	}
	return procs
}

func dumpLogs(t testing.TB, dir string) {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "nodes", "*", "logs", "*.log"))
	files = append(files, filepath.Join(dir, "agent.log"), filepath.Join(dir, "init.log"))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		if len(b) > 4000 {
			b = b[len(b)-4000:]
		}
		t.Logf("--- %s\n%s", f, b)
	}
}

// checkNoResidue fails for anything of the cluster left on the host: processes, network
// namespaces, links, mounts, cgroups, files.
func checkNoResidue(t testing.TB, dir string, procs []mini.Proc) {
	t.Helper()
	for _, p := range procs {
		if (mini.Exec{}).Alive(p) {
			t.Errorf("process %d (%s, started at tick %d) still runs", p.PID, p.Name, p.StartTime)
		}
	}
	// Nothing that names the cluster (its directory, or the kubelet's cgroup root) still runs,
	// whether recorded or not (a zombie is dead: this host's PID 1 does not reap orphans).
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range cmdlines {
		cmdline, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		cl := strings.ReplaceAll(string(cmdline), "\x00", " ")
		if !strings.Contains(cl, dir) && !strings.Contains(cl, "/berth/"+clusterName+"/") {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join(filepath.Dir(p), "stat")); err == nil && !strings.Contains(string(stat), ") Z ") {
			t.Errorf("process %s still runs: %s", filepath.Base(filepath.Dir(p)), cl)
		}
	}
	if entries, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), "berth-"+clusterName+"-") {
				t.Errorf("network namespace %s left behind", e.Name())
			}
		}
	}
	if _, err := os.Stat("/sys/class/net/" + clusterName + "-host"); err == nil {
		t.Errorf("link %s-host left behind", clusterName)
	}
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(mi), dir) {
		t.Errorf("mounts under %s left behind", dir)
	}
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, l := range loops {
		if b, err := os.ReadFile(l); err == nil && strings.HasPrefix(string(b), dir) {
			t.Errorf("loop device %s still backs %s", filepath.Base(filepath.Dir(filepath.Dir(l))), strings.TrimSpace(string(b)))
		}
	}
	hs, _ := filepath.Glob("/sys/fs/cgroup/*/berth/" + clusterName)
	for _, h := range hs {
		t.Errorf("cgroup %s left behind", h)
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("cluster directory %s left behind", dir)
	}
	if _, err := os.Stat("/run/berth-mini/" + clusterName); err == nil {
		t.Errorf("registry entry left behind")
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// joinserviceMetrics reads the samples of the joinservice's metrics on node ip (port 9003), by name
// and labels as the exposition format writes them.
func joinserviceMetrics(t testing.TB, ip string) map[string]float64 {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second}
	var body []byte
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(ip, "9003")+"/metrics", nil)
		resp, err := client.Do(req)
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		body, err = io.ReadAll(resp.Body)
		return err == nil && resp.StatusCode == http.StatusOK, nil
	}); err != nil {
		t.Fatalf("reading the joinservice's metrics on %s: %v", ip, err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		i := strings.LastIndexByte(line, ' ')
		if line == "" || line[0] == '#' || i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

// tpmWork returns how many quotes and activations the joinservice on node ip made for single
// connections (nodes that could not take its session proof) since it started.
func tpmWork(t testing.TB, ip string) (quotes, activations float64) {
	t.Helper()
	m := joinserviceMetrics(t, ip)
	return m[`berth_joinservice_attestation_operations_total{operation="quote",purpose="connection"}`],
		m[`berth_joinservice_attestation_operations_total{operation="activation",purpose="connection"}`]
}

// TestMiniAttestedInit brings up one control plane with TPM attestation and initializes it the way
// an operator does: berth init checks the node's quote (EK certificate from the cluster's mini CA,
// simulated boot in PCR 4) against the policy before it sends any secret. First with a wrong init
// secret over the same attested connection: the node answers with the one generic rejection, writes
// nothing and stays initializable; then with the right one, during which the node's bootstrapper is
// killed with SIGKILL in the middle of kubeadm init and restarted; the same berth init command then
// resumes and the cluster comes up, with no process of the dead daemon left.
func TestMiniAttestedInit(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root")
	}
	root := repoRoot(t)
	c := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "cluster"), berth: filepath.Join(root, "bin", "berth")}
	start := time.Now()
	out, err := c.run(30*time.Minute, c.berth, "mini", "up", "--dir", c.dir, "--name", clusterName, "--subnet", subnet,
		"--control-planes", "1", "--workers", "0", "--attestation", "tpm", "--no-init")
	t.Logf("berth mini up --attestation tpm --no-init (%.1fs):\n%s", time.Since(start).Seconds(), out)
	procs := recordedProcs(t, c.dir)
	defer func() {
		out, err := c.run(5*time.Minute, c.berth, "mini", "down", "--dir", c.dir)
		if err != nil {
			t.Errorf("berth mini down: %v\n%s", err, out)
		}
		checkNoResidue(t, c.dir, procs)
	}()
	if err != nil {
		dumpLogs(t, c.dir)
		t.Fatalf("berth mini up: %v", err)
	}
	cfgPath := filepath.Join(c.dir, "init.yaml")
	good, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(good), "attestationPolicyFile:") {
		t.Fatalf("init.yaml has no attestation policy:\n%s", good)
	}
	initArgs := []string{"init", "--endpoint", nodeIP(t, c.dir, "cp1") + ":9000", "--connect-timeout", "2m"}

	// A wrong init secret, over an attested connection (the node passed attestation): the node says
	// only that it rejected the request, and nothing is written.
	ws := t.TempDir()
	wrongSecret := filepath.Join(ws, "wrong-init-secret")
	if err := os.WriteFile(wrongSecret, []byte("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := regexp.MustCompile(`(?m)^initSecretFile: .*$`).ReplaceAllString(string(good), "initSecretFile: "+wrongSecret)
	if bad == string(good) {
		t.Fatalf("init.yaml has no initSecretFile line:\n%s", good)
	}
	badPath := filepath.Join(ws, "init.yaml")
	if err := os.WriteFile(badPath, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err = c.run(3*time.Minute, c.berth, append(initArgs, "--config", badPath, "--workspace", ws)...)
	t.Logf("berth init with a wrong init secret (%v):\n%s", err, out)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Errorf("berth init with a wrong init secret: want exit 3 (rejected), got %v", err)
	}
	if !strings.Contains(out, "Node attested (tpm)") {
		t.Errorf("the wrong-secret init did not get past attestation, so it does not test the init secret")
	}
	if !strings.Contains(out, "the node rejected the init request: wrong init secret, or not the node you meant") {
		t.Errorf("the wrong-secret init does not end with the generic rejection")
	}
	if _, serr := os.Stat(filepath.Join(ws, "admin.conf")); serr == nil {
		t.Errorf("berth init with a wrong secret wrote an admin.conf")
	}

	// The right secret, but the node's daemon crashes in the middle of kubeadm init: kubeadm and the
	// kubelet die with it, the restarted daemon leaves no process of the dead one behind, and the
	// same berth init command resumes on the node whose lock register now holds the cluster ID.
	initCmd := append(initArgs, "--config", cfgPath, "--workspace", c.dir)
	crashInit(t, c, initCmd)

	start = time.Now()
	out, err = c.run(10*time.Minute, c.berth, initCmd...)
	t.Logf("berth init, the same command after the crash (%.1fs):\n%s", time.Since(start).Seconds(), out)
	if err != nil {
		initLog, rerr := os.ReadFile(filepath.Join(c.dir, "init.log"))
		t.Logf("the node's init output (%v):\n%s", rerr, initLog)
		dumpLogs(t, c.dir)
		t.Fatalf("berth init after the crash: %v", err)
	}
	if !strings.Contains(out, "Node attested (tpm)") {
		t.Errorf("init output does not show a TPM-attested init")
	}
	if !strings.Contains(out, "Resuming the unfinished init in "+c.dir) || !strings.Contains(out, "kubeadm-init      started") {
		t.Errorf("init did not resume the crashed attempt at kubeadm-init")
	}
	c.kubectl = filepath.Join(strings.TrimSpace(c.must(30*time.Minute, filepath.Join(root, "scripts", "build-k8s.sh"), "k8s")), "kubectl")
	c.kube("wait", "--for=condition=Ready", "node/cp1", "--timeout=180s")
}

// crashInit runs berth init with args and kills the node's bootstrapper with SIGKILL once kubeadm
// init and the kubelet run under it; it checks that both die with the daemon, restarts the daemon
// (berth mini restart --bootstrapper-only) and waits until no process of the dead daemon's session
// runs any more (what Pdeathsig misses, the restarted daemon kills from its child record).
func crashInit(t testing.TB, c *cluster, args []string) {
	t.Helper()
	daemon := bootstrapperPID(t, c.dir, "cp1")
	pr, pw := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.berth, args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = c.root, pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { err := cmd.Wait(); _ = pw.Close(); exited <- err }()
	var output bytes.Buffer
	kubeadmStarted := make(chan struct{})
	scanned := make(chan struct{})
	go func() {
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		seen := false
		for sc.Scan() {
			output.WriteString(sc.Text() + "\n")
			if !seen && strings.Contains(sc.Text(), "kubeadm-init") && strings.Contains(sc.Text(), "started") {
				seen = true
				close(kubeadmStarted)
			}
		}
	}()
	select {
	case <-kubeadmStarted:
	case err := <-exited:
		<-scanned
		t.Fatalf("berth init ended before kubeadm init started (%v):\n%s", err, output.String())
	}
	// kubeadm init and the kubelet, both children of the daemon.
	var kubeadm, kubelet int
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 3*time.Minute, true, func(context.Context) (bool, error) {
		for _, p := range childrenOf(daemon) {
			switch {
			case strings.Contains(p.cmdline, "kubeadm") && strings.Contains(p.cmdline, " init "):
				kubeadm = p.pid
			case strings.Contains(p.cmdline, "kubelet"):
				kubelet = p.pid
			}
		}
		return kubeadm > 0 && kubelet > 0, nil
	}); err != nil {
		t.Fatalf("kubeadm init (%d) and the kubelet (%d) never ran together under the bootstrapper (%d)", kubeadm, kubelet, daemon)
	}
	session := sessionOf(t, daemon)
	t.Logf("killing the bootstrapper (pid %d) with SIGKILL while kubeadm init (pid %d) and the kubelet (pid %d) run", daemon, kubeadm, kubelet)
	if err := syscall.Kill(daemon, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := <-exited
	<-scanned
	t.Logf("berth init interrupted by the crash (%v):\n%s", err, output.String())
	if err == nil || !strings.Contains(output.String(), "run the same command again to resume") {
		t.Errorf("the interrupted berth init does not tell the operator to resume")
	}
	for name, pid := range map[string]int{"kubeadm init": kubeadm, "the kubelet": kubelet} {
		if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			return processDead(pid), nil
		}); err != nil {
			t.Errorf("%s (pid %d) outlived the killed bootstrapper", name, pid)
		}
	}
	out := c.must(2*time.Minute, c.berth, "mini", "restart", "cp1", "--bootstrapper-only", "--no-wait", "--dir", c.dir)
	t.Logf("berth mini restart cp1 --bootstrapper-only:\n%s", out)
	var left []proc
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		left = inSession(session)
		return len(left) == 0, nil
	}); err != nil {
		t.Errorf("processes of the killed bootstrapper's session still run after the restart: %+v", left)
	}
}

// proc is a running process.
type proc struct {
	pid     int
	cmdline string
}

// procStat reads state, ppid and session of pid from /proc/PID/stat.
func procStat(pid int) (state string, ppid, session int, ok bool) {
	b, err := os.ReadFile(filepath.Join("/proc", itoa(pid), "stat"))
	if err != nil {
		return "", 0, 0, false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 4 {
		return "", 0, 0, false
	}
	ppid, _ = strconv.Atoi(f[1])
	session, _ = strconv.Atoi(f[3])
	return f[0], ppid, session, true
}

// processDead says whether pid is gone or a zombie (this host's PID 1 does not reap orphans).
func processDead(pid int) bool {
	state, _, _, ok := procStat(pid)
	return !ok || state == "Z" || state == "X"
}

// livingProcesses lists every process that is not a zombie, with a test on its stat.
func livingProcesses(keep func(ppid, session int) bool) []proc {
	var out []proc
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		state, ppid, session, ok := procStat(pid)
		if !ok || state == "Z" || state == "X" || !keep(ppid, session) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		out = append(out, proc{pid: pid, cmdline: strings.ReplaceAll(string(cmdline), "\x00", " ")})
	}
	return out
}

func childrenOf(parent int) []proc {
	return livingProcesses(func(ppid, _ int) bool { return ppid == parent })
}

func inSession(session int) []proc {
	return livingProcesses(func(_, s int) bool { return s == session })
}

func sessionOf(t testing.TB, pid int) int {
	t.Helper()
	_, _, session, ok := procStat(pid)
	if !ok {
		t.Fatalf("process %d is gone", pid)
	}
	return session
}

// bootstrapperPID is the PID of node's bootstrapper as the cluster's state file records it.
func bootstrapperPID(t testing.TB, dir, node string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st mini.State
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	for _, p := range st.Procs[node] {
		if p.Name == "bootstrapper" {
			return p.PID
		}
	}
	t.Fatalf("no bootstrapper of %s in the state file", node)
	return 0
}

// TestMiniTamperedWorkerRejected brings up an attested cluster with one genuine and one tampered
// worker: the genuine one joins, the tampered one (different boot measurement in PCR 4) must be
// rejected by the joinservice, and up must say so, with the reason the joinservice gave.
func TestMiniTamperedWorkerRejected(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root")
	}
	root := repoRoot(t)
	c := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "cluster"), berth: filepath.Join(root, "bin", "berth")}
	out, err := c.run(30*time.Minute, c.berth, "mini", "up", "--dir", c.dir, "--name", clusterName, "--subnet", subnet,
		"--control-planes", "1", "--workers", "1", "--tampered-workers", "1", "--attestation", "tpm", "--ready-timeout", "5m")
	t.Logf("berth mini up:\n%s", out)
	procs := recordedProcs(t, c.dir)
	defer func() {
		if out, err := c.run(5*time.Minute, c.berth, "mini", "down", "--dir", c.dir); err != nil {
			t.Errorf("berth mini down: %v\n%s", err, out)
		}
		checkNoResidue(t, c.dir, procs)
	}()
	if err != nil {
		dumpLogs(t, c.dir)
		t.Fatalf("berth mini up: %v", err)
	}
	if !strings.Contains(out, "tampered t1: rejected") || !strings.Contains(out, "MEASUREMENT_MISMATCH") {
		t.Errorf("up does not report the tampered worker as rejected with the joinservice's reason")
	}
	// The cluster itself says so too: berth status lists the rejection from the join ledger, with
	// the tampered worker's address and the reason.
	tampered := nodeIP(t, c.dir, "t1")
	status := c.must(time.Minute, c.berth, "status", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
	t.Logf("berth status:\n%s", status)
	rejected, _, _ := strings.Cut(status, "ACCEPTED")
	found := false
	for _, line := range strings.Split(rejected, "\n") {
		fields := strings.Fields(line)
		found = found || (len(fields) > 5 && fields[1] == tampered && strings.Contains(line, "MEASUREMENT_MISMATCH"))
	}
	if !found {
		t.Errorf("berth status does not list the tampered worker (%s) as rejected with MEASUREMENT_MISMATCH", tampered)
	}
	checkRefusalVisible(t, c, "t1", tampered)
}

// nodeIP is the address of node name in the cluster recorded in dir's state file.
func nodeIP(t testing.TB, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st mini.State
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	for _, n := range st.Config.Nodes() {
		if n.Name == name {
			return n.IP.String()
		}
	}
	t.Fatalf("no node %s in the cluster's state", name)
	return ""
}
