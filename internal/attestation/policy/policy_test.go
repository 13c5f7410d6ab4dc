package policy

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/attestation"
)

func digest(b byte) []byte {
	d := make([]byte, 32)
	for i := range d {
		d[i] = b
	}
	return d
}

const samplePolicy = `variant: tpm
measurements:
  4:
    expected: "` + "0404040404040404040404040404040404040404040404040404040404040404" + `"
    source: image build 1.2
  7:
    anyOf: ["0707070707070707070707070707070707070707070707070707070707070707", "0808080808080808080808080808080808080808080808080808080808080808"]
    mode: warn
  15:
    nonZero: true
`

func TestEvaluate(t *testing.T) {
	p, err := Parse([]byte(samplePolicy), "policy.yaml", nil)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	testCases := map[string]struct {
		actual       attestation.Measurements
		wantErr      bool
		wantWarnings int
		wantIndex    uint32
	}{
		"all match":            {actual: attestation.Measurements{4: digest(4), 7: digest(8), 15: digest(1)}},
		"warn only":            {actual: attestation.Measurements{4: digest(4), 7: digest(9), 15: digest(1)}, wantWarnings: 1},
		"enforced mismatch":    {actual: attestation.Measurements{4: digest(5), 7: digest(7), 15: digest(1)}, wantErr: true, wantIndex: 4},
		"lock register zero":   {actual: attestation.Measurements{4: digest(4), 7: digest(7), 15: digest(0)}, wantErr: true, wantIndex: 15},
		"missing index":        {actual: attestation.Measurements{7: digest(7), 15: digest(1)}, wantErr: true, wantIndex: 4},
		"warn and enforce":     {actual: attestation.Measurements{4: digest(5), 7: digest(9), 15: digest(1)}, wantErr: true, wantWarnings: 1, wantIndex: 4},
		"extra indices are ok": {actual: attestation.Measurements{0: digest(0), 4: digest(4), 7: digest(7), 15: digest(2)}},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			warnings, err := p.Evaluate(tc.actual)
			if len(warnings) != tc.wantWarnings {
				t.Errorf("got %d warnings %q, want %d", len(warnings), warnings, tc.wantWarnings)
			}
			if !tc.wantErr {
				if err != nil {
					t.Fatalf("Evaluate: %v", err)
				}
				return
			}
			if !errors.Is(err, attestation.ErrMeasurementMismatch) {
				t.Fatalf("got %v, want ErrMeasurementMismatch", err)
			}
			var me *MismatchError
			if !errors.As(err, &me) || me.Violations[0].Index != tc.wantIndex {
				t.Fatalf("got %v, want a violation at index %d", err, tc.wantIndex)
			}
		})
	}
}

func TestMismatchNamesEverything(t *testing.T) {
	p, err := Parse([]byte(samplePolicy), "policy.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Evaluate(attestation.Measurements{4: digest(5), 7: digest(7), 15: digest(1)})
	msg := err.Error()
	for _, want := range []string{"index 4", hex.EncodeToString(digest(4)), hex.EncodeToString(digest(5)), "image build 1.2", "policy.yaml:3"} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not name %q", msg, want)
		}
	}
}

