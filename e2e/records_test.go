//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
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

// checkPolicyDiffNamesOne (must-show 4): from the Machines' recorded measurements, find an index
// where exactly one machine differs from all the others; a policy that enforces the others' value
// there is stricter than the cluster's, and berth policy diff must name that one machine and no
// other. Without such an index (every machine recorded the same measurements) no policy on
// measurements can tell one machine apart (berth mini boots every genuine node from the same
// simulated image, and a Machine's evidence is recorded at its join, before its lock register is
// extended: all 24 PCRs agree); the check then says so and shows that diff names every machine for
// a policy that pins the boot register to another value.
func checkPolicyDiffNamesOne(t testing.TB, c *cluster) {
	t.Helper()
	var list v1alpha1.MachineList
	if err := json.Unmarshal([]byte(c.kube("-n", "berth-system", "get", "bm", "-o", "json")), &list); err != nil {
		t.Fatal(err)
	}
	byIndex := map[string]map[string][]string{} // index -> value -> nodes
	var admitted []string
	for _, m := range list.Items {
		if m.Status.State != v1alpha1.StateAdmitted || m.Status.Evidence == nil {
			continue
		}
		admitted = append(admitted, m.Spec.Node)
		t.Logf("machine %s (%s): evidence %s measurements %v", m.Spec.Node, m.Spec.Role, m.Status.Evidence.SHA256, m.Status.Evidence.Measurements)
		for i, v := range m.Status.Evidence.Measurements {
			if byIndex[i] == nil {
				byIndex[i] = map[string][]string{}
			}
			byIndex[i][v] = append(byIndex[i][v], m.Spec.Node)
		}
	}
	sort.Strings(admitted)
	var index, common, odd string
	indices := make([]string, 0, len(byIndex))
	for i := range byIndex {
		indices = append(indices, i)
	}
	sort.Strings(indices)
	for _, i := range indices {
		vals := byIndex[i]
		if len(vals) != 2 {
			continue
		}
		for v, nodes := range vals {
			if len(nodes) == 1 && len(admitted) > 2 || len(nodes) == 1 && len(admitted) == 2 && nodes[0] == admitted[1] {
				odd = nodes[0]
				for w := range vals {
					if w != v {
						common = w
					}
				}
			}
		}
		if odd != "" {
			index = i
			break
		}
	}
	wantRefused := []string{odd}
	if index == "" {
		t.Logf("POLICY DIFF: the %d admitted machines (%v) recorded the same value at every index: no measurement tells one apart", len(admitted), admitted)
		index, common, wantRefused = "4", strings.Repeat("ee", 32), admitted
	}
	// The policy the joinservice judges nodes by (berth mini's policy.yaml), not the join policy
	// nodes judge the joinservice by.
	oldPolicy := filepath.Join(c.dir, "policy.yaml")
	newPolicy := filepath.Join(t.TempDir(), "stricter-policy.yaml")
	writeStricterPolicy(t, oldPolicy, newPolicy, index, common)
	out := c.must(time.Minute, c.berth, "policy", "diff", oldPolicy, newPolicy, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "-o", "json")
	var d struct {
		NewlyRefused []struct {
			Node string `json:"node"`
		} `json:"newlyRefused"`
	}
	if err := json.Unmarshal([]byte(out), &d); err != nil {
		t.Fatalf("berth policy diff -o json: %v\n%s", err, out)
	}
	var refused []string
	for _, v := range d.NewlyRefused {
		refused = append(refused, v.Node)
	}
	sort.Strings(refused)
	t.Logf("POLICY DIFF with index %s pinned to %s: %s", index, common,
		c.must(time.Minute, c.berth, "policy", "diff", oldPolicy, newPolicy, "--kubeconfig", filepath.Join(c.dir, "admin.conf")))
	if !slices.Equal(refused, wantRefused) {
		t.Errorf("berth policy diff names %v as newly refused, want %v", refused, wantRefused)
	}
}

// writeStricterPolicy writes the policy at from with index's expectation replaced by value, enforced,
// to to.
func writeStricterPolicy(t testing.TB, from, to, index, value string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	root := doc.Content[0]
	var ms *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		if root.Content[i].Value == "measurements" {
			ms = root.Content[i+1]
		}
	}
	if ms == nil {
		t.Fatalf("%s has no measurements", from)
	}
	expectation := &yaml.Node{Kind: yaml.MappingNode, Style: yaml.FlowStyle, Content: []*yaml.Node{
		{Kind: yaml.ScalarNode, Value: "expected"}, {Kind: yaml.ScalarNode, Value: value, Style: yaml.DoubleQuotedStyle},
	}}
	replaced := false
	for i := 0; i+1 < len(ms.Content); i += 2 {
		if ms.Content[i].Value == index {
			ms.Content[i+1], replaced = expectation, true
		}
	}
	if !replaced {
		ms.Content = append(ms.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: index}, expectation)
	}
	out, err := yaml.Marshal(&doc)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, out, 0o600); err != nil {
		t.Fatal(err)
	}
}
