package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

func newBackupCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "backup",
		Short: "The cluster's etcd snapshots: take one now, list them, check one with the master secret",
		Long: `Every cluster snapshots its etcd on a schedule: the joinservice replica that holds Lease
berth-system/berth-backup takes one every 6 hours (--backup-interval of the joinservice, at most
6h) and keeps the newest 5 (--backup-keep, at least 5) on its control plane's state disk
(` + joinconfig.BackupDir + `) and, when Secret berth-system/` + joinconfig.BackupStoreSecretName + ` names one, in an
S3-compatible object store. A snapshot is sealed under a key derived from the master secret and
carries the KMS keys the Secrets in it are encrypted under: with master-secret.json it restores the
cluster, without it it tells nothing. berth status shows the last snapshot's age and size.`,
		Example: `  berth backup now
  berth backup list
  berth backup verify --master-secret my-cluster/master-secret.json etcd-20300101T000000.000Z.berth-snapshot`,
		Args: cobra.NoArgs,
		RunE: groupHelp,
	}
	cmd.AddCommand(newBackupNowCmd(), newBackupListCmd(), newBackupVerifyCmd(), newBackupRestoreEtcdCmd())
	return cmd
}

func newBackupNowCmd() *cobra.Command {
	var kube kubeOptions
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "now",
		Short: "Take a snapshot now and wait until every store holds it",
		Long: `berth backup now asks the backup schedule for a snapshot (key request of ConfigMap
berth-system/berth-backup) and waits until the replica that schedules has taken it and written it to
every store, then prints its name and size. It fails with the schedule's error when a store refused.`,
		Example: `  berth backup now
  berth backup now --kubeconfig admin.conf --timeout 2m`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			client, err := kube.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			st, err := backupNow(ctx, client, joinconfig.Namespace)
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "Snapshot %s taken by %s: %s, in %d stores.\n",
				st.LastSuccess.Name, printable(st.Leader), byteSize(st.LastSuccess.Size), len(st.Stores))
			return nil
		},
	}
	kube.addFlags(cmd.Flags())
	cmd.Flags().DurationVar(&timeout, "timeout", 10*time.Minute, "how long to wait for the snapshot")
	return cmd
}

// errBackupFailed is the schedule's failure of a requested snapshot.
var errBackupFailed = errors.New("the snapshot failed")

// backupNow requests a snapshot and waits for the schedule's answer.
func backupNow(ctx context.Context, client kubernetes.Interface, ns string) (backup.Status, error) {
	req, err := backup.Request(ctx, client, ns, time.Now())
	if err != nil {
		return backup.Status{}, err
	}
	var st backup.Status
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		var err error
		st, _, err = backup.ReadStatus(ctx, client, ns)
		return err == nil && !st.LastAttempt.Before(req), nil
	})
	if err != nil {
		return st, fmt.Errorf("waiting for the snapshot (is a joinservice running? Lease %s/%s names the replica that schedules): %w", ns, joinconfig.BackupName, err)
	}
	if st.LastError != "" {
		return st, fmt.Errorf("%w: %s", errBackupFailed, printable(st.LastError))
	}
	return st, nil
}

func newBackupListCmd() *cobra.Command {
	var kube kubeOptions
	var dir string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the snapshots, oldest first",
		Long: `berth backup list prints the snapshots the schedule's first store (the control plane's state
disk) holds, as the schedule last reported them, oldest first. With --dir it lists a local directory
of snapshots instead (one copied off a control plane or out of the object store) and needs no cluster.`,
		Example: `  berth backup list
  berth backup list --dir ./snapshots`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			var objs []backup.Object
			if dir != "" {
				var err error
				if objs, err = backup.NewDir(dir).List(ctx); err != nil {
					return err
				}
			} else {
				client, err := kube.client()
				if err != nil {
					return err
				}
				st, _, err := backup.ReadStatus(ctx, client, joinconfig.Namespace)
				if err != nil {
					return err
				}
				objs = st.Snapshots
			}
			printSnapshots(cmd.OutOrStdout(), objs, time.Now())
			return nil
		},
	}
	kube.addFlags(cmd.Flags())
	cmd.Flags().StringVar(&dir, "dir", "", "list this directory's snapshots instead of the cluster's")
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

