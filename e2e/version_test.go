//go:build e2e

package e2e

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/prereq"
)

// checkServerVersion checks that the cluster's API server (kubectl version) and every node's kubelet
// run Kubernetes want.
func checkServerVersion(t testing.TB, c *cluster, want string) {
	t.Helper()
	var v struct {
		ServerVersion struct {
			GitVersion string `json:"gitVersion"`
		} `json:"serverVersion"`
	}
	out := c.kube("version", "-o", "json")
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("kubectl version -o json: %v\n%s", err, out)
	}
	if v.ServerVersion.GitVersion != want {
		t.Errorf("kubectl version: server %q, want %s", v.ServerVersion.GitVersion, want)
	}
	kubelets := strings.Fields(c.kube("get", "nodes", "-o", "jsonpath={.items[*].status.nodeInfo.kubeletVersion}"))
	if len(kubelets) == 0 {
		t.Errorf("no node reports a kubelet version")
	}
	for _, k := range kubelets {
		if k != want {
			t.Errorf("kubelet versions %v, want all %s", kubelets, want)
			break
		}
	}
}

// checkImages checks that the pods of kube-system labelled selector run image.
func checkImages(t testing.TB, c *cluster, selector, image string) {
	t.Helper()
	got := strings.Fields(c.kube("get", "pods", "-n", "kube-system", "-l", selector, "-o", "jsonpath={.items[*].spec.containers[*].image}"))
	if len(got) == 0 {
		t.Errorf("no pod with %s in kube-system", selector)
	}
	for _, g := range got {
		if g != image {
			t.Errorf("pods with %s run %v, want %s", selector, got, image)
			break
		}
	}
}

// TestMiniPreviousMinor brings up a small cluster (one control plane, one worker that joins through
// the joinservice) at the previous supported Kubernetes minor with berth mini up
// --kubernetes-version MINOR, and checks that the API server and every kubelet run that release, and
// etcd and CoreDNS the versions its kubeadm names, that berth upgrade plan shows the step to the
// default minor (checkUpgradePlan), then that berth mini down leaves nothing behind.
func TestMiniPreviousMinor(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root")
	}
	supported := k8sversion.Supported()
	if len(supported) < 2 {
		t.Fatalf("k8sversion supports only %v: no previous minor to build", supported)
	}
	prev := supported[1]
	root := repoRoot(t)
	c := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "cluster"), berth: filepath.Join(root, "bin", "berth")}
	for _, b := range []string{"berth", "bootstrapper", "joinservice"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Fatalf("bin/%s missing: run make build first (make test-e2e does): %v", b, err)
		}
	}
	// kubectl of the default release: one minor of skew to the server is within kubectl's support.
	c.kubectl = filepath.Join(strings.TrimSpace(c.must(30*time.Minute, filepath.Join(root, "scripts", "build-k8s.sh"), "k8s")), "kubectl")

	start := time.Now()
	out, err := c.run(60*time.Minute, c.berth, "mini", "up", "--dir", c.dir, "--name", clusterName, "--subnet", subnet,
		"--kubernetes-version", prev.Minor(), "--control-planes", "1", "--workers", "1")
	t.Logf("berth mini up --kubernetes-version %s (%.1fs):\n%s", prev.Minor(), time.Since(start).Seconds(), out)
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
		checkNoResidue(t, c.dir, procs)
	}()
	if err != nil {
		dumpLogs(t, c.dir)
		t.Fatalf("berth mini up --kubernetes-version %s: %v", prev.Minor(), err)
	}
	if !strings.Contains(out, "Kubernetes "+prev.Kubernetes) {
		t.Errorf("berth mini up does not say it runs Kubernetes %s", prev.Kubernetes)
	}
	if nodes := c.kube("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"); nodes != "cp1 w1" {
		t.Fatalf("nodes = %q, want cp1 w1", nodes)
	}
	checkServerVersion(t, c, prev.Kubernetes)
	im := prev.Images()
	checkImages(t, c, "component=etcd", im.Etcd)
	checkImages(t, c, "component=kube-apiserver", im.KubeAPIServer)
	checkImages(t, c, "k8s-app=kube-dns", im.CoreDNS)
	checkUpgradePlan(t, c, prev)
	t.Logf("the cluster at %s was up and checked %.1fs after berth mini up started", prev.Kubernetes, time.Since(start).Seconds())
}
