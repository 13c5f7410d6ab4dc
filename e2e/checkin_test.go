//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/mini"
	"github.com/berth-k8s/berth/internal/statedisk"
)

// Log messages of w2's boot stage this check waits for.
const (
	logBootedUnanswered = "no joinservice answered the check-in: booting on the sealed key"
	logLateCheckIn      = "checked in with the cluster after booting on the sealed key"
	logLockingRunning   = "this machine was removed from the cluster: locking the running node"
	logDiskClosed       = "state disk closed: this machine was removed from the cluster"
)

// lateCheckInWithin bounds how long after the joinservice answers again the node that booted
// without an answer checks in: its later check-ins wait at most a minute (jittered by 20 %) apart,
// and the one that is answered takes a round.
const lateCheckInWithin = 2 * time.Minute

// checkCheckInAfterBootWithoutAnswer runs on TestMiniCluster's cluster (w2 joined and Ready). The
// joinservice on cp1 is made unreachable for w2 alone (cp1 rejects w2's connections to the join
// port; the API server stays reachable), and w2 is power-cycled with its TPM and state disk: its
// boot check-in gets no answer, it boots on its sealed key and its Node is Ready. Once w2 may reach
// the joinservice again, it checks in (the ledger's accepted check-in of w2; the time printed). Then
// the same with w2 removed while it boots unanswered: its first answered check-in is REVOKED and
// locks the running node (kubelet stopped, sealed key destroyed; the ledger's REVOKED check-in) and
// closes its state disk (required: no mount of it left in w2's mount namespace; the time from the
// REVOKED answer to the disk closed printed).
// berth node readmit and a restart bring w2 back Ready through a rejoin ticket.
func checkCheckInAfterBootWithoutAnswer(t testing.TB, c *cluster) {
	t.Helper()
	kubeconfig := filepath.Join(c.dir, "admin.conf")
	client := c.adminClient(t)
	w2IP := nodeIP(t, c.dir, "w2")
	logW2 := filepath.Join(c.dir, "nodes", "w2", "logs", "bootstrapper.log")
	block := joinPortBlock{c: c, t: t, from: w2IP}
	defer block.lift() // whatever fails, cp1 answers w2 again

	// bootUnanswered power-cycles w2 while the joinservice refuses it and waits until it booted on its
	// sealed key; it returns the log offset from before the restart.
	bootUnanswered := func() int64 {
		block.set()
		mark := logSize(t, logW2)
		out := c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w2", "--no-wait")
		t.Logf("w2 power-cycled, TPM and state disk kept, joinservice unreachable for it:\n%s", out)
		waitLog(t, logW2, mark, logBootedUnanswered, 3*time.Minute)
		return mark
	}

	// 1. Booted without an answer; checks in once the joinservice answers.
	mark := bootUnanswered()
	waitLog(t, logW2, mark, "node joined a cluster before: starting kubelet", time.Minute)
	t.Logf("w2 booted on its sealed key with no joinservice answering and started its kubelet:\n%s",
		grepLines(logSince(t, logW2, mark), logBootedUnanswered, "node joined a cluster before: starting kubelet"))
	answered := block.lift()
	waitLog(t, logW2, mark, logLateCheckIn, lateCheckInWithin)
	e := ledgerCheckIn(t, client, "w2", answered, "")
	t.Logf("joinservice reachable again -> w2 checked in (ledger %s, %s): %.1fs", e.Time.Format(time.RFC3339), e.Outcome, e.Time.Sub(answered).Seconds())
	t.Logf("w2's log:\n%s", grepLines(logSince(t, logW2, mark), `"logger":"bootstage"`, `"logger":"checkin"`))

	// 2. Removed while it boots unanswered: the first answer is REVOKED and locks the running node.
	mark = bootUnanswered()
	out := c.must(5*time.Minute, c.berth, "node", "remove", "w2", "--kubeconfig", kubeconfig)
	t.Logf("berth node remove w2 while it runs without a check-in answer:\n%s", out)
	answered = block.lift()
	waitLog(t, logW2, mark, logLockingRunning, lateCheckInWithin)
	e = ledgerCheckIn(t, client, "w2", answered, joinledger.ReasonRevoked)
	t.Logf("joinservice reachable again -> w2 told REVOKED (ledger %s): %.1fs", e.Time.Format(time.RFC3339), e.Time.Sub(answered).Seconds())
	waitLog(t, logW2, mark, "kubelet and its pods stopped: this machine was removed from the cluster", time.Minute)
	tail := logSince(t, logW2, mark)
	if !strings.Contains(tail, "sealed disk key destroyed") {
		t.Errorf("the locked w2 did not destroy its sealed disk key:\n%s", grepLines(tail, `"logger":"bootstage"`))
	}
	t.Logf("w2's lock:\n%s", grepLines(tail, `"logger":"bootstage"`, `"logger":"lockstop`, "the check-in after the boot"))
	// The lock closes the state disk: pods, containerd (its root is on the disk) and every mount of
	// the disk gone first. Required, not tolerated.
	if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 3*time.Minute, true, func(context.Context) (bool, error) {
		return strings.Contains(logSince(t, logW2, mark), logDiskClosed), nil
	}); err != nil {
		t.Fatalf("the locked w2 did not close its state disk:\n%s", grepLines(logSince(t, logW2, mark), `"logger":"bootstage"`, `"logger":"lockstop`, `"logger":"statedisk"`))
	}
	closed := time.Now()
	t.Logf("w2 told REVOKED -> state disk closed: %.1fs", closed.Sub(e.Time).Seconds())
	mounts := c.must(time.Minute, "nsenter", "--mount="+filepath.Join(c.dir, "ns", "w2.mnt"), "--", "cat", "/proc/self/mountinfo")
	for _, l := range strings.Split(mounts, "\n") {
		if f := strings.Fields(l); len(f) > 4 && (strings.HasPrefix(f[4], mini.StateDiskMount) || strings.HasPrefix(f[3], "/"+statedisk.DataDir+"/")) {
			t.Errorf("the locked w2 still mounts its state disk: %s", l)
		}
	}

	// Back: re-admitted, w2 reboots, finds no sealed key and rejoins.
	start := time.Now()
	out = c.must(2*time.Minute, c.berth, "node", "readmit", "w2", "--kubeconfig", kubeconfig)
	t.Logf("berth node readmit w2:\n%s", out)
	c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w2", "--no-wait")
	c.kube("wait", "--for=create", "node/w2", "--timeout=180s")
	c.kube("wait", "--for=condition=Ready", "node/w2", "--timeout=180s")
	t.Logf("berth node readmit w2 and a restart -> w2 Ready: %.1fs", time.Since(start).Seconds())
}