func printSnapshots(out io.Writer, objs []backup.Object, now time.Time) {
	if len(objs) == 0 {
		_, _ = fmt.Fprintln(out, "No snapshots.")
		return
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "NAME\tTAKEN\tAGE\tSIZE")
	for _, o := range objs {
		_, _ = fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", o.Name, o.Taken.Format(time.RFC3339), now.Sub(o.Taken).Round(time.Second), byteSize(o.Size))
	}
	_ = tw.Flush()
}

func newBackupVerifyCmd() *cobra.Command {
	var masterSecret string
	cmd := &cobra.Command{
		Use:   "verify --master-secret FILE SNAPSHOT",
		Short: "Open a snapshot file with the master secret and check every byte of it",
		Long: `berth backup verify opens a snapshot with master-secret.json, reads it to its end (every chunk
is authenticated: a changed or cut file fails) and prints what it carries: the cluster ID, when it
was taken, the KMS key generations (not the keys) and the size of etcd's data. A snapshot of another
cluster, or the wrong master secret, fails with "does not open with this master secret".`,
		Example: `  berth backup verify --master-secret my-cluster/master-secret.json etcd-20300101T000000.000Z.berth-snapshot`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if masterSecret == "" {
				return usageErr("verify needs --master-secret")
			}
			keys, err := readMasterSecret(masterSecret)
			if err != nil {
				return err
			}
			f, err := os.Open(args[0])
			if err != nil {
				return usageErr("%w", err)
			}
			defer f.Close()
			m, r, err := backup.Open(f, keys)
			if err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			n, err := io.Copy(io.Discard, r)
			if err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			gens := make([]uint32, 0, len(m.KMS.Keys))
			for g := range m.KMS.Keys {
				v, _ := strconv.ParseUint(g, 10, 32)
				gens = append(gens, uint32(v))
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "Snapshot of cluster %s taken %s: %s of etcd data, KMS generations %v (active %d). It opens with this master secret.\n",
				m.ClusterID, m.Taken.Format(time.RFC3339), byteSize(n), gens, m.KMS.Active)
			return nil
		},
	}
	cmd.Flags().StringVar(&masterSecret, "master-secret", "", "the cluster's master-secret.json, as berth init wrote it (required)")
	return cmd
}

func newBackupRestoreEtcdCmd() *cobra.Command {
	var masterSecret, dataDir string
	var member backup.Member
	cmd := &cobra.Command{
		Use:   "restore-etcd --master-secret FILE --data-dir DIR --name NAME --peer-url URL SNAPSHOT",
		Short: "Restore a snapshot's etcd data into a new data directory (the manual restore path)",
		Long: `berth backup restore-etcd opens a snapshot with master-secret.json, reads it to its end (a damaged
file writes nothing) and restores etcd's data into --data-dir, which must not exist, as a one-member
cluster: --name and --peer-url are the member's, as kubeadm names them on the control plane that runs
it (the node name, https://ADDRESS:2380). etcd's revision moves a billion past the snapshot's and the
snapshot's is marked compacted, so no watch takes the old data for new. It prints the KMS key
generations the restored Secrets are encrypted under; they derive from the same master secret.

This is the manual part of a restore: kubeadm init on the first new control plane with this
directory as its etcd data directory (--ignore-preflight-errors=DirAvailable--var-lib-etcd). berth
restore, which does it on fresh machines end to end, is not built yet (internal/backup/README.md).`,
		Example: `  berth backup restore-etcd --master-secret my-cluster/master-secret.json --data-dir /var/lib/etcd \
    --name cp1 --peer-url https://198.51.100.10:2380 etcd-20300101T000000.000Z.berth-snapshot`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if masterSecret == "" || dataDir == "" || member.Name == "" || member.PeerURL == "" {
				return usageErr("restore-etcd needs --master-secret, --data-dir, --name and --peer-url")
			}
			keys, err := readMasterSecret(masterSecret)
			if err != nil {
				return err
			}
			f, err := os.Open(args[0])
			if err != nil {
				return usageErr("%w", err)
			}
			defer f.Close()
			m, err := backup.Restore(f, keys, member, dataDir, nil)
			if err != nil {
				return fmt.Errorf("%s: %w", args[0], err)
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "etcd data of cluster %s (taken %s) restored into %s as member %s (%s); Secrets are under KMS generation %d.\n",
				m.ClusterID, m.Taken.Format(time.RFC3339), dataDir, printable(member.Name), printable(member.PeerURL), m.KMS.Active)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&masterSecret, "master-secret", "", "the cluster's master-secret.json, as berth init wrote it (required)")
	f.StringVar(&dataDir, "data-dir", "", "etcd data directory to create (required; must not exist)")
	f.StringVar(&member.Name, "name", "", "the restored member's name (required; kubeadm: the node name)")
	f.StringVar(&member.PeerURL, "peer-url", "", "the restored member's peer URL (required; kubeadm: https://ADDRESS:2380)")
	return cmd
}

