//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// sharedClusterConfig is the cluster configuration TestMiniCluster's cluster is initialized with
// (berth mini up --config): an audit policy recording ConfigMap writes in namespace default (to a
// file on cp1's state disk), a kubelet setting and kube-proxy's settings. checkClusterConfigInForce
// shows each in force.
const sharedClusterConfig = `apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
apiServer:
  audit:
    policy:
      omitStages: [RequestReceived]
      rules:
      - level: Metadata
        namespaces: [default]
        resources: [{group: "", resources: [configmaps]}]
      - level: None
kubelet:
  maxPods: 61
kubeProxy:
  mode: nftables
  nftables: {minSyncPeriod: 2s}
`

// writeSharedClusterConfig writes sharedClusterConfig and returns its path.
func writeSharedClusterConfig(t testing.TB) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "cluster-config.yaml")
	if err := os.WriteFile(path, []byte(sharedClusterConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// checkClusterConfigInForce: the configuration berth init used (the file berth mini up --config gave,
// with the name, SANs and files the mini cluster sets over it: the cluster directory's init.yaml)
// is kept in the cluster (berth config diff finds no difference, berth status names its
// apiVersion) and each part is in force: an API request is in the audit log on cp1's state disk,
// every node's kubelet has the operator's maxPods, and kube-proxy runs nftables with the operator's
// settings.
func checkClusterConfigInForce(t testing.TB, c *cluster) {
	t.Helper()
	kc := filepath.Join(c.dir, "admin.conf")
	if out, err := c.run(time.Minute, c.berth, "config", "diff", filepath.Join(c.dir, "init.yaml"), "--kubeconfig", kc); err != nil {
		t.Errorf("berth config diff against the kept configuration: %v\n%s", err, out)
	}
	if out := c.must(time.Minute, c.berth, "status", "--kubeconfig", kc); !strings.Contains(out, "Cluster configuration: config.berth.dev/v1alpha1 ClusterConfiguration") {
		t.Errorf("berth status does not name the kept configuration's version:\n%s", out)
	}

	// The audit log: one event for a ConfigMap this test creates, in the file on cp1's state disk.
	c.kube("create", "configmap", "audit-probe", "-n", "default", "--from-literal=k=v")
	checkAuditEvent(t, c, "cp1", "audit-probe")
	checkAuditLogOnStateDisk(t, c, "cp1")

	// The kubelet setting, on every node.
	var nodes corev1.NodeList
	if err := json.Unmarshal([]byte(c.kube("get", "nodes", "-o", "json")), &nodes); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes.Items {
		if got := n.Status.Capacity.Pods().String(); got != "61" {
			t.Errorf("node %s has capacity for %s pods, want the configured 61", n.Name, got)
		}
	}

	// kube-proxy's configuration and the mode it runs.
	proxyCfg := c.kube("get", "configmap", "kube-proxy", "-n", "kube-system", "-o", "jsonpath={.data.config\\.conf}")
	if !strings.Contains(proxyCfg, "mode: nftables") || !strings.Contains(proxyCfg, "minSyncPeriod: 2s") {
		t.Errorf("kube-proxy's ConfigMap:\n%s", proxyCfg)
	}
	if logs := c.kube("logs", "-n", "kube-system", "daemonset/kube-proxy"); !strings.Contains(logs, "Using nftables Proxier") {
		t.Errorf("kube-proxy does not say it runs nftables:\n%s", logs)
	}
}

// auditLog is where sharedClusterConfig's audit policy has the API server write (the mini
// cluster's control planes keep /var/log/kubernetes on their state disk).
const auditLog = "/var/log/kubernetes/audit/audit.log"

// checkAuditEvent finds the audit event of creating ConfigMap default/name in the audit log of
// node's API server, read in node's mount namespace, and returns the line it found.
func checkAuditEvent(t testing.TB, c *cluster, node, name string) string {
	t.Helper()
	enter := "--mount=" + filepath.Join(c.dir, "ns", node+".mnt")
	var event struct {
		Verb      string `json:"verb"`
		Stage     string `json:"stage"`
		ObjectRef struct {
			Resource, Namespace, Name string
		} `json:"objectRef"`
	}
	var found string
	// The API server writes its audit log in batches: the event may take a moment to appear.
	_ = wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		out, err := c.run(time.Minute, "nsenter", enter, "--", "cat", auditLog)
		for _, line := range strings.Split(out, "\n") {
			if err == nil && strings.Contains(line, `"`+name+`"`) && json.Unmarshal([]byte(line), &event) == nil && event.Verb == "create" {
				found = line
				return true, nil
			}
		}
		return false, nil
	})
	if found == "" || event.ObjectRef.Resource != "configmaps" || event.ObjectRef.Namespace != "default" || event.ObjectRef.Name != name || event.Stage != "ResponseComplete" {
		t.Errorf("no audit event for creating configmap default/%s in %s:%s (found %q: %+v)", name, node, auditLog, found, event)
	}
	return found
}

// checkAuditLogOnStateDisk: node's audit log is on the device of its state disk.
func checkAuditLogOnStateDisk(t testing.TB, c *cluster, node string) {
	t.Helper()
	enter := "--mount=" + filepath.Join(c.dir, "ns", node+".mnt")
	auditMount := c.must(time.Minute, "nsenter", enter, "--", "findmnt", "-n", "-o", "SOURCE", "-T", auditLog)
	stateMount := c.must(time.Minute, "nsenter", enter, "--", "findmnt", "-n", "-o", "SOURCE", "-T", "/var/lib/berth")
	dev := func(s string) string { d, _, _ := strings.Cut(strings.TrimSpace(s), "["); return d }
	if dev(auditMount) == "" || dev(auditMount) != dev(stateMount) {
		t.Errorf("%s's audit log is on %q, the state disk is %q", node, auditMount, stateMount)
	}
}
