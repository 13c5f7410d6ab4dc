package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/records/clientset"
)

func newStatusCmd() *cobra.Command {
	var kube kubeOptions
	var output outputFormat
	var namespace string
	var limit int
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "status [NODE]",
		Short: "Show the cluster's join ledger (rejected nodes, accepted joins, membership changes), certificates and encryption at rest",
		Long: `berth status reads the join ledger the joinservice keeps in the cluster (ConfigMap
berth-join-ledger in berth-system: the latest join attempts of every joinservice replica) and
prints the rejected attempts first, newest first, with their reason code and message, then the
accepted ones. The same attempts are Events on that ConfigMap:
  kubectl -n berth-system get events --field-selector involvedObject.name=berth-join-ledger

Then the membership events (control-plane joins that finished or whose slot a timeout freed, nodes
removed and re-admitted with berth node) and the removed machines the joinservice refuses with
REVOKED (ConfigMap berth-machines), whose nodes' credentials the API server refuses every write.

Then the record API (kubectl get machines, kubectl get joinrecords): the Machines by state and the
refused joins aggregated per machine or peer and reason, latest first. berth status NODE prints
only what the record API holds about one node: its machine, state, latest join, the evidence of
its latest attestation with its measurements, the phases of its join with their durations as the
node reported them, and its refused joins. NODE may also be a peer address: refusals in the
handshake, before a node proved anything, carry only its address.

Then it prints the certificates Berth renews, the earliest expiry first: the image-policy webhook's
serving certificate and CA bundle (renewed by the certificate keeper, the joinservice replica that
holds Lease berth-system/berth-cert-keeper) and each control plane's kubeadm certificates (renewed
by that control plane itself, which records their earliest expiry on its Node).

Then the encryption at rest of Secrets: the API server's kms-providers check and every control
plane's KMS plugin (berth secrets status prints the same section).

Then your own credential: the client certificate of the kubeconfig status reads with, until when
it is valid, and a warning once less than a quarter of its validity (at most a week) is left. With
a certificate that has already expired, status stops before connecting and says how to get a new
one (berth kubeconfig).

Then the backups: the last etcd snapshot the schedule stored, its age and size, and a warning when
it is older than two intervals, when none succeeded, or when the last attempt failed (berth backup).

The cluster is found as kubectl finds it: --kubeconfig, else the files in KUBECONFIG, else
~/.kube/config; --context picks another context. With -o json or -o yaml the same report comes
as one document (its field names are stable; certificates are under "certificates"); --limit
applies to both.`,
		Example: `  export KUBECONFIG=/var/lib/berth-mini/admin.conf
  berth status
  berth status --kubeconfig admin.conf --context berth-admin@berth
  berth status -o json | jq -r '.rejected[] | [.peer, .reason] | @tsv'
  berth status w1`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if limit < 0 {
				return usageErr("--limit %d: want 0 (all) or more", limit)
			}
			cfg, err := kube.restConfig()
			if err != nil {
				return err
			}
			cred, err := readOperatorCredential(cfg, time.Now())
			if err != nil {
				return err
			}
			client, rc, err := clientsFor(cfg)
			if err != nil {
				return err
			}
			node := ""
			if len(args) == 1 {
				node = args[0]
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			return runStatusRecords(ctx, cmd.OutOrStdout(), client, rc, cred, namespace, node, limit, output)
		},
	}
	f := cmd.Flags()
	kube.addFlags(f)
	addOutputFlag(f, &output)
	f.StringVarP(&namespace, "namespace", "n", joinconfig.Namespace, "namespace of Berth's components")
	f.IntVar(&limit, "limit", 50, "most attempts to print per section (0: all)")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

