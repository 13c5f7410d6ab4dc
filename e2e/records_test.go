//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// checkRecordAPI: kubectl get lists the record API's Machines of the workers that joined, with the
// printer columns (node, role, state, last join), and berth status w1 shows w1's machine with its
// latest join and evidence. The joinservice writes Machines within its flush interval, so the check
// polls for them.
func checkRecordAPI(t testing.TB, c *cluster) {
	t.Helper()
	var out string
	_ = wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		got, err := c.run(30*time.Second, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "-n", "berth-system", "get", "machines")
		out = got
		return err == nil && strings.Contains(got, " w1 ") && strings.Contains(got, " w2 "), nil
	})
	t.Logf("kubectl get machines:\n%s", out)
	header := strings.Fields(strings.SplitN(out, "\n", 2)[0])
	if strings.Join(header, " ") != "NAME NODE ROLE STATE LAST JOIN AGE" {
		t.Errorf("kubectl get machines columns = %q", header)
	}
	for _, n := range []string{"w1", "w2"} {
		found := false
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			found = found || len(f) >= 4 && f[1] == n && f[2] == "worker" && f[3] == "Admitted"
		}
		if !found {
			t.Errorf("kubectl get machines has no admitted worker %s", n)
		}
	}
	// The short names, and the join records' columns.
	t.Logf("kubectl get bm -o wide:\n%s", c.kube("-n", "berth-system", "get", "bm", "-o", "wide"))
	bjr := c.kube("-n", "berth-system", "get", "bjr")
	t.Logf("kubectl get bjr:\n%s", bjr)
	if h := strings.Join(strings.Fields(strings.SplitN(bjr, "\n", 2)[0]), " "); !strings.HasPrefix(bjr, "No resources") && h != "NAME CLASS NODE PEER REASON COUNT LAST" {
		t.Errorf("kubectl get bjr columns = %q", h)
	}
	// w1 reports its join trace once its Node is Ready: berth status w1 shows the phases with their
	// durations.
	var status string
	_ = wait.PollUntilContextTimeout(context.Background(), 2*time.Second, 3*time.Minute, true, func(context.Context) (bool, error) {
		out, err := c.run(time.Minute, c.berth, "status", "w1", "--kubeconfig", filepath.Join(c.dir, "admin.conf"))
		status = out
		return err == nil && strings.Contains(out, "join trace, reported"), nil
	})
	t.Logf("berth status w1:\n%s", status)
	for _, want := range []string{"Node w1: machine", "Admitted", "last join", "evidence sha256:", "join trace, reported", "in all "} {
		if !strings.Contains(status, want) {
			t.Errorf("berth status w1 lacks %q", want)
		}
	}
	for _, phase := range []string{"metadata", "ticket", "kubeadm-join", "node-ready"} {
		found := false
		for _, line := range strings.Split(status, "\n") {
			f := strings.Fields(line)
			if len(f) >= 3 && f[0] == phase && f[1] == "succeeded" {
				_, err := time.ParseDuration(f[2])
				found = err == nil
			}
		}
		if !found {
			t.Errorf("berth status w1 shows no succeeded %s phase with a duration", phase)
		}
	}
}

// checkRefusalVisible (must-show 3): the tampered worker keeps asking and is refused each time; each
// refusal shows in kubectl get bjr and in berth status. It waits for the next refusal, measures how
// long after the refusal (the JoinRecord's time of its latest refusal, whole seconds, so the figure
// is up to a second high) kubectl get bjr and then berth status showed it, and checks that berth
// status explains the reason.
func checkRefusalVisible(t testing.TB, c *cluster, node, ip string) {
	t.Helper()
	if c.kubectl == "" {
		kbin := strings.TrimSpace(c.must(30*time.Minute, filepath.Join(c.root, "scripts", "build-k8s.sh"), "k8s"))
		c.kubectl = filepath.Join(kbin, "kubectl")
	}
	kubeconfig := filepath.Join(c.dir, "admin.conf")
	refusals := func() (count int64, last time.Time) {
		out, err := c.run(30*time.Second, c.kubectl, "--kubeconfig", kubeconfig, "-n", "berth-system", "get", "bjr", "-o", "json")
		if err != nil {
			return -1, time.Time{}
		}
		var list v1alpha1.JoinRecordList
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			return -1, time.Time{}
		}
		for _, r := range list.Items {
			if r.Spec.Node == node || r.Spec.Peer == ip {
				count += r.Status.Count
				if r.Status.Last.After(last) {
					last = r.Status.Last.Time
				}
			}
		}
		return count, last
	}
	before, _ := refusals()
	var seen, last time.Time
	var count int64
	if err := wait.PollUntilContextTimeout(context.Background(), 200*time.Millisecond, 2*time.Minute, true, func(context.Context) (bool, error) {
		count, last = refusals()
		seen = time.Now()
		return before >= 0 && count > before, nil
	}); err != nil {
		t.Errorf("no new refusal of %s (%s) in kubectl get bjr within 2 minutes (count stayed %d)", node, ip, before)
		return
	}
	t.Logf("REFUSAL VISIBLE kubectl get bjr: %.1fs after the refusal at %s (count %d -> %d)", seen.Sub(last).Seconds(), last.UTC().Format(time.RFC3339), before, count)
	t.Logf("kubectl get bjr:\n%s", c.kube("-n", "berth-system", "get", "bjr"))
	out := c.must(time.Minute, c.berth, "status", "--kubeconfig", kubeconfig)
	t.Logf("REFUSAL VISIBLE berth status: %.1fs after the refusal", time.Since(last).Seconds())
	t.Logf("berth status:\n%s", out)
	if !strings.Contains(out, "MEASUREMENT_MISMATCH: ") || !strings.Contains(out, "What the reasons mean") {
		t.Errorf("berth status does not explain MEASUREMENT_MISMATCH next to the refusal")
	}
	row := false
	for _, line := range strings.Split(out, "\n") {
		row = row || strings.Contains(line, ip) && strings.Contains(line, "MEASUREMENT_MISMATCH") && strings.Contains(line, strconv.FormatInt(count, 10))
	}
	if !row {
		t.Errorf("berth status has no row of %s's refusals with the count kubectl showed (%d)", ip, count)
	}
	nodeOut := c.must(time.Minute, c.berth, "status", node, "--kubeconfig", kubeconfig)
	t.Logf("berth status %s:\n%s", node, nodeOut)
	if !strings.Contains(nodeOut, "never admitted") {
		t.Errorf("berth status %s does not say the cluster never admitted it", node)
	}
	ipOut := c.must(time.Minute, c.berth, "status", ip, "--kubeconfig", kubeconfig)
	t.Logf("berth status %s:\n%s", ip, ipOut)
	if !strings.Contains(ipOut, "MEASUREMENT_MISMATCH") || !strings.Contains(ipOut, "What the reasons mean") {
		t.Errorf("berth status %s does not show the address's refusals with their explanation", ip)
	}
}
