package cli

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"sort"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/evidencefile"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

func newVerifyCmd() *cobra.Command {
	var endpoint, policyPath, savePath string
	var output outputFormat
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "verify --endpoint HOST:PORT --policy FILE",
		Short: "Attest a running node and judge it against a policy",
		Long: `berth verify opens an attested TLS connection to a node (the bootstrapper's init port or a
joinservice), has it attest with a fresh nonce, and prints its measurements and the verdict of
the policy. It sends nothing else. The exit code is 3 when the node is rejected; the report is
printed either way (-o json|yaml: one document, fields in internal/cli/README.md).

With --save-evidence the node's attested certificate and the nonce are written to a file that
berth policy check judges offline, for example against a policy you are about to roll out.`,
		Example: `  berth verify --endpoint 198.51.100.10:9000 --policy policy.yaml
  berth verify --endpoint 198.51.100.10:9002 --policy join-policy.yaml --save-evidence cp1.evidence
  berth verify --endpoint 198.51.100.10:9000 --policy policy.yaml -o json | jq -r .verdict`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if endpoint == "" || policyPath == "" {
				return usageErr("verify needs --endpoint and --policy")
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			return runVerify(ctx, cmd.OutOrStdout(), cmd.ErrOrStderr(), endpoint, policyPath, savePath, output)
		},
	}
	f := cmd.Flags()
	f.StringVar(&endpoint, "endpoint", "", "node address, HOST:PORT")
	f.StringVar(&policyPath, "policy", "", "attestation policy file (YAML)")
	f.StringVar(&savePath, "save-evidence", "", "write the node's evidence to this file (also when it is rejected)")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "give up after this long")
	addOutputFlag(f, &output)
	return cmd
}

