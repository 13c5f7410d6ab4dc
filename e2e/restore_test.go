//go:build e2e

package e2e

import (
	"encoding/base64"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/backup/backuptest"
	"github.com/berth-k8s/berth/internal/prereq"
)

// machinesByNode prints each Machine as node=identity.
const machinesByNode = `{range .items[*]}{.spec.node}={.spec.identity} {end}`

// restoreNodes are the nodes of both clusters of the restore drill.
var restoreNodes = []string{"cp1", "cp2", "cp3", "w1"}

// restoreCanary is the value of the Secret the restore drill carries from one cluster to the next.
const restoreCanary = "restore-drill-canary-2f9e41c7"

// TestMiniRestore is the restore drill, on 3 control planes and 1 worker: a cluster holding a
// canary Secret takes a snapshot through its schedule (berth backup now), the sealed file is copied
// off the state disk of the control plane that took it and holds the canary in no encoding, the
// cluster goes, fresh nodes come up waiting for init, berth restore builds the cluster on cp1 from
// the snapshot, the canary reads back through the new API server (so the KMS keys came along), the
// old admin kubeconfig no longer works (new PKI), the fresh cp2, cp3 and w1 join, the Machines are
// the fresh machines' only (the old ones' are cleared), and the time from berth restore to every
// node Ready is printed. A snapshot opened with another master secret is refused before any node is
// touched.
func TestMiniRestore(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root")
	}
	root := repoRoot(t)
	for _, b := range []string{"berth", "bootstrapper", "joinservice"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Fatalf("bin/%s missing: run make build first (make test-e2e does): %v", b, err)
		}
	}
	saved := t.TempDir()
	old := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "old"), berth: filepath.Join(root, "bin", "berth")}
	old.kubectl = filepath.Join(strings.TrimSpace(old.must(30*time.Minute, filepath.Join(root, "scripts", "build-k8s.sh"), "k8s")), "kubectl")
	up := []string{"mini", "up", "--name", clusterName, "--subnet", subnet, "--control-planes", "3", "--workers", "1"}

	start := time.Now()
	out, err := old.run(30*time.Minute, old.berth, append(up, "--dir", old.dir)...)
	t.Logf("berth mini up, the old cluster (%.1fs):\n%s", time.Since(start).Seconds(), out)
	oldDown := downOnce(t, old)
	defer oldDown()
	if err != nil {
		dumpLogs(t, old.dir)
		t.Fatalf("berth mini up: %v", err)
	}
	old.kube("create", "secret", "generic", "restore-canary", "-n", "default", "--from-literal=v="+restoreCanary)
	// Every old machine's Machine is in the snapshot, so that the restore has old machines to clear.
	oldMachines := old.machinesEventually(2*time.Minute, restoreNodes)
	out = old.must(10*time.Minute, old.berth, "backup", "now", "--kubeconfig", filepath.Join(old.dir, "admin.conf"), "--timeout", "5m")
	t.Logf("berth backup now:\n%s", out)
	m := regexp.MustCompile(`Snapshot (\S+\.berth-snapshot) taken by (cp[0-9]+):`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("berth backup now names no snapshot:\n%s", out)
	}
	snapshot := filepath.Join(saved, m[1])
	raw := old.must(time.Minute, "nsenter", "--mount="+filepath.Join(old.dir, "ns", m[2]+".mnt"), "--", "cat", "/var/lib/berth/backups/"+m[1])
	if err := os.WriteFile(snapshot, []byte(raw), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Logf("the schedule's snapshot %s: %d bytes (the node's Restore takes it in 1 MiB messages; gRPC's default limit is 4 MiB)", m[1], len(raw))
	if leaks := backuptest.Leaks([]byte(raw), restoreCanary); len(leaks) > 0 {
		t.Errorf("the sealed snapshot's raw bytes contain the canary (%v)", leaks)
	}
	for _, f := range []string{"master-secret.json", "admin.conf", "cluster-id"} {
		b, err := os.ReadFile(filepath.Join(old.dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(saved, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	oldDown()

	fresh := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "fresh"), berth: old.berth, kubectl: old.kubectl}
	start = time.Now()
	out, err = fresh.run(30*time.Minute, fresh.berth, append(up, "--dir", fresh.dir, "--no-init")...)
	t.Logf("berth mini up --no-init, the fresh nodes (%.1fs):\n%s", time.Since(start).Seconds(), out)
	freshDown := downOnce(t, fresh)
	defer freshDown()
	if err != nil {
		dumpLogs(t, fresh.dir)
		t.Fatalf("berth mini up --no-init: %v", err)
	}
	restore := []string{"restore", "--from", snapshot, "--endpoint", nodeIP(t, fresh.dir, "cp1") + ":9000",
		"--config", filepath.Join(fresh.dir, "init.yaml"), "--connect-timeout", "2m"}

	// Another cluster's master secret opens nothing: refused on the operator's machine, nothing sent.
	other := filepath.Join(saved, "other-master-secret.json")
	if err := os.WriteFile(other, []byte(`{"masterSecret":"`+base64.StdEncoding.EncodeToString(make([]byte, 32))+`","salt":"`+base64.StdEncoding.EncodeToString(make([]byte, 32))+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	wrongWS := t.TempDir()
	out, err = fresh.run(2*time.Minute, fresh.berth, append(restore, "--master-secret", other, "--workspace", wrongWS)...)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || !strings.Contains(out, "does not open with this master secret") || strings.Contains(out, "Connecting to") {
		t.Errorf("berth restore with another master secret: %v, want a refusal before connecting:\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(wrongWS, "master-secret.json")); err == nil {
		t.Error("the refused restore wrote a master secret into its workspace")
	}

	start = time.Now()
	out, err = fresh.run(20*time.Minute, fresh.berth, append(restore, "--master-secret", filepath.Join(saved, "master-secret.json"), "--workspace", fresh.dir)...)
	restored := time.Since(start)
	t.Logf("berth restore (%.1fs):\n%s", restored.Seconds(), out)
	if err != nil {
		initLog, _ := os.ReadFile(filepath.Join(fresh.dir, "init.log"))
		t.Logf("the node's init output:\n%s", initLog)
		fresh.diagnose()
		t.Fatalf("berth restore: %v", err)
	}
	if !strings.Contains(out, "restore-etcd") || !strings.Contains(out, "Cluster restored in") {
		t.Errorf("berth restore's output shows no restore")
	}
	oldID, _ := os.ReadFile(filepath.Join(saved, "cluster-id"))
	newID, _ := os.ReadFile(filepath.Join(fresh.dir, "cluster-id"))
	if strings.TrimSpace(string(oldID)) == "" || strings.TrimSpace(string(oldID)) != strings.TrimSpace(string(newID)) {
		t.Errorf("cluster ID %q after the restore, want the old %q", newID, oldID)
	}

	// The canary decrypts: the API server reads it through the KMS plugin with the snapshot's keys.
	got := fresh.kube("get", "secret", "restore-canary", "-n", "default", "-o", "jsonpath={.data.v}")
	v, err := base64.StdEncoding.DecodeString(strings.TrimSpace(got))
	if err != nil || string(v) != restoreCanary {
		t.Errorf("the restored canary reads %q (%v), want %q", got, err, restoreCanary)
	}
	t.Logf("the canary Secret read back through the restored API server: %q", v)
	// New PKI: the old cluster's admin credential does not open the restored one.
	if out, err := fresh.run(time.Minute, fresh.kubectl, "--kubeconfig", filepath.Join(saved, "admin.conf"), "--server",
		"https://"+nodeIP(t, fresh.dir, "cp1")+":6443", "get", "secrets", "-n", "default"); err == nil {
		t.Errorf("the old admin.conf works on the restored cluster:\n%s", out)
	}

	// The fresh worker joins the restored cluster; every node Ready.
	ready := `{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status} {end}`
	allReady := strings.Join(restoreNodes, "=True ") + "=True"
	out, ok := fresh.kubeEventually(10*time.Minute, allReady, "get", "nodes", "-o", "jsonpath="+ready)
	toReady := time.Since(start)
	if !ok {
		fresh.diagnose()
		t.Fatalf("nodes after the restore: %s, want %s", out, allReady)
	}
	if nodes := strings.Fields(fresh.kube("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}")); !slices.Equal(nodes, restoreNodes) {
		t.Errorf("nodes after the restore: %v, want %v", nodes, restoreNodes)
	}
	// The record API lists only the machines of the restored cluster: the fresh ones, under the old
	// names, with new identities (restore-cleanup cleared the old cluster's admitted machines).
	newMachines := fresh.machinesEventually(2*time.Minute, restoreNodes)
	if len(newMachines) != len(restoreNodes) || slices.ContainsFunc(newMachines, func(m string) bool { return slices.Contains(oldMachines, m) }) {
		t.Errorf("Machines after the restore: %v, want one fresh one per node (the old cluster's: %v)", newMachines, oldMachines)
	}
	t.Logf("Machines (node=identity) of the old cluster: %v; of the restored one: %v", oldMachines, newMachines)
	t.Logf("RESTORE DRILL: snapshot %d bytes; berth restore took %.1fs; restore to every node Ready (3 control planes, 1 worker): %.1fs (goal: at most 5 minutes)",
		len(raw), restored.Seconds(), toReady.Seconds())
}

// machinesEventually waits until c has a Machine for each of nodes and returns every Machine as
// node=identity.
func (c *cluster) machinesEventually(timeout time.Duration, nodes []string) []string {
	c.t.Helper()
	var out string
	deadline := time.Now().Add(timeout)
	for _, n := range nodes {
		var ok bool
		if out, ok = c.kubeEventually(time.Until(deadline), n+"=", "-n", "berth-system", "get", "machines", "-o", "jsonpath="+machinesByNode); !ok {
			c.t.Fatalf("Machines: %s, want one for each of %v", out, nodes)
		}
	}
	return strings.Fields(out)
}

// downOnce returns a function that removes c's mini cluster the first time it is called and checks
// that nothing is left; later calls do nothing.
func downOnce(t testing.TB, c *cluster) func() {
	procs := recordedProcs(t, c.dir)
	done := false
	return func() {
		if done {
			return
		}
		done = true
		if t.Failed() {
			dumpLogs(t, c.dir)
		}
		if out, err := c.run(5*time.Minute, c.berth, "mini", "down", "--dir", c.dir); err != nil {
			t.Errorf("berth mini down --dir %s: %v\n%s", c.dir, err, out)
		}
		checkNoResidue(t, c.dir, procs)
	}
}
