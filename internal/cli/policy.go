package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/atls"
)

func newPolicyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Work with attestation policies",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(newPolicyCheckCmd())
	return cmd
}

func newPolicyCheckCmd() *cobra.Command {
	var policyPath, evidencePath string
	cmd := &cobra.Command{
		Use:   "check --policy FILE --evidence FILE",
		Short: "Judge recorded evidence against a policy, offline",
		Long: `berth policy check reaches the verdict berth verify would, without a network: it validates
evidence recorded with berth verify --save-evidence against a policy file (the same checks:
signatures, trust roots, nonce, key binding and measurements). Use it to try a policy change on
real nodes' evidence before rolling it out. The exit code is 3 when the evidence is rejected.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if policyPath == "" || evidencePath == "" {
				return usageErr("policy check needs --policy and --evidence")
			}
			p, validator, err := loadValidator(policyPath)
			if err != nil {
				return err
			}
			ev, err := loadEvidence(evidencePath)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			out := cmd.OutOrStdout()
			seen, verdict := atls.VerifyRecorded(cmd.Context(), validator, ev.Certificate, ev.Nonce)
			_, _ = fmt.Fprintf(out, "evidence: %s (from %s, captured %s)\n", evidencePath, ev.Endpoint, ev.CapturedAt.Format("2006-01-02T15:04:05Z"))
			if verdict == nil && p.Variant == "tpm" {
				_, _ = fmt.Fprintln(out, "note: the attestation key's activation was checked when the evidence was recorded; it cannot be repeated offline")
			}
			return report(out, p, seen, verdict)
		},
	}
	f := cmd.Flags()
	f.StringVar(&policyPath, "policy", "", "attestation policy file (YAML)")
	f.StringVar(&evidencePath, "evidence", "", "evidence file written by berth verify --save-evidence")
	return cmd
}
