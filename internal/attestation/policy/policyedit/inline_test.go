package policyedit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

func TestInlineIsSelfContained(t *testing.T) {
	ca, err := vtpmtest.NewCA("inline test EK CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ek-ca.pem"), ca.PEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	src := "variant: tpm\nmeasurements:\n  15: {expected: " + strings.Repeat("00", 32) + ", source: fresh}\ntrustRoots:\n  - file: ek-ca.pem\n"
	out, err := Inline([]byte(src), dir)
	if err != nil {
		t.Fatal(err)
	}
	// The node parses it without any file access.
	p, err := policy.Parse(out, "inlined", nil)
	if err != nil {
		t.Fatalf("inlined policy does not parse without files: %v\n%s", err, out)
	}
	if len(p.TrustRoots) != 1 || len(p.Expectations) != 1 || p.Expectations[0].Index != 15 {
		t.Fatalf("inlined policy lost content: %+v", p)
	}
	if _, err := Inline([]byte("trustRoots:\n  - file: missing.pem\n"), dir); err == nil {
		t.Fatal("Inline() with a missing file = nil")
	}
}

// A TDX policy's collateral bundle file is inlined too, byte for byte.
func TestInlineTDXBundle(t *testing.T) {
	dir := t.TempDir()
	bundle := "{\n  \"version\": 1,\n  \"collateral\": []\n}\n"
	if err := os.WriteFile(filepath.Join(dir, "collateral.json"), []byte(bundle), 0o600); err != nil {
		t.Fatal(err)
	}
	src := "variant: tdx\ntdx:\n  collateralBundle: {file: collateral.json}\n  acceptedTCBStatuses: [UpToDate]\n"
	out, err := Inline([]byte(src), dir)
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.Parse(out, "inlined", nil)
	if err != nil {
		t.Fatalf("inlined policy does not parse without files: %v\n%s", err, out)
	}
	if string(p.TDX.Bundle) != bundle || len(p.TDX.AcceptedTCBStatuses) != 1 {
		t.Fatalf("inlined bundle = %q, want %q", p.TDX.Bundle, bundle)
	}
	if _, err := Inline([]byte("variant: tdx\ntdx:\n  collateralBundle: {file: missing.json}\n"), dir); err == nil {
		t.Fatal("Inline() with a missing bundle file = nil")
	}
}