func runVerify(ctx context.Context, out, errOut io.Writer, endpoint, policyPath, savePath string, output outputFormat) error {
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
	r := newVerdictReport(p, *seen, verdict)
	r.Endpoint, r.CapturedAt = endpoint, time.Now().UTC()
	if savePath != "" && seen.Certificate != nil {
		if err := evidencefile.Write(savePath, endpoint, seen.Certificate, seen.Nonce, time.Now().UTC()); err != nil {
			return err
		}
		r.EvidenceFile = savePath
		_, _ = fmt.Fprintf(errOut, "evidence saved to %s\n", savePath)
	}
	return r.print(out, output, verdict)
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

// verdictReport is what berth verify and berth policy check print. With -o json|yaml its field
// names are stable.
type verdictReport struct {
	// Endpoint is the node verify attested, or the one the evidence policy check read was recorded from.
	Endpoint string `json:"endpoint"`
	// EvidenceFile is the file policy check read, or the file verify --save-evidence wrote ("" without).
	EvidenceFile string `json:"evidenceFile"`
	// CapturedAt is when the evidence was taken.
	CapturedAt time.Time `json:"capturedAt"`
	// Variant is the attestation variant the node used (tpm, tdx), "" when it presented none.
	Variant string `json:"variant"`
	// AttestationKeyActivated: the TPM attestation key was proven to live with the trusted EK.
	AttestationKeyActivated bool `json:"attestationKeyActivated"`
	// EKPublicSHA256 is the SHA-256 of the TPM endorsement key's public area the evidence names, hex
	// (what a policy's tpm.ekPublicSHA256 pins); proven only when the verdict is ACCEPTED, "" for
	// other variants.
	EKPublicSHA256 string `json:"ekPublicSHA256"`
	// Policy names the policy file the verdict comes from.
	Policy string `json:"policy"`
	// MeasurementsVerified is false when the document was rejected before its measurements were
	// checked: the measurements listed are then what the node claimed, not proven values.
	MeasurementsVerified bool                `json:"measurementsVerified"`
	Measurements         []measurementReport `json:"measurements"`
	// Warnings are deviations the policy only warns about.
	Warnings []string `json:"warnings"`
	// Verdict is ACCEPTED or REJECTED; Reason says why when REJECTED.
	Verdict string `json:"verdict"`
	Reason  string `json:"reason"`

	// recorded: the evidence came from a file (policy check), not from a live handshake.
	recorded bool
}

// measurementReport is one measurement register in verdictReport.
type measurementReport struct {
	Index uint32 `json:"index"`
	// Value is the register's value, hex.
	Value string `json:"value"`
	// Mode is how the policy judges the index (enforce, warn), "" when the policy says nothing of it.
	Mode string `json:"mode"`
}

// Verdicts in verdictReport.
const (
	verdictAccepted = "ACCEPTED"
	verdictRejected = "REJECTED"
)

// newVerdictReport collects the evidence's measurements, warnings and the verdict.
func newVerdictReport(p *policy.Policy, ev atls.Evidence, verdict error) *verdictReport {
	r := &verdictReport{
		Variant: ev.Variant, AttestationKeyActivated: ev.Activated, Policy: p.Origin,
		MeasurementsVerified: true, Measurements: []measurementReport{}, Warnings: []string{}, Verdict: verdictAccepted,
	}
	if ev.Variant == vtpm.Variant && len(ev.Document) > 0 {
		if id, err := vtpm.EKPublicSHA256(ev.Document); err == nil {
			r.EKPublicSHA256 = hex.EncodeToString(id)
		}
	}
	m := ev.Result.Measurements
	if len(m) == 0 && ev.Variant == vtpm.Variant && len(ev.Document) > 0 {
		// The document failed before its measurements were checked; show them, marked.
		if _, um, err := vtpm.Measurements(ev.Document); err == nil {
			m, r.MeasurementsVerified = um, false
		}
	}
	expected := map[uint32]policy.Expectation{}
	for _, e := range p.Expectations {
		expected[e.Index] = e
	}
	for i, v := range m {
		mr := measurementReport{Index: i, Value: hex.EncodeToString(v)}
		if e, ok := expected[i]; ok {
			mr.Mode = e.Mode.String()
		}
		r.Measurements = append(r.Measurements, mr)
	}
	sort.Slice(r.Measurements, func(a, b int) bool { return r.Measurements[a].Index < r.Measurements[b].Index })
	r.Warnings = append(r.Warnings, ev.Result.Warnings...)
	if verdict != nil {
		r.Verdict, r.Reason = verdictRejected, verdict.Error()
	}
	return r
}

// print writes the report as a table or as JSON/YAML, and turns a rejection into exit code 3.
func (r *verdictReport) print(out io.Writer, output outputFormat, verdict error) error {
	if output.structured() {
		if err := output.encode(out, r); err != nil {
			return err
		}
	} else {
		r.printText(out)
	}
	if verdict != nil {
		return &exitError{code: exitRejected, err: fmt.Errorf("node rejected: %w", verdict)}
	}
	return nil
}

func (r *verdictReport) printText(out io.Writer) {
	if r.recorded {
		_, _ = fmt.Fprintf(out, "evidence: %s (from %s, captured %s)\n", r.EvidenceFile, r.Endpoint, r.CapturedAt.Format(time.RFC3339))
	} else {
		_, _ = fmt.Fprintf(out, "endpoint: %s\n", r.Endpoint)
	}
	_, _ = fmt.Fprintf(out, "variant: %s\n", orNone(r.Variant))
	if r.EKPublicSHA256 != "" {
		_, _ = fmt.Fprintf(out, "endorsement key: public area SHA-256 %s\n", r.EKPublicSHA256)
	}
	if r.AttestationKeyActivated {
		_, _ = fmt.Fprintln(out, "attestation key: activated (proven to live with the trusted endorsement key)")
	}
	_, _ = fmt.Fprintf(out, "policy: %s\n", r.Policy)
	if len(r.Measurements) > 0 {
		label := "measurements:"
		if !r.MeasurementsVerified {
			label = "measurements (NOT verified, the document was rejected before):"
		}
		_, _ = fmt.Fprintln(out, label)
		for _, m := range r.Measurements {
			note := ""
			if m.Mode != "" {
				note = "  [" + m.Mode + "]"
			}
			_, _ = fmt.Fprintf(out, "  %2d: %s%s\n", m.Index, m.Value, note)
		}
	}
	if len(r.Warnings) > 0 {
		_, _ = fmt.Fprintln(out, "warnings:")
		for _, w := range r.Warnings {
			_, _ = fmt.Fprintf(out, "  - %s\n", w)
		}
	}
	if r.Verdict == verdictRejected {
		_, _ = fmt.Fprintf(out, "verdict: REJECTED: %s\n", r.Reason)
		return
	}
	_, _ = fmt.Fprintln(out, "verdict: ACCEPTED")
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}
