package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/internal/upgradeplan"
)

// TestUpgradePlan: berth upgrade plan against a real API server names the machine whose recorded
// evidence the new policy refuses (text and JSON), prints the same JSON twice, and refuses a
// downgrade and an unsupported release with exit code 2.
func TestUpgradePlan(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	zero, ones, twos := strings.Repeat("00", 32), strings.Repeat("11", 32), strings.Repeat("22", 32)
	clusterPolicy := "variant: tpm\nmeasurements:\n  4: {expected: " + zero + "}\n"
	if err := env.InstallBerth(ctx, clusterPolicy); err != nil {
		t.Fatal(err)
	}
	rc, err := clientset.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	ns := joinconfig.Namespace
	clear := func() {
		if err := rc.RecordsV1alpha1().Machines(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	clear()
	t.Cleanup(clear)
	for _, m := range []struct{ node, id, pcr9 string }{{"w-good", "a1", ones}, {"w-bad\x1b[31m", "b2", twos}} {
		id := strings.Repeat(m.id, 32)
		if _, err := rc.RecordsV1alpha1().Machines(ns).Create(ctx, &v1alpha1.Machine{
			ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(id), Namespace: ns},
			Spec:       v1alpha1.MachineSpec{Identity: id, Node: m.node, Role: "worker"},
			Status: v1alpha1.MachineStatus{State: v1alpha1.StateAdmitted, Admitted: metav1.Now(),
				Evidence: &v1alpha1.Evidence{SHA256: strings.Repeat("ab", 32), Variant: "tpm", Measurements: map[string]string{"4": zero, "9": m.pcr9}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.AdminUser)
	if err != nil {
		t.Fatal(err)
	}
	next := filepath.Join(t.TempDir(), "next.yaml")
	if err := os.WriteFile(next, []byte(clusterPolicy+"  9: {expected: "+ones+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := Execute(ctx, append([]string{"upgrade", "plan", "--kubeconfig", kubeconfig}, args...), &out, &errOut)
		return code, out.String(), errOut.String()
	}

	code, text, stderr := run("--policy", next)
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	t.Logf("plan:\n%s", text)
	if !strings.Contains(text, "REFUSED BY THE NEW POLICY: 1") || !strings.Contains(text, `w-bad\x1b[31m`) || strings.Contains(text, "\x1b") {
		t.Errorf("text plan does not name w-bad once, escaped:\n%q", text)
	}
	if !strings.Contains(text, "control planes one at a time, each holding the control-plane slot") {
		t.Errorf("text plan does not say how control planes take turns:\n%s", text)
	}

	_, first, _ := run("--policy", next, "-o", "json")
	code, second, stderr := run("--policy", next, "-o", "json")
	if code != exitOK || first != second {
		t.Fatalf("exit %d (%s); two JSON plans differ:\n%s\n%s", code, stderr, first, second)
	}
	var plan upgradeplan.Report
	if err := json.Unmarshal([]byte(first), &plan); err != nil {
		t.Fatal(err)
	}
	if plan.Policy.Machines == nil || len(plan.Policy.Machines.NewlyRefused) != 1 || plan.Policy.Machines.NewlyRefused[0].Node != "w-bad\x1b[31m" {
		t.Errorf("JSON plan's judgement = %+v, want only w-bad refused", plan.Policy.Machines)
	}
	for _, field := range []string{`"kubernetes"`, `"apiServer"`, `"target"`, `"order"`, `"policy"`, `"newlyRefused"`, `"measurements"`, `"omitted"`} {
		if !strings.Contains(first, field) {
			t.Errorf("JSON plan lacks the field %s", field)
		}
	}

	older := k8sversion.Supported()[len(k8sversion.Supported())-1]
	code, _, stderr = run("--kubernetes-version", older.Minor())
	if code != exitUsage || !strings.Contains(stderr, "downgrade") {
		t.Errorf("plan to %s: exit %d, %s; want exit 2 naming the downgrade", older.Minor(), code, stderr)
	}
	code, _, stderr = run("--kubernetes-version", "v1.20")
	if code != exitUsage || !strings.Contains(stderr, "unsupported Kubernetes version") {
		t.Errorf("plan to v1.20: exit %d, %s; want exit 2 naming the unsupported version", code, stderr)
	}
}
