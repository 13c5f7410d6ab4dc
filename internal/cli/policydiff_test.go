package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation/policy/policydiff"
)

// TestPrintPolicyDiff: the table names the refused machine under its section's count and escapes
// what the record holds (the judgement itself is policydiff's, tested there).
func TestPrintPolicyDiff(t *testing.T) {
	d := policydiff.Report{Judged: 2, NewlyRefused: []policydiff.Verdict{{Node: "w2\x1b[31m", Identity: strings.Repeat("2", 64), Role: "worker", Reason: "index 9: expected 11, got 22"}},
		NewlyAccepted: []policydiff.Verdict{}, Unjudged: []policydiff.Verdict{}}
	var out bytes.Buffer
	printPolicyDiff(&out, d)
	s := out.String()
	if !strings.Contains(s, "REFUSED BY THE NEW POLICY (admitted under the old one): 1") || !strings.Contains(s, "w2") || !strings.Contains(s, "index 9") {
		t.Errorf("printed diff:\n%s", s)
	}
	if strings.Contains(s, "\x1b") {
		t.Errorf("printed diff carries a raw escape:\n%q", s)
	}
}
