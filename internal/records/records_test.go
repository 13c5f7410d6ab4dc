package records_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

const ns = joinconfig.Namespace

func TestNameFor(t *testing.T) {
	attested := strings.Repeat("ab", 32)
	if got := records.NameFor(attested); got != attested {
		t.Errorf("NameFor(attested) = %q, want the identity", got)
	}
	a, b := records.NameFor("instance/w1"), records.NameFor("instance/W1")
	if !strings.HasPrefix(a, "instance-") || a == b || len(a) > 63 {
		t.Errorf("NameFor of instance identities = %q, %q: want distinct valid names", a, b)
	}
	if records.NameFor(strings.Repeat("AB", 32)) == strings.Repeat("AB", 32) {
		t.Error("an upper-case identity is not a valid object name and must be hashed")
	}
}

func TestRecordNameSeparatesKeys(t *testing.T) {
	base := v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassUnverified, Peer: "198.51.100.7", RPC: "join", Reason: "NO_EVIDENCE"}
	seen := map[string]string{}
	for what, s := range map[string]v1alpha1.JoinRecordSpec{
		"base":     base,
		"peer":     func() v1alpha1.JoinRecordSpec { s := base; s.Peer = "198.51.100.8"; return s }(),
		"reason":   func() v1alpha1.JoinRecordSpec { s := base; s.Reason = "RATE_LIMITED"; return s }(),
		"class":    func() v1alpha1.JoinRecordSpec { s := base; s.Class = v1alpha1.ClassEvidence; return s }(),
		"identity": func() v1alpha1.JoinRecordSpec { s := base; s.Class, s.Identity = v1alpha1.ClassEvidence, "x"; return s }(),
	} {
		n := records.RecordName(s)
		if other, dup := seen[n]; dup {
			t.Errorf("keys %s and %s share the record %s", what, other, n)
		}
		seen[n] = what
	}
	again := base
	if records.RecordName(base) != records.RecordName(again) {
		t.Error("RecordName is not deterministic")
	}
}

// env installs Berth (with the record API's CRDs) once and returns a typed client acting as the
// joinservice.
func env(t *testing.T) clientset.Interface {
	t.Helper()
	e := apiservertest.Shared(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if err := e.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	c, err := clientset.NewForConfig(e.Config(apiservertest.JoinServiceUser))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func fullMachine(identity string) *v1alpha1.Machine {
	now := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	return &v1alpha1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(identity), Namespace: ns},
		Spec:       v1alpha1.MachineSpec{Identity: identity, Node: "w1", Role: "worker"},
		Status: v1alpha1.MachineStatus{
			State: v1alpha1.StateAdmitted, Admitted: now,
			LastJoin: &v1alpha1.JoinSeen{Time: now, RPC: "join", Peer: "198.51.100.7", Replica: "cp1"},
			Evidence: &v1alpha1.Evidence{SHA256: strings.Repeat("0f", 32), Variant: "tpm",
				Measurements: map[string]string{"4": strings.Repeat("aa", 32), "9": strings.Repeat("bb", 32)}},
		},
	}
}

