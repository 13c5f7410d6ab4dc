//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
)

// revocationWithin is how soon after berth node remove a removed node's kubelet must be refused.
const revocationWithin = 60 * time.Second

// quietAfterRestart is how long after its restart the removed node must stay away.
const quietAfterRestart = 2 * time.Minute

// checkRevocationHolds runs on TestMiniCluster's cluster: berth node remove w2 on the running
// cluster, then a power cut of w2 that keeps its TPM and state disk (its kubelet client certificate
// is still valid). Within a minute of the removal the API server refuses a write made with the
// kubelet's own credentials (kubelet.conf from w2's state disk), and for two minutes after the
// restart no Node w2 appears (a watch: any ADDED w2 fails). The restarted w2 checks in before its
// kubelet starts, is told REVOKED, never starts its kubelet and destroys its sealed disk key; the
// ledger and berth status show the removal and the REVOKED check-in (node, machine, time). berth
// node readmit brings w2 back Ready by itself: its next check-in admits it.
func checkRevocationHolds(t testing.TB, c *cluster) {
	t.Helper()
	kubeconfig := filepath.Join(c.dir, "admin.conf")
	client := c.adminClient(t)
	ctx := context.Background()

	start := time.Now()
	out := c.must(5*time.Minute, c.berth, "node", "remove", "w2", "--kubeconfig", kubeconfig)
	t.Logf("berth node remove w2 (%.1fs):\n%s", time.Since(start).Seconds(), out)
	// The kubelet's own credential, as the machine keeps it: a write it makes is refused.
	var refusal string
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, revocationWithin-time.Since(start), true, func(context.Context) (bool, error) {
		refusal = kubeletWrite(t, c, "w2")
		return strings.Contains(refusal, berthsystem.RevocationName), nil
	}); err != nil {
		t.Fatalf("w2's kubelet credential is not refused %s after berth node remove; last answer:\n%s", revocationWithin, refusal)
	}
	t.Logf("berth node remove w2 -> kubelet refused: %.1fs", time.Since(start).Seconds())
	t.Logf("w2's kubelet.conf registering Node w2: %s", strings.TrimSpace(refusal))
	if _, err := client.CoreV1().Nodes().Get(ctx, "w2", metav1.GetOptions{}); err == nil {
		t.Fatalf("Node w2 still exists %.1fs after berth node remove", time.Since(start).Seconds())
	}

	// Watch from now on: the restarted w2 must not register (an ADDED w2 fails at once).
	nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", "w2").String()})
	if err != nil || len(nodes.Items) != 0 {
		t.Fatalf("listing Node w2: %v, %d items", err, len(nodes.Items))
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	appeared := make(chan error, 1)
	go func() { appeared <- watchNoNode(watchCtx, client, "w2", nodes.ResourceVersion) }()
	logW2 := filepath.Join(c.dir, "nodes", "w2", "logs", "bootstrapper.log")
	mark := logSize(t, logW2)
	out = c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w2", "--no-wait")
	t.Logf("w2 power-cycled, TPM and state disk kept:\n%s", out)
	restarted := time.Now()
	select {
	case err := <-appeared:
		t.Fatalf("after w2's restart: %v", err)
	case <-time.After(quietAfterRestart):
	}
	stopWatch()
	if err := <-appeared; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("watching Node w2: %v", err)
	}
	t.Logf("no Node w2 for %.0fs after its restart (watched)", time.Since(restarted).Seconds())
	// The restarted w2 checked in before its kubelet started, was told REVOKED and never started it.
	waitLog(t, logW2, mark, "the cluster answered the check-in with REVOKED", time.Minute)
	tail := logSince(t, logW2, mark)
	t.Logf("w2's check-in after the restart:\n%s", grepLines(tail, `"logger":"checkin"`))
	if strings.Contains(tail, `"msg":"starting kubelet"`) {
		t.Errorf("the revoked w2 started its kubelet after the restart:\n%s", grepLines(tail, "kubelet"))
	}
	if !strings.Contains(tail, "sealed disk key destroyed") {
		t.Errorf("the revoked w2 did not destroy its sealed disk key:\n%s", grepLines(tail, `"level":"error"`))
	}
	var checkIn joinledger.Entry
	es, err := joinledger.Read(ctx, client, joinconfig.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if e.RPC == "checkin" && e.Node == "w2" && e.Reason == joinledger.ReasonRevoked && e.Time.After(restarted.Add(-time.Second)) {
			checkIn = e
		}
	}
	if checkIn.Node == "" || !strings.Contains(checkIn.Message, "machine ") {
		t.Errorf("the ledger shows no REVOKED check-in of w2 naming its machine after the restart")
	} else {
		t.Logf("the ledger's REVOKED check-in: %s %s %s machine %s: %s", checkIn.Time.Format(time.RFC3339), checkIn.Node, checkIn.Reason,
			checkIn.Identity, checkIn.Message)
	}
	status := c.must(time.Minute, c.berth, "status", "--kubeconfig", kubeconfig)
	t.Logf("berth status:\n%s", status)
	_, removed, _ := strings.Cut(status, "REMOVED MACHINES")
	if !strings.Contains(removed, " w2 ") || !strings.Contains(status, "kubelet refused by the API server") {
		t.Errorf("berth status shows no removed w2 with its kubelet refused")
	}
	statusCheckIn := ""
	for _, line := range strings.Split(status, "\n") {
		if strings.Contains(line, " w2 ") && strings.Contains(line, " checkin ") && strings.Contains(line, joinledger.ReasonRevoked) {
			statusCheckIn = line
		}
	}
	if statusCheckIn == "" {
		t.Errorf("berth status shows no REVOKED check-in of w2")
	} else {
		t.Logf("berth status's REVOKED check-in: %s", strings.TrimSpace(statusCheckIn))
	}

	start = time.Now()
	out = c.must(2*time.Minute, c.berth, "node", "readmit", "w2", "--kubeconfig", kubeconfig)
	t.Logf("berth node readmit w2:\n%s", out)
	c.kube("wait", "--for=create", "node/w2", "--timeout=120s")
	c.kube("wait", "--for=condition=Ready", "node/w2", "--timeout=180s")
	t.Logf("berth node readmit w2 -> w2 Ready: %.1fs", time.Since(start).Seconds())
}

// kubeletWrite tries, with node's kubelet credentials from its state disk (inside its mount
// namespace), to register Node node, and returns kubectl's answer.
func kubeletWrite(t testing.TB, c *cluster, node string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", "--mount="+filepath.Join(c.dir, "ns", node+".mnt"), "--",
		c.kubectl, "--kubeconfig", "/etc/kubernetes/kubelet.conf", "create", "-f", "-")
	cmd.Stdin = strings.NewReader(fmt.Sprintf("apiVersion: v1\nkind: Node\nmetadata:\n  name: %s\n", node))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return fmt.Sprintf("%s(%v)", out.String(), err)
}

// watchNoNode watches Nodes from resourceVersion until ctx ends and returns an error when Node name
// is added.
func watchNoNode(ctx context.Context, client kubernetes.Interface, name, resourceVersion string) error {
	for {
		w, err := client.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{ResourceVersion: resourceVersion,
			FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("watching Node %s: %w", name, err)
		}
		for ev := range w.ResultChan() {
			if n, ok := ev.Object.(*corev1.Node); ok {
				resourceVersion = n.ResourceVersion
				if ev.Type == watch.Added {
					w.Stop()
					return fmt.Errorf("Node %s was registered again (%s at %s)", name, ev.Type, n.CreationTimestamp)
				}
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}
