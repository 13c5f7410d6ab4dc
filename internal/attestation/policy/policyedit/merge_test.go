package policyedit

import (
	"bytes"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/uki"
)

const (
	oldPCR4 = "1111111111111111111111111111111111111111111111111111111111111111"
	newPCR4 = "4444444444444444444444444444444444444444444444444444444444444444"
	pcr11   = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

func writeFiles(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestMerge(t *testing.T) {
	dir := writeFiles(t, map[string]string{
		"cluster.yaml": "# the cluster's policy\nvariant: tpm\nmeasurements:\n  4: {expected: " + oldPCR4 + ", source: image 1}\n  15: {nonZero: true} # lock register\n",
		"image.yaml":   "variant: tpm\nmeasurements:\n  4: {expected: " + newPCR4 + ", source: image 2}\n  11: {expected: " + pcr11 + ", source: image 2}\n",
		"tdx.yaml":     "variant: tdx\nmeasurements:\n  1: {expected: " + pcr11 + "}\n",
	})
	out, err := Merge(filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "image.yaml"), false)
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.Parse(out, "merged", nil)
	if err != nil {
		t.Fatal(err)
	}
	got := map[uint32]string{}
	for _, e := range p.Expectations {
		got[e.Index] = e.Source
		if e.Index == 4 && (len(e.AnyOf) != 1 || !bytes.Equal(e.AnyOf[0], mustHex(t, newPCR4))) {
			t.Errorf("PCR 4 expects %x, want only the new value", e.AnyOf)
		}
		if e.Index == 15 && !e.NonZero {
			t.Error("PCR 15 lost its nonZero")
		}
	}
	if len(got) != 3 || !strings.Contains(got[11], "image 2") {
		t.Errorf("merged indices and sources = %v, want 4, 11 (from image 2) and 15", got)
	}
	if !strings.Contains(string(out), "# the cluster's policy") || !strings.Contains(string(out), "# lock register") {
		t.Errorf("comments were lost:\n%s", out)
	}

	// keep: the old PCR 4 stays accepted next to the new one.
	out, err = Merge(filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "image.yaml"), true)
	if err != nil {
		t.Fatal(err)
	}
	p, err = policy.Parse(out, "merged", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range p.Expectations {
		if e.Index == 4 && len(e.AnyOf) != 2 {
			t.Errorf("with keep PCR 4 accepts %d values, want 2", len(e.AnyOf))
		}
	}

	if _, err := Merge(filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "tdx.yaml"), false); err == nil {
		t.Error("merging tdx measurements into a tpm policy = nil error")
	}
	if _, err := Merge(filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "missing.yaml"), false); err == nil {
		t.Error("merging a missing file = nil error")
	}
}

// What Measurements renders is a policy that Merge takes: the predicted values, in PCR order, each
// expectation naming its source.
func TestMeasurements(t *testing.T) {
	var p4, p11 [32]byte
	copy(p4[:], mustHex(t, newPCR4))
	copy(p11[:], mustHex(t, pcr11))
	out, err := Measurements(&uki.Prediction{PCRs: map[int][32]byte{11: p11, 4: p4}}, "berth.efi", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(out), "# Expected measurements of a unified kernel image") {
		t.Errorf("no head comment:\n%s", out)
	}
	if strings.Index(string(out), "  4:") > strings.Index(string(out), "  11:") {
		t.Errorf("PCRs out of order:\n%s", out)
	}
	p, err := policy.Parse(out, "measured", nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if p.Variant != "tpm" || len(p.Expectations) != 2 {
		t.Fatalf("policy = %+v", p)
	}
	for _, e := range p.Expectations {
		want := map[uint32]string{4: newPCR4, 11: pcr11}[e.Index]
		if len(e.AnyOf) != 1 || hex.EncodeToString(e.AnyOf[0]) != want || !strings.HasPrefix(e.Source, "berth.efi, PCR ") {
			t.Errorf("PCR %d: %x from %q, want %s from berth.efi", e.Index, e.AnyOf, e.Source, want)
		}
	}
	dir := writeFiles(t, map[string]string{
		"cluster.yaml": "variant: tpm\nmeasurements:\n  4: {expected: " + oldPCR4 + "}\n",
		"image.yaml":   string(out),
	})
	if _, err := Merge(filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "image.yaml"), false); err != nil {
		t.Errorf("merging the rendered measurements: %v", err)
	}
}

// With a boot phase register the measurements accept it at zero (before the state disk is open) or
// at the phase's value (after), and nothing else.
func TestMeasurementsPhase(t *testing.T) {
	var p4 [32]byte
	copy(p4[:], mustHex(t, newPCR4))
	open := mustHex(t, pcr11)
	out, err := Measurements(&uki.Prediction{PCRs: map[int][32]byte{4: p4}}, "berth.efi", &Phase{PCR: 13, Open: open})
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.Parse(out, "measured", nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var phase *policy.Expectation
	for i := range p.Expectations {
		if p.Expectations[i].Index == 13 {
			phase = &p.Expectations[i]
		}
	}
	if phase == nil || len(phase.AnyOf) != 2 || !bytes.Equal(phase.AnyOf[0], make([]byte, 32)) || !bytes.Equal(phase.AnyOf[1], open) {
		t.Fatalf("PCR 13 expectation = %+v; want zero or the phase value\n%s", phase, out)
	}
}

func mustHex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
