package upgradeplan

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

var (
	zero = strings.Repeat("00", 32)
	ones = strings.Repeat("11", 32)
	twos = strings.Repeat("22", 32)
)

// clusterPolicy pins PCR 4; stricterPolicy also pins PCR 9 to the value all machines but one measured.
const clusterPolicyFmt = "variant: tpm\nmeasurements:\n  4: {expected: %s}\n"

func mustPolicy(t *testing.T, doc string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(doc), "test", nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestPlanAgainstAPIServer: against a real API server with two control planes, two workers and their
// Machines, the plan orders the control planes first through the slot, then the workers; a stricter
// policy names exactly the machine whose recorded evidence fails it; a downgrade and a kubelet two
// minors behind the target are refused with their named errors; the report is the same document
// twice.
func TestPlanAgainstAPIServer(t *testing.T) {
	env := apiservertest.Start(t)
	ctx := context.Background()
	clusterPolicy := strings.Replace(clusterPolicyFmt, "%s", zero, 1)
	if err := env.InstallBerth(ctx, clusterPolicy); err != nil {
		t.Fatal(err)
	}
	kube := env.Client(t, apiservertest.AdminUser)
	rc, err := clientset.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	sv, err := kube.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	addNode := func(name string, controlPlane bool, kubelet string) {
		t.Helper()
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
		if controlPlane {
			n.Labels[controlPlaneLabel] = ""
		}
		n, err := kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n.Status.NodeInfo.KubeletVersion = kubelet
		if _, err := kube.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Created out of order: the plan sorts.
	addNode("w-2", false, sv.GitVersion)
	addNode("cp-2", true, sv.GitVersion)
	addNode("w-1", false, sv.GitVersion)
	addNode("cp-1", true, sv.GitVersion)
	addMachine := func(node, id, role string, pcr9 string) {
		t.Helper()
		identity := strings.Repeat(id, 64)
		var ev *v1alpha1.Evidence
		if pcr9 != "" {
			ev = &v1alpha1.Evidence{SHA256: strings.Repeat("ab", 32), Variant: "tpm", Measurements: map[string]string{"4": zero, "9": pcr9}}
		}
		if _, err := rc.RecordsV1alpha1().Machines(joinconfig.Namespace).Create(ctx, &v1alpha1.Machine{
			ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(identity), Namespace: joinconfig.Namespace},
			Spec:       v1alpha1.MachineSpec{Identity: identity, Node: node, Role: role},
			Status:     v1alpha1.MachineStatus{State: v1alpha1.StateAdmitted, Admitted: metav1.Now(), Evidence: ev},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	addMachine("cp-1", "1", "control-plane", ones)
	addMachine("cp-2", "2", "control-plane", "")
	addMachine("w-1", "3", "worker", ones)
	addMachine("w-2", "4", "worker", twos)

	t.Run("order and kept policy", func(t *testing.T) {
		p, err := Plan(ctx, kube, rc, Options{Namespace: joinconfig.Namespace})
		if err != nil {
			t.Fatal(err)
		}
		if p.Kubernetes.APIServer != sv.GitVersion || p.Kubernetes.Target != k8sversion.Default().Kubernetes {
			t.Errorf("versions = %+v", p.Kubernetes)
		}
		lease := joinconfig.Namespace + "/" + cpslot.LeaseName
		want := []Step{
			{Step: 1, Node: "cp-1", Role: "control-plane", Gate: GateControlPlaneSlot, Lease: lease},
			{Step: 2, Node: "cp-2", Role: "control-plane", Gate: GateControlPlaneSlot, Lease: lease},
			{Step: 3, Node: "w-1", Role: "worker", Gate: GateDrain},
			{Step: 4, Node: "w-2", Role: "worker", Gate: GateDrain},
		}
		if !reflect.DeepEqual(p.Order, want) {
			t.Errorf("order = %+v, want %+v", p.Order, want)
		}
		if p.Policy.Changed || p.Policy.Machines != nil || len(p.Policy.Measurements) != 1 || p.Policy.Measurements[0].Before != zero+" (enforce)" {
			t.Errorf("kept policy = %+v", p.Policy)
		}
		if len(p.Kubernetes.Components) != 2 || p.Kubernetes.Components[0].Target != k8sversion.Default().Etcd {
			t.Errorf("components = %+v", p.Kubernetes.Components)
		}
	})

	t.Run("stricter policy names the refused machine", func(t *testing.T) {
		stricter := mustPolicy(t, clusterPolicy+"  9: {expected: "+ones+"}\n")
		opts := Options{Namespace: joinconfig.Namespace, NewPolicy: stricter, NewPolicySource: "next.yaml"}
		p, err := Plan(ctx, kube, rc, opts)
		if err != nil {
			t.Fatal(err)
		}
		d := p.Policy.Machines
		if d == nil || d.Judged != 3 || len(d.NewlyRefused) != 1 || d.NewlyRefused[0].Node != "w-2" {
			t.Fatalf("judgement = %+v, want 3 judged and only w-2 refused", d)
		}
		if !strings.Contains(d.NewlyRefused[0].Reason, "index 9") {
			t.Errorf("w-2's reason %q does not name index 9", d.NewlyRefused[0].Reason)
		}
		if len(d.Unjudged) != 1 || d.Unjudged[0].Node != "cp-2" {
			t.Errorf("unjudged = %+v, want cp-2 (no evidence)", d.Unjudged)
		}
		if !p.Policy.Changed || len(p.Policy.Measurements) != 2 || !p.Policy.Measurements[1].Changed || p.Policy.Measurements[1].Before != "" {
			t.Errorf("policy change = %+v, want index 9 added", p.Policy)
		}
		// The same cluster gives the same document.
		again, err := Plan(ctx, kube, rc, opts)
		if err != nil {
			t.Fatal(err)
		}
		a, _ := json.Marshal(p)
		b, _ := json.Marshal(again)
		if string(a) != string(b) {
			t.Errorf("two plans differ:\n%s\n%s", a, b)
		}
	})

	t.Run("downgrade refused", func(t *testing.T) {
		older := k8sversion.Supported()[len(k8sversion.Supported())-1]
		if older.Minor() == k8sversion.Default().Minor() {
			t.Fatal("the version table has one minor: no downgrade to test")
		}
		_, err := Plan(ctx, kube, rc, Options{Namespace: joinconfig.Namespace, Target: older.Minor()})
		if !errors.Is(err, ErrDowngrade) || !strings.Contains(err.Error(), "API server") {
			t.Errorf("plan to %s: %v, want ErrDowngrade naming the API server", older, err)
		}
	})

	t.Run("kubelet two minors behind refused", func(t *testing.T) {
		addNode("w-old", false, "v1.0.0")
		defer func() {
			if err := kube.CoreV1().Nodes().Delete(ctx, "w-old", metav1.DeleteOptions{}); err != nil {
				t.Error(err)
			}
		}()
		_, err := Plan(ctx, kube, rc, Options{Namespace: joinconfig.Namespace})
		if !errors.Is(err, ErrMinorSkip) || !strings.Contains(err.Error(), "w-old") {
			t.Errorf("plan with an old kubelet: %v, want ErrMinorSkip naming w-old", err)
		}
	})

	t.Run("unsupported target refused", func(t *testing.T) {
		_, err := Plan(ctx, kube, rc, Options{Namespace: joinconfig.Namespace, Target: "v1.20"})
		if !errors.Is(err, k8sversion.ErrUnsupported) {
			t.Errorf("plan to v1.20: %v, want ErrUnsupported", err)
		}
	})
}

// TestVersionsRules: the step from the API server's version to the target, and the refusals.
func TestVersionsRules(t *testing.T) {
	target := k8sversion.Release{Kubernetes: "v1.37.2"}
	for _, tc := range []struct {
		apiServer string
		want      string
		err       error
	}{
		{"v1.37.2", ChangeNone, nil},
		{"v1.37.1", ChangePatch, nil},
		{"v1.36.3", ChangeMinor, nil},
		{"v1.36.9+k3s1", ChangeMinor, nil},
		{"v1.35.0", "", ErrMinorSkip},
		{"v1.37.3", "", ErrDowngrade},
		{"v1.38.0", "", ErrDowngrade},
		{"v2.37.2", "", ErrDowngrade},
		{"v0.37.2", "", ErrMinorSkip},
	} {
		v, err := versions(tc.apiServer, nil, target)
		if !errors.Is(err, tc.err) || (err == nil && v.Change != tc.want) {
			t.Errorf("API server %s: change %q, err %v; want %q, %v", tc.apiServer, v.Change, err, tc.want, tc.err)
		}
	}
	if _, err := versions("not a version", nil, target); err == nil {
		t.Error("an unparsable API server version was accepted")
	}
}
