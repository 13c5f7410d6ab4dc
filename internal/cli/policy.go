package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/evidencefile"
)

func newPolicyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Work with attestation policies",
		Example: `  berth policy check --policy policy.yaml --evidence node.evidence
  berth policy measure --uki berth.efi > berth.measurements.yaml
  berth policy merge --policy policy.yaml --measurements berth.measurements.yaml > next-policy.yaml
  berth policy join --policy image-join-policy.yaml --workspace ./my-cluster > join-policy.yaml
  berth policy diff current-policy.yaml next-policy.yaml`,
		Args: cobra.NoArgs,
		RunE: groupHelp,
	}
	cmd.AddCommand(newPolicyCheckCmd(), newPolicyMeasureCmd(), newPolicyMergeCmd(), newPolicyJoinCmd(), newPolicyDiffCmd())
	return cmd
}

func newPolicyCheckCmd() *cobra.Command {
	var policyPath, evidencePath string
	var output outputFormat
	cmd := &cobra.Command{
		Use:   "check --policy FILE --evidence FILE",
		Short: "Judge recorded evidence against a policy, offline",
		Long: `berth policy check reaches the verdict berth verify would, without a network: it validates
evidence recorded with berth verify --save-evidence against a policy file (the same checks:
signatures, trust roots, nonce, key binding and measurements). Use it to try a policy change on
real nodes' evidence before rolling it out. The exit code is 3 when the evidence is rejected; the
report is printed either way (-o json|yaml: the fields of berth verify -o json).`,
		Example: `  berth verify --endpoint 198.51.100.10:9000 --policy policy.yaml --save-evidence cp1.evidence
  berth policy check --policy next-policy.yaml --evidence cp1.evidence
  berth policy check --policy next-policy.yaml --evidence cp1.evidence -o yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if policyPath == "" || evidencePath == "" {
				return usageErr("policy check needs --policy and --evidence")
			}
			p, validator, err := loadValidator(policyPath)
			if err != nil {
				return err
			}
			ev, err := evidencefile.Read(evidencePath)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			seen, verdict := atls.VerifyRecorded(cmd.Context(), validator, ev.Certificate, ev.Nonce)
			if verdict == nil && p.Variant == "tpm" {
				_, _ = fmt.Fprintln(cmd.ErrOrStderr(), "note: the attestation key's activation was checked when the evidence was recorded; it cannot be repeated offline")
			}
			r := newVerdictReport(p, seen, verdict)
			r.Endpoint, r.EvidenceFile, r.CapturedAt, r.recorded = ev.Endpoint, evidencePath, ev.CapturedAt.UTC(), true
			return r.print(cmd.OutOrStdout(), output, verdict)
		},
	}
	f := cmd.Flags()
	f.StringVar(&policyPath, "policy", "", "attestation policy file (YAML)")
	f.StringVar(&evidencePath, "evidence", "", "evidence file written by berth verify --save-evidence")
	addOutputFlag(f, &output)
	return cmd
}
