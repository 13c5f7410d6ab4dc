package cli

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/reasons"
)

// reasonEntry is what berth explain -o json|yaml prints for one code.
type reasonEntry struct {
	Code  string `json:"code"`
	Where string `json:"where"`
	Cause string `json:"cause"`
	Check string `json:"check"`
	Next  string `json:"next"`
}

func newExplainCmd() *cobra.Command {
	var output outputFormat
	cmd := &cobra.Command{
		Use:   "explain [CODE]",
		Short: "Explain a reason code: its cause, what to check, what to do next",
		Long: `explain prints what a reason code means. Every refusal Berth records carries one: the
joinservice's RPC and handshake refusals (berth status, the join ledger, kubectl get joinrecords),
a node's refusal of a joinservice (its log) and the certificate keeper's CSR denials (kubectl get
csr). berth status prints the short form of each code under its refusals; explain prints the whole
entry. Without CODE it lists every code. The same text is in internal/reasons/REASONS.md.`,
		Example: `  berth explain MEASUREMENT_MISMATCH
  berth explain                      # every code, one line each
  berth explain REVOKED -o json`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			entries := reasons.All()
			if len(args) == 1 {
				e, ok := reasons.Lookup(args[0])
				if !ok {
					return usageErr("unknown reason code %q: berth explain lists the codes", printable(args[0]))
				}
				entries = []reasons.Entry{e}
			}
			if output.structured() {
				out := make([]reasonEntry, 0, len(entries))
				for _, e := range entries {
					out = append(out, reasonEntry(e))
				}
				if len(args) == 1 {
					return output.encode(cmd.OutOrStdout(), out[0])
				}
				return output.encode(cmd.OutOrStdout(), out)
			}
			if len(args) == 1 {
				printReason(cmd.OutOrStdout(), entries[0])
				return nil
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			_, _ = fmt.Fprintln(tw, "CODE\tCAUSE")
			for _, e := range entries {
				_, _ = fmt.Fprintf(tw, "%s\t%s\n", e.Code, e.Cause)
			}
			return tw.Flush()
		},
	}
	addOutputFlag(cmd.Flags(), &output)
	return cmd
}

func printReason(out io.Writer, e reasons.Entry) {
	_, _ = fmt.Fprintf(out, "%s\n  where: %s\n  cause: %s\n  check: %s\n  next:  %s\n", e.Code, e.Where, e.Cause, e.Check, e.Next)
}

// printReasonLegend prints, under a table of refusals, the short explanation of each distinct code
// in it that has an entry (berth explain CODE has the rest).
func printReasonLegend(out io.Writer, codes []string) {
	var known []string
	for _, c := range codes {
		if reasons.Short(c) != "" && !slices.Contains(known, c) {
			known = append(known, c)
		}
	}
	if len(known) == 0 {
		return
	}
	slices.Sort(known)
	_, _ = fmt.Fprintln(out, "  What the reasons mean (berth explain CODE):")
	for _, c := range known {
		_, _ = fmt.Fprintf(out, "    %s: %s\n", c, strings.TrimSpace(reasons.Short(c)))
	}
}
