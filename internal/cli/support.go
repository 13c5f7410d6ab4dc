package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/afero"
	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/supportbundle"
)

func newSupportCmd() *cobra.Command {
	var kube kubeOptions
	var out, miniDir string
	var tail int64
	var since, timeout time.Duration
	var force bool
	cmd := &cobra.Command{
		Use:   "support",
		Short: "Collect the cluster's records, events and redacted logs into one archive to send with a question",
		Long: `berth support writes one gzipped tar archive with what a person helping you needs to see:
the Nodes, Berth's ConfigMaps (join ledger, machine record, backups, KMS key spec, the cluster
configuration) and kubeadm's, the record API's Machines and JoinRecords (with each machine's join
trace and evidence), the Events of berth-system and of the Nodes, the latest log lines of every pod
in berth-system and kube-system (and of a container's previous instance when it restarted), and
berth status -o json.

Secrets are never read, nor the operator's workspace. Every log and object is passed through
redaction first (private keys, bearer and bootstrap tokens, JSON web tokens, values of keys named
like token, password, secret or certificate-key). MANIFEST.txt, the archive's first file, lists
every file, what could not be collected and why (a forbidden list, a node whose kubelet does not
answer), what is left out on purpose, and how many values redaction replaced. Read it before you
send the archive.

A machine's own bootstrapper log (its boot stage, or a join that never got a kubelet running) is
out of the API server's reach: on the image it is journalctl -u berth-bootstrapper; for a mini
cluster, --mini-dir adds every node's.`,
		Example: `  berth support
  berth support --out /tmp/cluster.tar.gz --tail-lines 2000 --since 6h
  berth support --kubeconfig /var/lib/berth-mini/admin.conf --mini-dir /var/lib/berth-mini`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if tail < 0 {
				return usageErr("--tail-lines %d: want 0 (all) or more", tail)
			}
			now := time.Now()
			if out == "" {
				out = "berth-support-" + now.UTC().Format("20060102T150405Z") + ".tar.gz"
			}
			if _, err := os.Stat(out); err == nil && !force {
				return usageErr("%s exists: pass --force to replace it", out)
			}
			extra := map[string]func(io.Writer) error{}
			if miniDir != "" {
				logs, err := filepath.Glob(filepath.Join(miniDir, "nodes", "*", "logs", "bootstrapper.log"))
				if err != nil || len(logs) == 0 {
					return usageErr("--mini-dir %s: no nodes/NODE/logs/bootstrapper.log under it (a berth mini up directory?)", miniDir)
				}
				for _, l := range logs {
					node := filepath.Base(filepath.Dir(filepath.Dir(l)))
					extra["nodes/"+node+"/bootstrapper.log"] = supportbundle.TailFile(l, tail)
				}
			}
			client, rc, err := kube.clients()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			extra["status.json"] = func(w io.Writer) error {
				return runStatusRecords(ctx, w, client, rc, nil, joinconfig.Namespace, "", 0, outputJSON)
			}
			var s supportbundle.Summary
			if err := atomicfile.WriteFrom(afero.NewOsFs(), out, 0o600, func(w io.Writer) error {
				var err error
				s, err = supportbundle.Collect(ctx, w, supportbundle.Sources{Kube: client, Records: rc},
					supportbundle.Options{Namespace: joinconfig.Namespace, TailLines: tail, Since: since, Now: now, Extra: extra})
				return err
			}); err != nil {
				return err
			}
			printSupportSummary(cmd.OutOrStdout(), out, s)
			return nil
		},
	}
	f := cmd.Flags()
	kube.addFlags(f)
	f.StringVarP(&out, "out", "o", "", "archive to write (default: berth-support-TIME.tar.gz in the current directory), mode 0600")
	f.BoolVar(&force, "force", false, "replace --out if it exists")
	f.Int64Var(&tail, "tail-lines", 1000, "latest log lines kept per container and per node log (0: all)")
	f.DurationVar(&since, "since", 0, "keep only pod log lines younger than this (0: no limit)")
	f.StringVar(&miniDir, "mini-dir", "", "a berth mini up directory: also add every node's bootstrapper log")
	f.DurationVar(&timeout, "timeout", 2*time.Minute, "how long to collect for")
	return cmd
}

// printSupportSummary says what the archive holds, what could not be collected and what was
// redacted; everything read from the cluster is escaped.
func printSupportSummary(w io.Writer, path string, s supportbundle.Summary) {
	_, _ = fmt.Fprintf(w, "Wrote %s: %d files (MANIFEST.txt lists them).\n", path, len(s.Files))
	if len(s.Problems) > 0 {
		_, _ = fmt.Fprintf(w, "Could not collect %d:\n", len(s.Problems))
		for _, p := range s.Problems {
			_, _ = fmt.Fprintf(w, "  %s\n", printable(oneLine(p)))
		}
	}
	n := 0
	for _, c := range s.Redacted {
		n += c
	}
	_, _ = fmt.Fprintf(w, "Redacted %d values; Secrets and the workspace were not read. Read MANIFEST.txt before you send it.\n", n)
}
