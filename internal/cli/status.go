package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/joinledger"
)

func newStatusCmd() *cobra.Command {
	var kubeconfig, namespace string
	var limit int
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "status --kubeconfig FILE",
		Short: "Show the cluster's join ledger: rejected nodes and why, then accepted joins",
		Long: `berth status reads the join ledger the joinservice keeps in the cluster (ConfigMap
berth-join-ledger in berth-system: the latest join attempts of every joinservice replica) and
prints the rejected attempts first, newest first, with their reason code and message, then the
accepted ones. The same attempts are Events on that ConfigMap:
  kubectl -n berth-system get events --field-selector involvedObject.name=berth-join-ledger`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if kubeconfig == "" {
				return usageErr("status needs --kubeconfig")
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
			if err != nil {
				return fmt.Errorf("loading kubeconfig: %w", err)
			}
			client, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				return fmt.Errorf("creating Kubernetes client: %w", err)
			}
			return runStatus(ctx, cmd.OutOrStdout(), client, namespace, limit)
		},
	}
	f := cmd.Flags()
	f.StringVar(&kubeconfig, "kubeconfig", "", "the cluster's admin kubeconfig")
	f.StringVar(&namespace, "namespace", "berth-system", "namespace of Berth's components")
	f.IntVar(&limit, "limit", 50, "most attempts to print per section (0: all)")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

func runStatus(ctx context.Context, out io.Writer, client kubernetes.Interface, namespace string, limit int) error {
	entries, err := joinledger.Read(ctx, client, namespace)
	if errors.Is(err, joinledger.ErrNoLedger) {
		_, _ = fmt.Fprintln(out, "No join attempts recorded yet (no ConfigMap "+namespace+"/"+joinledger.ConfigMapName+").")
		return nil
	}
	if err != nil {
		return err
	}
	printLedger(out, entries, limit)
	return nil
}

// printLedger prints rejected attempts, then accepted ones, each newest first.
func printLedger(out io.Writer, entries []joinledger.Entry, limit int) {
	var rejected, accepted []joinledger.Entry
	attempts := 0
	for i := len(entries) - 1; i >= 0; i-- {
		e := entries[i]
		attempts += max(e.Count, 1)
		if e.Outcome == joinledger.OutcomeAccepted {
			accepted = append(accepted, e)
		} else {
			rejected = append(rejected, e)
		}
	}
	nRejected := 0
	for _, e := range rejected {
		nRejected += max(e.Count, 1)
	}
	_, _ = fmt.Fprintf(out, "Join ledger: %d attempts in the last %d records, %d rejected, %d accepted.\n", attempts, len(entries), nRejected, len(accepted))
	section := func(title string, es []joinledger.Entry, withReason bool) {
		_, _ = fmt.Fprintf(out, "\n%s (%d, newest first)\n", title, len(es))
		if len(es) == 0 {
			return
		}
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		if withReason {
			_, _ = fmt.Fprintln(tw, "TIME\tPEER\tNODE\tROLE\tRPC\tREASON\tCOUNT\tEVIDENCE\tREPLICA\tMESSAGE")
		} else {
			_, _ = fmt.Fprintln(tw, "TIME\tPEER\tNODE\tROLE\tRPC\tEVIDENCE\tREPLICA")
		}
		for n, e := range es {
			if limit > 0 && n == limit {
				_, _ = fmt.Fprintf(tw, "... %d more\n", len(es)-limit)
				break
			}
			row := []string{e.Time.UTC().Format(time.RFC3339), e.Peer, dash(e.Node), dash(e.Role), dash(e.RPC)}
			if withReason {
				row = append(row, e.Reason, fmt.Sprint(max(e.Count, 1)), shortDigest(e.EvidenceSHA256), dash(e.Replica), oneLine(e.Message))
			} else {
				row = append(row, shortDigest(e.EvidenceSHA256), dash(e.Replica))
			}
			_, _ = fmt.Fprintln(tw, strings.Join(row, "\t"))
		}
		_ = tw.Flush()
	}
	section("REJECTED", rejected, true)
	section("ACCEPTED", accepted, false)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func shortDigest(d string) string {
	if len(d) > 16 {
		return "sha256:" + d[:16]
	}
	return dash(d)
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