// ledgerCheckIn waits for the ledger's check-in of node after since with reason ("": accepted)
// and returns it.
func ledgerCheckIn(t testing.TB, client kubernetes.Interface, node string, since time.Time, reason string) joinledger.Entry {
	t.Helper()
	var found joinledger.Entry
	if err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		es, err := joinledger.Read(ctx, client, joinconfig.Namespace)
		if err != nil {
			return false, nil
		}
		for _, e := range es {
			if e.RPC == "checkin" && e.Node == node && e.Reason == reason && !e.Time.Before(since.Add(-time.Second)) {
				found = e
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		t.Fatalf("the ledger shows no check-in of %s with reason %q after %s", node, reason, since.Format(time.RFC3339))
	}
	return found
}

// joinPortBlock makes cp1 reject, in its network namespace, the connections of one node's address to
// the join port (a TCP reset), so that only that node finds no joinservice; the API server and
// everything else stay reachable.
type joinPortBlock struct {
	c    *cluster
	t    testing.TB
	from string
	on   bool
}

// joinPortTable is the nftables table of the block in cp1's network namespace.
const joinPortTable = "berth_e2e_checkin"

func (b *joinPortBlock) nft(args ...string) (string, error) {
	return b.c.run(time.Minute, "ip", append([]string{"netns", "exec", "berth-" + clusterName + "-cp1", "nft"}, args...)...)
}

// set rejects the node's connections to the join port from now on.
func (b *joinPortBlock) set() {
	b.t.Helper()
	rules := filepath.Join(b.t.TempDir(), "block.nft")
	text := fmt.Sprintf("add table inet %[1]s\nadd chain inet %[1]s input { type filter hook input priority 0 ; }\n"+
		"add rule inet %[1]s input ip saddr %[2]s tcp dport %[3]d reject with tcp reset\n", joinPortTable, b.from, joinconfig.JoinPort)
	if err := os.WriteFile(rules, []byte(text), 0o600); err != nil {
		b.t.Fatal(err)
	}
	if out, err := b.nft("-f", rules); err != nil {
		b.t.Fatalf("blocking the join port for %s on cp1: %v\n%s", b.from, err, out)
	}
	b.on = true
}

// lift lets the node reach the join port again and returns when.
func (b *joinPortBlock) lift() time.Time {
	if b.on {
		if out, err := b.nft("delete", "table", "inet", joinPortTable); err != nil {
			b.t.Errorf("lifting the join port block on cp1: %v\n%s", err, out)
		}
		b.on = false
	}
	return time.Now()
}
