package cli

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"sort"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

// evidenceFile is what `berth verify --save-evidence` records and `berth policy check` reads: the
// peer's attested certificate and the nonce it was asked to attest, which is all a verdict needs.
type evidenceFile struct {
	Version     int       `json:"version"`
	Endpoint    string    `json:"endpoint"`
	CapturedAt  time.Time `json:"capturedAt"`
	Nonce       []byte    `json:"nonce"`
	Certificate []byte    `json:"certificate"`
}

// maxEvidenceFile bounds an evidence file.
const maxEvidenceFile = 1 << 20

func newVerifyCmd() *cobra.Command {
	var endpoint, policyPath, savePath string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "verify --endpoint HOST:PORT --policy FILE",
		Short: "Attest a running node and judge it against a policy",
		Long: `berth verify opens an attested TLS connection to a node (the bootstrapper's init port or a
joinservice), has it attest with a fresh nonce, and prints its measurements and the verdict of
the policy. It sends nothing else. The exit code is 3 when the node is rejected.

With --save-evidence the node's attested certificate and the nonce are written to a file that
berth policy check judges offline, for example against a policy you are about to roll out.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if endpoint == "" || policyPath == "" {
				return usageErr("verify needs --endpoint and --policy")
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			return runVerify(ctx, cmd.OutOrStdout(), endpoint, policyPath, savePath)
		},
	}
	f := cmd.Flags()
	f.StringVar(&endpoint, "endpoint", "", "node address, HOST:PORT")
	f.StringVar(&policyPath, "policy", "", "attestation policy file (YAML)")
	f.StringVar(&savePath, "save-evidence", "", "write the node's evidence to this file (also when it is rejected)")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "give up after this long")
	return cmd
}

func runVerify(ctx context.Context, out io.Writer, endpoint, policyPath, savePath string) error {
	p, validator, err := loadValidator(policyPath)
	if err != nil {
		return err
	}
	var seen *atls.Evidence
	var verdict error
	var d net.Dialer
	conn, hsErr := atls.Dial(ctx, &d, endpoint, nil, validator, atls.WithObserver(func(ev atls.Evidence, err error) {
		seen, verdict = &ev, err
	}))
	if hsErr == nil {
		_ = conn.Close() // only the handshake's evidence is needed
	}
	if seen == nil {
		// The handshake failed before the node presented an attested certificate.
		return fmt.Errorf("attesting %s: %w", endpoint, hsErr)
	}
	if savePath != "" && seen.Certificate != nil {
		if err := saveEvidence(savePath, endpoint, seen); err != nil {
			return err
		}
		_, _ = fmt.Fprintf(out, "evidence saved to %s\n", savePath)
	}
	_, _ = fmt.Fprintf(out, "endpoint: %s\n", endpoint)
	return report(out, p, *seen, verdict)
}

// loadValidator reads a policy and builds its variant's validator.
func loadValidator(path string) (*policy.Policy, choose.Validator, error) {
	p, err := policy.Load(path)
	if err != nil {
		return nil, nil, &exitError{code: exitUsage, err: err}
	}
	v, err := choose.NewValidator(p, zap.NewNop())
	if err != nil {
		return nil, nil, &exitError{code: exitUsage, err: err}
	}
	return p, v, nil
}

// report prints the evidence's measurements, warnings and the verdict, and turns a rejection into
// exit code 3.
func report(out io.Writer, p *policy.Policy, ev atls.Evidence, verdict error) error {
	_, _ = fmt.Fprintf(out, "variant: %s\n", orNone(ev.Variant))
	if ev.Activated {
		_, _ = fmt.Fprintln(out, "attestation key: activated (proven to live with the certified endorsement key)")
	}
	_, _ = fmt.Fprintf(out, "policy: %s\n", p.Origin)
	m, verified := ev.Result.Measurements, true
	if len(m) == 0 && ev.Variant == vtpm.Variant && len(ev.Document) > 0 {
		// The document failed before its measurements were checked; show them, marked.
		if _, um, err := vtpm.Measurements(ev.Document); err == nil {
			m, verified = um, false
		}
	}
	if len(m) > 0 {
		label := "measurements:"
		if !verified {
			label = "measurements (NOT verified, the document was rejected before):"
		}
		_, _ = fmt.Fprintln(out, label)
		expected := map[uint32]policy.Expectation{}
		for _, e := range p.Expectations {
			expected[e.Index] = e
		}
		idx := make([]uint32, 0, len(m))
		for i := range m {
			idx = append(idx, i)
		}
		sort.Slice(idx, func(a, b int) bool { return idx[a] < idx[b] })
		for _, i := range idx {
			note := ""
			if e, ok := expected[i]; ok {
				note = "  [" + e.Mode.String() + "]"
			}
			_, _ = fmt.Fprintf(out, "  %2d: %s%s\n", i, hex.EncodeToString(m[i]), note)
		}
	}
	if len(ev.Result.Warnings) > 0 {
		_, _ = fmt.Fprintln(out, "warnings:")
		for _, w := range ev.Result.Warnings {
			_, _ = fmt.Fprintf(out, "  - %s\n", w)
		}
	}
	if verdict != nil {
		_, _ = fmt.Fprintf(out, "verdict: REJECTED: %v\n", verdict)
		return &exitError{code: exitRejected, err: fmt.Errorf("node rejected: %w", verdict)}
	}
	_, _ = fmt.Fprintln(out, "verdict: ACCEPTED")
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func saveEvidence(path, endpoint string, ev *atls.Evidence) error {
	data, err := json.MarshalIndent(evidenceFile{
		Version: 1, Endpoint: endpoint, CapturedAt: time.Now().UTC(), Nonce: ev.Nonce, Certificate: ev.Certificate,
	}, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding evidence: %w", err)
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("writing evidence: %w", err)
	}
	return nil
}

func loadEvidence(path string) (*evidenceFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening evidence: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxEvidenceFile+1))
	if err != nil {
		return nil, fmt.Errorf("reading evidence: %w", err)
	}
	if len(data) > maxEvidenceFile {
		return nil, fmt.Errorf("reading evidence: %s is larger than %d bytes", path, maxEvidenceFile)
	}
	var ev evidenceFile
	if err := json.Unmarshal(data, &ev); err != nil {
		return nil, fmt.Errorf("decoding evidence %s: %w: %w", path, err, attestation.ErrMalformed)
	}
	if ev.Version != 1 || len(ev.Certificate) == 0 || len(ev.Nonce) == 0 {
		return nil, fmt.Errorf("decoding evidence %s: version %d, %d certificate bytes, %d nonce bytes: %w",
			path, ev.Version, len(ev.Certificate), len(ev.Nonce), attestation.ErrMalformed)
	}
	return &ev, nil
}