// statusReport is what berth status -o json|yaml prints. Its field names are stable.
type statusReport struct {
	// Namespace is where the ledger was looked for.
	Namespace string `json:"namespace"`
	// LedgerFound is false when the cluster has no ledger ConfigMap yet (no join attempt so far).
	LedgerFound bool `json:"ledgerFound"`
	// Records is the number of ledger entries; Attempts counts the attempts they stand for.
	Records          int `json:"records"`
	Attempts         int `json:"attempts"`
	RejectedAttempts int `json:"rejectedAttempts"`
	AcceptedAttempts int `json:"acceptedAttempts"`
	// Rejected and Accepted are the entries, newest first, at most --limit of each.
	Rejected []ledgerRecord `json:"rejected"`
	Accepted []ledgerRecord `json:"accepted"`
	// Omitted counts the entries --limit left out of the two lists.
	OmittedRejected int `json:"omittedRejected"`
	OmittedAccepted int `json:"omittedAccepted"`
	// Certificates is the earliest expiry of every certificate Berth renews and who renews it
	// (statuscerts.go).
	Certificates certificatesReport `json:"certificates"`
	// Encryption is the encryption-at-rest section (secrets.go); absent when it cannot be read.
	Encryption *encryptionReport `json:"encryption,omitempty"`
	// Membership are the membership events (not counted as attempts above), newest first, at most
	// --limit; OmittedMembership counts the ones left out (status_membership.go).
	Membership        []ledgerRecord `json:"membership"`
	OmittedMembership int            `json:"omittedMembership"`
	// RemovedMachines are the machines an operator removed and did not re-admit, newest first.
	RemovedMachines []removedMachine `json:"removedMachines"`
	// Backups is the etcd snapshot schedule's health (backup.go); absent when it cannot be read.
	Backups *backupReport `json:"backups,omitempty"`
	// RecordAPI is the record API's section (status_records.go); absent when not read.
	RecordAPI *recordsReport `json:"recordAPI,omitempty"`
	// ClusterConfig is the configuration the cluster keeps (status_config.go); absent when it
	// keeps none.
	ClusterConfig *clusterConfigReport `json:"clusterConfig,omitempty"`
	// OperatorCredential is the client certificate this status was read with (status_credential.go);
	// absent when the kubeconfig authenticates otherwise.
	OperatorCredential *operatorCredential `json:"operatorCredential,omitempty"`
}

// ledgerRecord is one ledger entry in statusReport.
type ledgerRecord struct {
	Time    time.Time `json:"time"`
	Peer    string    `json:"peer"`
	Node    string    `json:"node"`
	Role    string    `json:"role"`
	RPC     string    `json:"rpc"`
	Outcome string    `json:"outcome"`
	Reason  string    `json:"reason"`
	Message string    `json:"message"`
	// Count is how many attempts the entry stands for (1, or more for rate-limited attempts).
	Count          int    `json:"count"`
	EvidenceSHA256 string `json:"evidenceSHA256"`
	Replica        string `json:"replica"`
}

func runStatus(ctx context.Context, out io.Writer, client kubernetes.Interface, namespace string, limit int, output outputFormat) error {
	return runStatusRecords(ctx, out, client, nil, nil, namespace, "", limit, output)
}

// runStatusRecords is runStatus with the record API's client (nil: the section is left out), the
// operator's own credential (nil: not a client certificate) and, for berth status NODE, the node.
func runStatusRecords(ctx context.Context, out io.Writer, client kubernetes.Interface, rc clientset.Interface, cred *operatorCredential, namespace, node string, limit int, output outputFormat) error {
	var recs *recordsReport
	if rc != nil {
		var err error
		if recs, err = readRecords(ctx, rc, namespace, node, limit); err != nil {
			return err
		}
	}
	if node != "" {
		if output.structured() {
			return output.encode(out, recs)
		}
		printNode(out, recs)
		return nil
	}
	entries, err := joinledger.Read(ctx, client, namespace)
	found := !errors.Is(err, joinledger.ErrNoLedger)
	if err != nil && found {
		return err
	}
	removed, err := readRemoved(ctx, client, namespace)
	if err != nil {
		return err
	}
	entries, membership := splitMembership(entries)
	certs := readCertificates(ctx, client, namespace)
	enc, encErr := encryptionSection(ctx, client)
	backups, backupErr := readBackupSection(ctx, client, namespace, time.Now())
	clusterCfg, clusterCfgErr := readClusterConfigVersion(ctx, client)
	if output.structured() {
		r := newStatusReport(namespace, found, entries, limit)
		r.Certificates = certs
		r.Encryption = enc
		r.Membership, r.OmittedMembership = membershipRecords(membership, limit)
		r.RemovedMachines = removed
		if backupErr == nil {
			r.Backups = &backups
		}
		r.RecordAPI = recs
		r.ClusterConfig = clusterCfg
		r.OperatorCredential = cred
		return output.encode(out, r)
	}
	if !found {
		_, _ = fmt.Fprintln(out, "No join attempts recorded yet (no ConfigMap "+namespace+"/"+joinledger.ConfigMapName+").")
	} else {
		printLedger(out, entries, limit)
		printMembership(out, membership, removed, limit)
	}
	printRecords(out, recs)
	printCertificates(out, certs, time.Now())
	printEncryptionSection(out, enc, encErr)
	printOperatorCredential(out, cred, time.Now())
	printBackupSection(out, backups, backupErr)
	printClusterConfig(out, clusterCfg, clusterCfgErr)
	return nil
}