// TestMachineRoundTrip: every field of a Machine survives the API server's schema (nothing is
// pruned), and `kubectl get machines` shows the node, role and state columns.
func TestMachineRoundTrip(t *testing.T) {
	c := env(t)
	ctx := t.Context()
	want := fullMachine(strings.Repeat("1a", 32))
	if _, err := c.RecordsV1alpha1().Machines(ns).Create(ctx, want, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := c.RecordsV1alpha1().Machines(ns).Get(ctx, want.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if a, b := mustJSON(t, got.Spec, got.Status), mustJSON(t, want.Spec, want.Status); a != b {
		t.Errorf("read back\n%s\nwant\n%s", a, b)
	}
	raw, err := c.RecordsV1alpha1().RESTClient().Get().Namespace(ns).Resource(records.MachinePlural).Name(want.Name).
		SetHeader("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io").Do(ctx).Raw()
	if err != nil {
		t.Fatal(err)
	}
	var table metav1.Table
	if err := json.Unmarshal(raw, &table); err != nil {
		t.Fatal(err)
	}
	var cols []string
	for _, col := range table.ColumnDefinitions {
		cols = append(cols, col.Name)
	}
	for _, col := range []string{"Node", "Role", "State", "Last Join"} {
		if !slices.Contains(cols, col) {
			t.Errorf("columns %q lack %q", cols, col)
		}
	}
	if len(table.Rows) != 1 || len(table.Rows[0].Cells) < 4 || table.Rows[0].Cells[1] != "w1" || table.Rows[0].Cells[3] != "Admitted" {
		t.Errorf("table rows = %v, want w1 Admitted", table.Rows)
	}
}

// TestSchemaRefuses: the schema and its CEL rules refuse what no writer may write.
func TestSchemaRefuses(t *testing.T) {
	c := env(t)
	ctx := t.Context()
	machines := c.RecordsV1alpha1().Machines(ns)
	base := fullMachine(strings.Repeat("2b", 32))
	if _, err := machines.Create(ctx, base, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	now := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	for name, tc := range map[string]struct {
		change func(m *v1alpha1.Machine)
		update bool
		want   string
	}{
		"identity changed":        {func(m *v1alpha1.Machine) { m.Spec.Identity = strings.Repeat("3c", 32) }, true, "identity never changes"},
		"removed without time":    {func(m *v1alpha1.Machine) { m.Status.State = v1alpha1.StateRemoved }, true, "removed is set exactly"},
		"admitted with a removal": {func(m *v1alpha1.Machine) { m.Status.Removed = &now }, true, "removed is set exactly"},
		"unknown state":           {func(m *v1alpha1.Machine) { m.Status.State = "Gone" }, true, "Unsupported value"},
		"unknown role":            {func(m *v1alpha1.Machine) { m.Spec.Role = "etcd" }, false, "Unsupported value"},
		"bad digest":              {func(m *v1alpha1.Machine) { m.Status.Evidence.SHA256 = "zz" }, false, "status.evidence.sha256"},
		"bad measurement index":   {func(m *v1alpha1.Machine) { m.Status.Evidence.Measurements["x"] = "aa" }, false, "indices are decimal"},
	} {
		t.Run(name, func(t *testing.T) {
			var err error
			if tc.update {
				m, gerr := machines.Get(ctx, base.Name, metav1.GetOptions{})
				if gerr != nil {
					t.Fatal(gerr)
				}
				tc.change(m)
				_, err = machines.Update(ctx, m, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
			} else {
				m := fullMachine(strings.Repeat("4d", 32))
				tc.change(m)
				_, err = machines.Create(ctx, m, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			}
			if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want Invalid with %q", err, tc.want)
			}
		})
	}
	jr := c.RecordsV1alpha1().JoinRecords(ns)
	record := func() *v1alpha1.JoinRecord {
		spec := v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassUnverified, Peer: "198.51.100.9", RPC: "join", Reason: "NO_EVIDENCE"}
		return &v1alpha1.JoinRecord{ObjectMeta: metav1.ObjectMeta{Name: records.RecordName(spec), Namespace: ns}, Spec: spec,
			Status: v1alpha1.JoinRecordStatus{Count: 1, First: now, Last: now}}
	}
	for name, tc := range map[string]struct {
		change func(r *v1alpha1.JoinRecord)
		want   string
	}{
		"last before first":        {func(r *v1alpha1.JoinRecord) { r.Status.First = metav1.NewTime(now.Add(time.Hour)) }, "not before the first"},
		"unverified with identity": {func(r *v1alpha1.JoinRecord) { r.Spec.Identity = "x" }, "only an evidence record"},
		"no count":                 {func(r *v1alpha1.JoinRecord) { r.Status.Count = 0 }, "status.count"},
		"unknown class":            {func(r *v1alpha1.JoinRecord) { r.Spec.Class = "accepted" }, "Unsupported value"},
	} {
		t.Run(name, func(t *testing.T) {
			r := record()
			tc.change(r)
			_, err := jr.Create(ctx, r, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want Invalid with %q", err, tc.want)
			}
		})
	}
	// The valid record is admitted: the refusals above are the rules', not the fixture's.
	if _, err := jr.Create(ctx, record(), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Fatalf("valid record refused: %v", err)
	}
}

func mustJSON(t *testing.T, vs ...any) string {
	t.Helper()
	b, err := json.Marshal(vs)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