func TestParseRejects(t *testing.T) {
	testCases := map[string]string{
		"no variant":        "measurements: {}\n",
		"unknown field":     "variant: tpm\nfoo: 1\n",
		"bad index":         "variant: tpm\nmeasurements:\n  x: {expected: '00'}\n",
		"index too large":   "variant: tpm\nmeasurements:\n  64: {expected: '00'}\n",
		"bad hex":           "variant: tpm\nmeasurements:\n  1: {expected: zz}\n",
		"no value":          "variant: tpm\nmeasurements:\n  1: {mode: warn}\n",
		"both kinds":        "variant: tpm\nmeasurements:\n  1: {expected: '00', nonZero: true}\n",
		"bad mode":          "variant: tpm\nmeasurements:\n  1: {expected: '00', mode: maybe}\n",
		"unknown entry key": "variant: tpm\nmeasurements:\n  1: {expected: '00', expect: '01'}\n",
		"duplicate index":   "variant: tpm\nmeasurements:\n  1: {expected: '00'}\n  01: {expected: '00'}\n",
		"list measurements": "variant: tpm\nmeasurements: [1, 2]\n",
		"two documents":     "variant: tpm\n---\nvariant: tdx\n",
		"file without fs":   "variant: tpm\ntrustRoots:\n  - file: ca.pem\n",
		"pem garbage":       "variant: tpm\ntrustRoots:\n  - pem: nothing\n",
		"bundle and dir":    "variant: tdx\ntdx:\n  collateralBundle: {json: '{}'}\n  collateralDir: c\n",
		"bundle and pcs":    "variant: tdx\ntdx:\n  collateralBundle: {json: '{}'}\n  pcsURL: https://pccs\n",
		"dir and pcs":       "variant: tdx\ntdx:\n  collateralDir: c\n  pcsURL: https://pccs\n",
		"bundle both kinds": "variant: tdx\ntdx:\n  collateralBundle: {json: '{}', file: b.json}\n",
		"bundle empty":      "variant: tdx\ntdx:\n  collateralBundle: {}\n",
		"bundle file no fs": "variant: tdx\ntdx:\n  collateralBundle: {file: b.json}\n",
		"bundle unknown":    "variant: tdx\ntdx:\n  collateralBundle: {url: b.json}\n",
		"pcs not a URL":     "variant: tdx\ntdx:\n  pcsURL: pccs:8081\n",
		"pcs ftp":           "variant: tdx\ntdx:\n  pcsURL: ftp://pccs\n",
		"pcs with query":    "variant: tdx\ntdx:\n  pcsURL: https://pccs/?x=1\n",
	}
	for name, in := range testCases {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse([]byte(in), "p.yaml", nil); !errors.Is(err, ErrInvalid) {
				t.Fatalf("got %v, want ErrInvalid", err)
			}
		})
	}
}

func TestLoadResolvesTrustRootFiles(t *testing.T) {
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test EK CA"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.WriteFile(filepath.Join(dir, "ca.pem"), pemBytes, 0o600); err != nil {
		t.Fatal(err)
	}
	doc := "variant: tpm\ntrustRoots:\n  - file: ca.pem\n  - pem: |\n" + indent(string(pemBytes), "      ") + "akRoots:\n  - file: ca.pem\n"
	if err := os.WriteFile(filepath.Join(dir, "policy.yaml"), []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := Load(filepath.Join(dir, "policy.yaml"))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if len(p.TrustRoots) != 2 || p.TrustRoots[0].Subject.CommonName != "test EK CA" {
		t.Fatalf("got %d trust roots, want 2", len(p.TrustRoots))
	}
	if len(p.AKRoots) != 1 || p.AKRoots[0].Subject.CommonName != "test EK CA" {
		t.Fatalf("got %d AK roots, want 1", len(p.AKRoots))
	}
	if _, err := Parse([]byte("variant: tpm\nakRoots:\n  - pem: nothing\n"), "p", nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("akRoots without a certificate: got %v, want ErrInvalid", err)
	}
}