// splitLedger returns the rejected and the accepted entries, each newest first.
func splitLedger(entries []joinledger.Entry) (rejected, accepted []joinledger.Entry) {
	for i := len(entries) - 1; i >= 0; i-- {
		if e := entries[i]; e.Outcome == joinledger.OutcomeAccepted {
			accepted = append(accepted, e)
		} else {
			rejected = append(rejected, e)
		}
	}
	return rejected, accepted
}

func attemptsOf(es []joinledger.Entry) int {
	n := 0
	for _, e := range es {
		n += max(e.Count, 1)
	}
	return n
}

func newStatusReport(namespace string, found bool, entries []joinledger.Entry, limit int) statusReport {
	rejected, accepted := splitLedger(entries)
	r := statusReport{
		Namespace: namespace, LedgerFound: found, Records: len(entries),
		RejectedAttempts: attemptsOf(rejected), AcceptedAttempts: attemptsOf(accepted),
		Rejected: []ledgerRecord{}, Accepted: []ledgerRecord{},
	}
	r.Attempts = r.RejectedAttempts + r.AcceptedAttempts
	records := func(es []joinledger.Entry) ([]ledgerRecord, int) {
		out := []ledgerRecord{}
		for n, e := range es {
			if limit > 0 && n == limit {
				return out, len(es) - limit
			}
			out = append(out, ledgerRecord{
				Time: e.Time.UTC(), Peer: e.Peer, Node: e.Node, Role: e.Role, RPC: e.RPC, Outcome: e.Outcome,
				Reason: e.Reason, Message: e.Message, Count: max(e.Count, 1), EvidenceSHA256: e.EvidenceSHA256, Replica: e.Replica,
			})
		}
		return out, 0
	}
	r.Rejected, r.OmittedRejected = records(rejected)
	r.Accepted, r.OmittedAccepted = records(accepted)
	return r
}

// printLedger prints rejected attempts, then accepted ones, each newest first.
func printLedger(out io.Writer, entries []joinledger.Entry, limit int) {
	rejected, accepted := splitLedger(entries)
	nRejected := attemptsOf(rejected)
	attempts := nRejected + attemptsOf(accepted)
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
			for i := range row {
				row[i] = printable(row[i]) // the ledger holds what nodes claimed
			}
			_, _ = fmt.Fprintln(tw, strings.Join(row, "\t"))
		}
		_ = tw.Flush()
		if withReason {
			var codes []string
			for n, e := range es {
				if limit > 0 && n == limit {
					break
				}
				codes = append(codes, e.Reason)
			}
			printReasonLegend(out, codes)
		}
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

// printable escapes what a terminal would act on (control characters, invalid UTF-8, tabs that would
// shift the table) as Go escapes, and keeps every other character.
func printable(s string) string {
	var b strings.Builder
	for i, r := range s {
		switch {
		case r == utf8.RuneError && !strings.HasPrefix(s[i:], string(utf8.RuneError)):
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\t' || !unicode.IsPrint(r) && r != ' ':
			b.WriteString(strings.Trim(strconv.QuoteRune(r), "'"))
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}
