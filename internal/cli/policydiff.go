package cli

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/policy/policydiff"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/machines"
)

func newPolicyDiffCmd() *cobra.Command {
	var kube kubeOptions
	var output outputFormat
	var namespace string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "diff OLD NEW",
		Short: "Name the admitted machines a new policy would refuse, judged on their recorded evidence",
		Long: `berth policy diff reads the cluster's Machines (kubectl get machines: the measurements of
each admitted machine's latest verified attestation) and judges those measurements against the
policy files OLD and NEW, offline: no machine is contacted. It prints the admitted machines NEW
refuses and OLD accepted, with the measurements that differ, then the ones NEW accepts and OLD
refused, and the machines it could not judge (no recorded evidence, or of another variant).

It judges measurements only: signatures, trust roots and key activation were checked when the
evidence was recorded.`,
		Example: `  berth policy diff current-policy.yaml next-policy.yaml
  berth policy diff current-policy.yaml next-policy.yaml -o json`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			oldPolicy, err := policy.Load(args[0])
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			newPolicy, err := policy.Load(args[1])
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			_, rc, err := kube.clients()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			ms, err := policydiff.ListMachines(ctx, rc, namespace)
			if err != nil {
				return err
			}
			d := policydiff.Judge(oldPolicy, newPolicy, ms)
			if output.structured() {
				return output.encode(cmd.OutOrStdout(), d)
			}
			printPolicyDiff(cmd.OutOrStdout(), d)
			return nil
		},
	}
	f := cmd.Flags()
	kube.addFlags(f)
	addOutputFlag(f, &output)
	f.StringVarP(&namespace, "namespace", "n", joinconfig.Namespace, "namespace of Berth's components")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

func printPolicyDiff(out io.Writer, d policydiff.Report) {
	_, _ = fmt.Fprintf(out, "Judged the recorded evidence of %d admitted machines.\n", d.Judged)
	section := func(title string, l []policydiff.Verdict) {
		_, _ = fmt.Fprintf(out, "\n%s: %d\n", title, len(l))
		if len(l) == 0 {
			return
		}
		tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		_, _ = fmt.Fprintln(tw, "  NODE\tMACHINE\tROLE\tWHY")
		for _, v := range l {
			_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", printable(v.Node), machines.Short(v.Identity), v.Role, printable(oneLine(v.Reason)))
		}
		_ = tw.Flush()
	}
	section("REFUSED BY THE NEW POLICY (admitted under the old one)", d.NewlyRefused)
	section("ACCEPTED BY THE NEW POLICY (refused by the old one)", d.NewlyAccepted)
	section("NOT JUDGED", d.Unjudged)
}
