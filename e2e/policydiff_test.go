//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/mini"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// checkPolicyDiffNamesOne (must-show 4): a fleet in the middle of an image rollout. w2 reboots into
// a new image (berth mini restart --tamper-boot: another boot measurement in PCR 4); its sealed key
// no longer unseals and its rejoin is refused. The operator takes the new value from the refusal
// (berth status), widens the cluster's policy to admit both images (berth policy merge --keep) and
// reboots w2, which rejoins and records the new evidence on its Machine. Then berth policy diff from
// the widened policy to one that retires the new image names exactly w2, and to one that retires the
// old image names exactly the other admitted machines. It leaves w2 on the new image and the cluster
// on the widened policy: nothing after it in TestMiniCluster depends on either.
func checkPolicyDiffNamesOne(t testing.TB, c *cluster) {
	t.Helper()
	start := time.Now()
	kc := filepath.Join(c.dir, "admin.conf")
	dir := t.TempDir()
	genuine := mini.ExpectedBootPCR()

	// 1. w2 boots the new image; the cluster's policy refuses it, and the refusal says what it measured.
	w2IP := nodeIP(t, c.dir, "w2")
	logW2 := filepath.Join(c.dir, "nodes", "w2", "logs", "bootstrapper.log")
	mark := logSize(t, logW2)
	c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w2", "--tamper-boot", "w2")
	waitLog(t, logW2, mark, "rejoin refused", 2*time.Minute)
	next := refusedBootValue(t, c, w2IP, genuine)
	t.Logf("POLICY DIFF: w2 on the new image was refused; its boot register measures %s, the cluster expects %s", next, genuine)

	// 2. The operator widens the policy in force to both images, the way a rollout does.
	current := c.kube("get", "configmap", "-n", joinconfig.Namespace, joinconfig.JoinConfigName, "-o", "jsonpath={.data."+joinconfig.KeyAttestationPolicy+"}")
	if !strings.Contains(current, genuine) {
		t.Fatalf("the cluster's policy does not expect the genuine boot %s:\n%s", genuine, current)
	}
	oldPolicy := filepath.Join(dir, "old-image-policy.yaml")
	measurements := filepath.Join(dir, "new-image.measurements.yaml")
	writeFile(t, oldPolicy, current)
	writeFile(t, measurements, fmt.Sprintf(`apiVersion: config.berth.dev/v1alpha1
kind: AttestationPolicy
variant: tpm
measurements:
  %d:
    expected: %s
    source: the new node image (w2's refused boot)
`, mini.BootPCR, next))
	rolling := filepath.Join(dir, "rolling-policy.yaml")
	writeFile(t, rolling, c.stdout(t, "policy", "merge", "--policy", oldPolicy, "--measurements", measurements, "--keep"))
	newOnly := filepath.Join(dir, "new-image-policy.yaml")
	writeFile(t, newOnly, c.stdout(t, "policy", "merge", "--policy", oldPolicy, "--measurements", measurements))
	applyPolicy(t, c, rolling)

	// 3. w2 reboots on the new image again and is admitted under the widened policy.
	mark = logSize(t, logW2)
	c.must(5*time.Minute, c.berth, "mini", "restart", "--dir", c.dir, "w2")
	waitLog(t, logW2, mark, `"source":"rejoin"`, 2*time.Minute)
	c.kube("wait", "--for=condition=Ready", "node/w2", "--timeout=120s")
	machines := admittedEvidence(t, c, "w2", next)
	var others []string
	for node, boot := range machines {
		if node == "w2" {
			continue
		}
		if boot != genuine {
			t.Errorf("machine %s recorded boot %s, want the old image's %s", node, boot, genuine)
		}
		others = append(others, node)
	}
	sort.Strings(others)
	if len(others) == 0 {
		t.Fatalf("no admitted machine besides w2 has recorded evidence: %v", machines)
	}

	// 4. Retiring the new image refuses exactly w2; retiring the old one exactly the others.
	for _, tc := range []struct {
		name, policy string
		want         []string
	}{
		{"retires the new image", oldPolicy, []string{"w2"}},
		{"retires the old image", newOnly, others},
	} {
		t.Logf("POLICY DIFF rolling-policy.yaml -> %s (%s):\n%s", filepath.Base(tc.policy), tc.name,
			c.stdout(t, "policy", "diff", rolling, tc.policy, "--kubeconfig", kc))
		var d struct {
			Judged       int `json:"judged"`
			NewlyRefused []struct {
				Node string `json:"node"`
			} `json:"newlyRefused"`
			NewlyAccepted []json.RawMessage `json:"newlyAccepted"`
		}
		out := c.stdout(t, "policy", "diff", rolling, tc.policy, "--kubeconfig", kc, "-o", "json")
		if err := json.Unmarshal([]byte(out), &d); err != nil {
			t.Fatalf("berth policy diff -o json: %v\n%s", err, out)
		}
		refused := []string{}
		for _, v := range d.NewlyRefused {
			refused = append(refused, v.Node)
		}
		sort.Strings(refused)
		if !slices.Equal(refused, tc.want) || len(d.NewlyAccepted) != 0 || d.Judged != len(machines) {
			t.Errorf("policy that %s: judged %d, newly refused %v, newly accepted %d; want %d judged, exactly %v refused, none accepted",
				tc.name, d.Judged, refused, len(d.NewlyAccepted), len(machines), tc.want)
		}
	}
	t.Logf("POLICY DIFF check took %.1fs", time.Since(start).Seconds())
}

