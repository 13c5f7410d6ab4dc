package policyedit

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

func TestVariantTPM(t *testing.T) {
	if variantTPM != vtpm.Variant {
		t.Fatalf("variantTPM = %q, vtpm.Variant = %q", variantTPM, vtpm.Variant)
	}
}

// AddAKRoot lists the CA once, keeps the operator's other akRoots and content, and makes a node's
// validator accept certified keys.
func TestAddAKRoot(t *testing.T) {
	ekCA, err := vtpmtest.NewCA("AK root test EK CA")
	if err != nil {
		t.Fatal(err)
	}
	otherAK, err := vtpm.NewAKCA(bytes.Repeat([]byte{7}, 32), "a platform's AK CA")
	if err != nil {
		t.Fatal(err)
	}
	ca, err := vtpm.NewAKCA(bytes.Repeat([]byte{1}, 32), "a cluster's AK CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for name, data := range map[string][]byte{"ek-ca.pem": ekCA.PEM(), "platform-ak-ca.pem": otherAK.PEM()} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	const base = "# the image's join policy\nvariant: tpm\nmeasurements:\n  15: {nonZero: true, source: bootstrapped}\ntrustRoots:\n  - file: ek-ca.pem\n"
	for name, tc := range map[string]struct {
		src       string
		wantRoots int
	}{
		"without akRoots":    {base, 1},
		"with another CA":    {base + "akRoots:\n  - file: platform-ak-ca.pem\n", 2},
		"with the cluster's": {base + "akRoots:\n  - pem: |\n" + indent(string(ca.PEM()), "      "), 1},
	} {
		t.Run(name, func(t *testing.T) {
			tmpl, err := Inline([]byte(tc.src), dir)
			if err != nil {
				t.Fatal(err)
			}
			out, err := AddAKRoot(tmpl, ca.PEM(), "the cluster's CA")
			if err != nil {
				t.Fatal(err)
			}
			p, err := policy.Parse(out, "out", nil) // no file access: self-contained
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			if len(p.AKRoots) != tc.wantRoots || !p.AKRoots[len(p.AKRoots)-1].Equal(ca.Cert) {
				t.Fatalf("akRoots = %d certificates, the last the cluster's: want %d\n%s", len(p.AKRoots), tc.wantRoots, out)
			}
			if len(p.TrustRoots) != 1 || len(p.Expectations) != 1 || !strings.Contains(string(out), "# the image's join policy") {
				t.Errorf("the operator's policy lost content:\n%s", out)
			}
			if name == "without akRoots" && !strings.Contains(string(out), "# the cluster's CA") {
				t.Errorf("the added entry lost its comment:\n%s", out)
			}
			v, err := vtpm.NewValidator(p, zap.NewNop())
			if err != nil || !v.CertifiesKeys() {
				t.Fatalf("validator = %v, certifies keys: %v", err, v != nil && v.CertifiesKeys())
			}
			again, err := AddAKRoot(out, ca.PEM(), "the cluster's CA")
			if err != nil || !bytes.Equal(again, out) {
				t.Errorf("adding the CA twice changed the policy (%v):\n%s\n---\n%s", err, out, again)
			}
		})
	}

	// A TDX policy has no attestation keys: unchanged.
	tdxPolicy := []byte("variant: tdx\ntdx: {collateralDir: c}\n")
	if out, err := AddAKRoot(tdxPolicy, ca.PEM(), "x"); err != nil || !bytes.Equal(out, tdxPolicy) {
		t.Errorf("TDX join policy = %q, %v", out, err)
	}
	for name, src := range map[string]string{
		"not YAML":           "variant: [",
		"not a mapping":      "- variant: tpm\n",
		"akRoots not a list": "variant: tpm\nakRoots: {pem: x}\n",
	} {
		if _, err := AddAKRoot([]byte(src), ca.PEM(), "x"); err == nil {
			t.Errorf("%s: AddAKRoot() = nil error", name)
		}
	}
}

func indent(s, prefix string) string {
	lines := strings.SplitAfter(s, "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = prefix + l
		}
	}
	return strings.Join(lines, "")
}
