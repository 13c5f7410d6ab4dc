//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/mini"
	"github.com/berth-k8s/berth/internal/upgradeplan"
)

// checkUpgradePlan runs berth upgrade plan on a cluster at the previous minor: the default plan
// moves it one minor up, control planes first; a plan with a new policy whose simulated boot
// measurement is the one of a next image (every other expectation the cluster's own) names every
// joined machine, since each one recorded the current image's boot. The mini cluster's machines all
// boot the same image, so no policy can refuse one of them and not another without editing a
// record; the unit tests (internal/upgradeplan, internal/cli) show that the others are not named.
func checkUpgradePlan(t testing.TB, c *cluster, prev k8sversion.Release) {
	t.Helper()
	kc := filepath.Join(c.dir, "admin.conf")
	out := c.must(time.Minute, c.berth, "upgrade", "plan", "--kubeconfig", kc)
	t.Logf("berth upgrade plan:\n%s", out)
	if want := prev.Kubernetes + " -> " + k8sversion.Default().Kubernetes + " (minor)"; !strings.Contains(out, want) {
		t.Errorf("berth upgrade plan does not show %q", want)
	}

	current := c.kube("get", "configmap", "-n", joinconfig.Namespace, joinconfig.JoinConfigName, "-o", "jsonpath={.data."+joinconfig.KeyAttestationPolicy+"}")
	genuine := mini.ExpectedBootPCR()
	if !strings.Contains(current, genuine) {
		t.Fatalf("the cluster's join policy does not expect the genuine boot %s:\n%s", genuine, current)
	}
	sum := sha256.Sum256([]byte("the boot measurement of a next node image"))
	next := filepath.Join(c.dir, "next-policy.yaml")
	if err := os.WriteFile(next, []byte(strings.ReplaceAll(current, genuine, hex.EncodeToString(sum[:]))), 0o600); err != nil {
		t.Fatal(err)
	}
	out = c.must(time.Minute, c.berth, "upgrade", "plan", "--kubeconfig", kc, "--policy", next)
	t.Logf("berth upgrade plan --policy next-policy.yaml:\n%s", out)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, c.berth, "upgrade", "plan", "--kubeconfig", kc, "--policy", next, "-o", "json")
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("berth upgrade plan -o json: %v\n%s", err, stderr.String())
	}
	var plan upgradeplan.Report
	if err := json.Unmarshal(stdout.Bytes(), &plan); err != nil {
		t.Fatalf("berth upgrade plan -o json: %v\n%s", err, stdout.String())
	}
	var order []string
	for _, s := range plan.Order {
		order = append(order, s.Node+"/"+s.Gate)
	}
	if got := strings.Join(order, " "); got != "cp1/"+upgradeplan.GateControlPlaneSlot+" w1/"+upgradeplan.GateDrain {
		t.Errorf("upgrade order = %q, want cp1 through the slot, then w1", got)
	}
	d := plan.Policy.Machines
	if d == nil || d.Judged == 0 {
		t.Fatalf("no machine judged: %+v", d)
	}
	refused := map[string]bool{}
	for _, v := range d.NewlyRefused {
		refused[v.Node] = true
	}
	if !refused["w1"] || len(d.NewlyRefused) != d.Judged {
		t.Errorf("the next image's policy refuses %+v of %d judged machines, want every one, w1 among them", d.NewlyRefused, d.Judged)
	}
	if plan.Kubernetes.Change != upgradeplan.ChangeMinor || len(plan.Kubernetes.Components) != 2 || strings.Join(plan.Kubernetes.Components[0].Current, ",") != prev.Etcd {
		t.Errorf("versions = %+v, want a minor step from etcd %s", plan.Kubernetes, prev.Etcd)
	}
}