// bootMismatch is how the join ledger, shown by berth status, explains a refused boot measurement.
var bootMismatch = regexp.MustCompile(`index ` + strconv.Itoa(mini.BootPCR) + `: expected ([0-9a-f]{64}), got ([0-9a-f]{64})`)

// refusedBootValue polls berth status until the join ledger lists a MEASUREMENT_MISMATCH of peer
// for the boot register against the expected value, and returns the value the peer measured.
func refusedBootValue(t testing.TB, c *cluster, peer, expected string) string {
	t.Helper()
	var out, got string
	err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		var err error
		if out, err = c.run(time.Minute, c.berth, "status", "--kubeconfig", filepath.Join(c.dir, "admin.conf")); err != nil {
			return false, nil
		}
		for _, line := range strings.Split(out, "\n") {
			f := strings.Fields(line)
			if len(f) < 2 || f[1] != peer || !strings.Contains(line, "MEASUREMENT_MISMATCH") {
				continue
			}
			if m := bootMismatch.FindStringSubmatch(line); m != nil && m[1] == expected && m[2] != expected {
				got = m[2]
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("berth status lists no boot measurement mismatch of %s:\n%s", peer, out)
	}
	return got
}

// applyPolicy puts the policy file into the cluster's join ConfigMap and waits until the
// joinservice's Event says that version is in force.
func applyPolicy(t testing.TB, c *cluster, path string) {
	t.Helper()
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	patch, err := json.Marshal(map[string]any{"data": map[string]string{joinconfig.KeyAttestationPolicy: string(text)}})
	if err != nil {
		t.Fatal(err)
	}
	rv := c.kube("patch", "configmap", "-n", joinconfig.Namespace, joinconfig.JoinConfigName, "--type", "merge", "-p", string(patch),
		"-o", "jsonpath={.metadata.resourceVersion}")
	want := "resourceVersion " + strings.TrimSpace(rv) + ")"
	if out, ok := c.kubeEventually(time.Minute, want, "get", "events", "-n", joinconfig.Namespace,
		"--field-selector", "reason=PolicyApplied", "-o", "jsonpath={.items[*].message}"); !ok {
		t.Fatalf("no PolicyApplied Event for %s: %s", want, out)
	}
	t.Logf("policy %s in force (%s)", filepath.Base(path), want)
}

// admittedEvidence polls the Machines until node's recorded evidence measures bootValue in the boot
// register, and returns the boot register of every admitted machine with recorded evidence.
func admittedEvidence(t testing.TB, c *cluster, node, bootValue string) map[string]string {
	t.Helper()
	key := strconv.Itoa(mini.BootPCR)
	var boots map[string]string
	err := wait.PollUntilContextTimeout(context.Background(), time.Second, time.Minute, true, func(context.Context) (bool, error) {
		out, err := c.run(time.Minute, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "-n", "berth-system", "get", "bm", "-o", "json")
		if err != nil {
			return false, nil
		}
		var list v1alpha1.MachineList
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			return false, nil
		}
		boots = map[string]string{}
		for _, m := range list.Items {
			if m.Status.State == v1alpha1.StateAdmitted && m.Status.Evidence != nil {
				boots[m.Spec.Node] = m.Status.Evidence.Measurements[key]
			}
		}
		return boots[node] == bootValue, nil
	})
	t.Logf("admitted machines' recorded boot register: %v", boots)
	if err != nil {
		t.Fatalf("machine %s did not record the boot %s: %v", node, bootValue, boots)
	}
	return boots
}

// stdout runs berth with args and returns its standard output alone; it fails the test with the
// standard error if berth fails.
func (c *cluster) stdout(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, c.berth, args...)
	cmd.Dir = c.root
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("berth %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String()
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}