// The TDX collateral sources: a bundle file relative to the policy (read at load), an inline bundle, a PCS URL.
func TestTDXCollateralSources(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "bundle.json"), []byte(`{"version": 1}`), 0o600); err != nil {
		t.Fatal(err)
	}
	doc := "variant: tdx\ntdx:\n  collateralBundle: {file: bundle.json}\n"
	if err := os.WriteFile(filepath.Join(dir, "policy.yaml"), []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := Load(filepath.Join(dir, "policy.yaml"))
	if err != nil || string(p.TDX.Bundle) != `{"version": 1}` {
		t.Fatalf("Load() with a bundle file = %v; want the file's content as the bundle", err)
	}
	if err := os.Remove(filepath.Join(dir, "bundle.json")); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(filepath.Join(dir, "policy.yaml")); !errors.Is(err, ErrInvalid) || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Load() with a missing bundle file = %v, want ErrInvalid and not exist", err)
	}

	p, err = Parse([]byte("variant: tdx\ntdx:\n  collateralBundle:\n    json: |\n      {\"version\": 1}\n"), "p.yaml", nil)
	if err != nil || strings.TrimSpace(string(p.TDX.Bundle)) != `{"version": 1}` {
		t.Fatalf("Parse() with an inline bundle = %v", err)
	}
	p, err = Parse([]byte("variant: tdx\ntdx:\n  pcsURL: http://127.0.0.1:8081/pccs\n"), "p.yaml", nil)
	if err != nil || p.TDX.PCSURL != "http://127.0.0.1:8081/pccs" || p.TDX.Bundle != nil {
		t.Fatalf("Parse() with a PCS URL = %+v, %v", p, err)
	}
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(samplePolicy))
	f.Add([]byte("variant: tdx\nmeasurements:\n  0: {expected: '00', mode: warn}\n"))
	f.Add([]byte("variant: tpm\ntrustRoots:\n  - pem: x\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(data, "fuzz.yaml", nil)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		// A parsed policy must evaluate without panicking, both on nothing and on all-zero values.
		_, _ = p.Evaluate(nil)
		zeros := attestation.Measurements{}
		for _, i := range p.Indices() {
			zeros[i] = make([]byte, 32)
		}
		_, _ = p.Evaluate(zeros)
	})
}

// The tpm section names how EKs are trusted; pinned EKs are an explicit choice with digests, never
// implied.
func TestTPMSection(t *testing.T) {
	pin := strings.Repeat("ab", 32)
	p, err := Parse([]byte("variant: tpm\ntpm:\n  ekTrust: pinned\n  ekPublicSHA256: [\""+pin+"\", 0x"+strings.Repeat("cd", 32)+"]\n"), "pinned.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.EKTrust() != EKTrustPinned || !p.TPM.PinsEK(digest(0xab)) || !p.TPM.PinsEK(digest(0xcd)) || p.TPM.PinsEK(digest(0xef)) {
		t.Fatalf("pinned policy = %+v", p.TPM)
	}
	for name, src := range map[string]string{
		"no tpm section": "variant: tpm\n",
		"certificate":    "variant: tpm\ntpm: {ekTrust: certificate}\n",
		"default":        "variant: tpm\ntpm: {}\n",
	} {
		p, err := Parse([]byte(src), name, nil)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if p.EKTrust() != EKTrustCertificate || p.TPM.PinsEK(digest(0xab)) {
			t.Errorf("%s: EK trust %q pins %v", name, p.EKTrust(), p.TPM.PinsEK(digest(0xab)))
		}
	}
	for name, src := range map[string]string{
		"pinned without digests":      "variant: tpm\ntpm: {ekTrust: pinned}\n",
		"digests without pinned":      "variant: tpm\ntpm: {ekPublicSHA256: [" + pin + "]}\n",
		"digests under certificate":   "variant: tpm\ntpm: {ekTrust: certificate, ekPublicSHA256: [" + pin + "]}\n",
		"unknown trust":               "variant: tpm\ntpm: {ekTrust: any}\n",
		"short digest":                "variant: tpm\ntpm: {ekTrust: pinned, ekPublicSHA256: [abcd]}\n",
		"not hex":                     "variant: tpm\ntpm: {ekTrust: pinned, ekPublicSHA256: [" + strings.Repeat("zz", 32) + "]}\n",
		"unknown field":               "variant: tpm\ntpm: {ekTrust: pinned, ekPins: [" + pin + "]}\n",
		"tpm section in a TDX policy": "variant: tdx\ntpm: {ekTrust: pinned, ekPublicSHA256: [" + pin + "]}\n",
	} {
		if _, err := Parse([]byte(src), name, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: got %v, want ErrInvalid", name, err)
		}
	}
}
