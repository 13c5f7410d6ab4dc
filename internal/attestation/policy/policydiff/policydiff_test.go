package policydiff

import (
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

func diffMachine(node, id string, state v1alpha1.MachineState, ev *v1alpha1.Evidence) v1alpha1.Machine {
	return v1alpha1.Machine{Spec: v1alpha1.MachineSpec{Identity: strings.Repeat(id, 64), Node: node, Role: "worker"},
		Status: v1alpha1.MachineStatus{State: state, Evidence: ev}}
}

// TestJudgeNamesTheRefusedMachine: a stricter policy (PCR 9 pinned to the value two of three
// machines measured) refuses exactly the third, by name; a removed machine, a machine without
// evidence, one of another variant and one with an unreadable value are not judged as admitted ones.
func TestJudgeNamesTheRefusedMachine(t *testing.T) {
	zero, ones, twos := strings.Repeat("00", 32), strings.Repeat("11", 32), strings.Repeat("22", 32)
	oldPolicy, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+zero+"}\n"), "old", nil)
	if err != nil {
		t.Fatal(err)
	}
	newPolicy, err := policy.Parse([]byte("variant: tpm\nmeasurements:\n  4: {expected: "+zero+"}\n  9: {expected: "+ones+"}\n"), "new", nil)
	if err != nil {
		t.Fatal(err)
	}
	ev := func(pcr9 string) *v1alpha1.Evidence {
		return &v1alpha1.Evidence{SHA256: strings.Repeat("ab", 32), Variant: "tpm", Measurements: map[string]string{"4": zero, "9": pcr9}}
	}
	ms := []v1alpha1.Machine{
		diffMachine("w1", "1", v1alpha1.StateAdmitted, ev(ones)),
		diffMachine("w2", "2", v1alpha1.StateAdmitted, ev(twos)),
		diffMachine("w3", "3", v1alpha1.StateAdmitted, ev(ones)),
		diffMachine("w4", "4", v1alpha1.StateRemoved, ev(twos)),
		diffMachine("w5", "5", v1alpha1.StateAdmitted, nil),
		diffMachine("w6", "6", v1alpha1.StateAdmitted, &v1alpha1.Evidence{SHA256: strings.Repeat("cd", 32), Variant: "tdx"}),
		diffMachine("w7", "7", v1alpha1.StateAdmitted, &v1alpha1.Evidence{SHA256: strings.Repeat("ef", 32), Variant: "tpm", Measurements: map[string]string{"4": "zz"}}),
	}
	d := Judge(oldPolicy, newPolicy, ms)
	if d.Judged != 3 || len(d.NewlyRefused) != 1 || d.NewlyRefused[0].Node != "w2" || len(d.NewlyAccepted) != 0 {
		t.Fatalf("diff = %+v, want 3 judged and only w2 refused", d)
	}
	if !strings.Contains(d.NewlyRefused[0].Reason, "index 9") || !strings.Contains(d.NewlyRefused[0].Reason, twos) {
		t.Errorf("w2's reason %q does not name PCR 9 and its value", d.NewlyRefused[0].Reason)
	}
	if len(d.Unjudged) != 3 || d.Unjudged[0].Node != "w5" || d.Unjudged[1].Node != "w6" || d.Unjudged[2].Node != "w7" {
		t.Errorf("unjudged = %+v, want w5 (no evidence), w6 (tdx) and w7 (unreadable)", d.Unjudged)
	} else if !strings.Contains(d.Unjudged[2].Reason, "recorded measurement 4") {
		t.Errorf("w7's reason %q does not name the unreadable measurement", d.Unjudged[2].Reason)
	}
	// The other way round, w2 is the one the looser policy accepts again.
	back := Judge(newPolicy, oldPolicy, ms)
	if len(back.NewlyRefused) != 0 || len(back.NewlyAccepted) != 1 || back.NewlyAccepted[0].Node != "w2" {
		t.Errorf("reverse diff = %+v, want only w2 accepted again", back)
	}
}