// byteSize prints n bytes in the largest binary unit that keeps it at 1 or more.
func byteSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// backupReport is the backup section of berth status -o json|yaml.
type backupReport struct {
	// Found is false when the schedule has not reported yet.
	Found       bool            `json:"found"`
	Leader      string          `json:"leader,omitempty"`
	Stores      []string        `json:"stores,omitempty"`
	LastSuccess *backup.Object  `json:"lastSuccess,omitempty"`
	AgeSeconds  float64         `json:"ageSeconds,omitempty"`
	LastAttempt time.Time       `json:"lastAttempt,omitzero"`
	LastError   string          `json:"lastError,omitempty"`
	Snapshots   []backup.Object `json:"snapshots,omitempty"`
	// Stale is true when the last success is older than two intervals, or there is none.
	Stale bool `json:"stale"`
}

func readBackupSection(ctx context.Context, client kubernetes.Interface, ns string, now time.Time) (backupReport, error) {
	st, _, err := backup.ReadStatus(ctx, client, ns)
	if err != nil {
		return backupReport{}, err
	}
	r := backupReport{Found: !st.LastAttempt.IsZero(), Leader: st.Leader, Stores: st.Stores, LastSuccess: st.LastSuccess,
		LastAttempt: st.LastAttempt, LastError: st.LastError, Snapshots: st.Snapshots, Stale: true}
	if age, ok := st.Age(now); ok {
		r.AgeSeconds = age.Seconds()
		interval := st.Interval
		if interval == 0 {
			interval = backup.DefaultInterval
		}
		r.Stale = age > 2*interval
	}
	return r, nil
}

func printBackupSection(out io.Writer, r backupReport, err error) {
	_, _ = fmt.Fprintln(out, "\nBackups (etcd snapshots):")
	switch {
	case err != nil:
		_, _ = fmt.Fprintf(out, "  cannot read the backup status: %s\n", printable(err.Error()))
		return
	case !r.Found:
		_, _ = fmt.Fprintln(out, "  WARNING: no snapshot attempted yet (no joinservice has reported to ConfigMap berth-system/berth-backup)")
		return
	}
	if r.LastSuccess == nil {
		_, _ = fmt.Fprintln(out, "  WARNING: no snapshot has succeeded yet")
	} else {
		warn := ""
		if r.Stale {
			warn = "WARNING: stale: "
		}
		_, _ = fmt.Fprintf(out, "  %slast success %s, %s old, %s (%s)\n", warn, r.LastSuccess.Name,
			time.Duration(r.AgeSeconds*float64(time.Second)).Round(time.Second), byteSize(r.LastSuccess.Size), r.LastSuccess.Taken.Format(time.RFC3339))
	}
	if r.LastError != "" {
		_, _ = fmt.Fprintf(out, "  WARNING: the last attempt (%s) failed: %s\n", r.LastAttempt.Format(time.RFC3339), printable(r.LastError))
	}
	_, _ = fmt.Fprintf(out, "  taken by %s into %d stores; %d snapshots kept on its state disk\n", printable(r.Leader), len(r.Stores), len(r.Snapshots))
}
