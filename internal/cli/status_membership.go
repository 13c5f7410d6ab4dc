package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
)

// removedMachine is one removed machine in statusReport.
type removedMachine struct {
	Node     string    `json:"node"`
	Role     string    `json:"role"`
	Identity string    `json:"identity"`
	Removed  time.Time `json:"removed"`
	// Etcd is where the removal of a control plane's etcd member stands (pending, removed, absent).
	Etcd        string `json:"etcd,omitempty"`
	EtcdMessage string `json:"etcdMessage,omitempty"`
}

// splitMembership separates the membership events (control-plane joins that finished or timed
// out, removals, re-admissions) from the join attempts.
func splitMembership(entries []joinledger.Entry) (joins, membership []joinledger.Entry) {
	for _, e := range entries {
		if joinledger.IsMembership(e) {
			membership = append(membership, e)
		} else {
			joins = append(joins, e)
		}
	}
	return joins, membership
}

// readRemoved returns the machines an operator removed and did not re-admit, newest first.
func readRemoved(ctx context.Context, client kubernetes.Interface, namespace string) ([]removedMachine, error) {
	ms, err := machines.Read(ctx, client, namespace)
	if errors.Is(err, machines.ErrNoRecord) {
		return []removedMachine{}, nil
	}
	if err != nil {
		return nil, err
	}
	out := []removedMachine{}
	for i := len(ms) - 1; i >= 0; i-- {
		m := ms[i]
		if !m.Revoked() {
			continue
		}
		out = append(out, removedMachine{Node: m.Node, Role: m.Role, Identity: m.Identity, Removed: m.Removal.Time.UTC(),
			Etcd: string(m.Removal.Etcd), EtcdMessage: m.Removal.EtcdMessage})
	}
	return out, nil
}

// membershipRecords returns the membership events newest first, at most limit (0: all), and how
// many were left out.
func membershipRecords(membership []joinledger.Entry, limit int) ([]ledgerRecord, int) {
	out := []ledgerRecord{}
	for i := len(membership) - 1; i >= 0; i-- {
		if limit > 0 && len(out) == limit {
			return out, i + 1
		}
		e := membership[i]
		out = append(out, ledgerRecord{Time: e.Time.UTC(), Peer: e.Peer, Node: e.Node, Role: e.Role, RPC: e.RPC, Outcome: e.Outcome,
			Reason: e.Reason, Message: e.Message, Count: max(e.Count, 1), EvidenceSHA256: e.EvidenceSHA256, Replica: e.Replica})
	}
	return out, 0
}

// printMembership prints the membership events, newest first, then the removed machines.
func printMembership(out io.Writer, membership []joinledger.Entry, removed []removedMachine, limit int) {
	records, omitted := membershipRecords(membership, limit)
	_, _ = fmt.Fprintf(out, "\nMEMBERSHIP (%d: control-plane joins finished or timed out, removals, re-admissions; newest first)\n", len(membership))
	if len(records) > 0 {
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		_, _ = fmt.Fprintln(tw, "TIME\tNODE\tROLE\tEVENT\tOUTCOME\tREASON\tREPLICA\tMESSAGE")
		for _, r := range records {
			row := []string{r.Time.Format(time.RFC3339), dash(r.Node), dash(r.Role), r.RPC, r.Outcome, dash(r.Reason), dash(r.Replica), oneLine(r.Message)}
			for i := range row {
				row[i] = printable(row[i])
			}
			_, _ = fmt.Fprintln(tw, strings.Join(row, "\t"))
		}
		if omitted > 0 {
			_, _ = fmt.Fprintf(tw, "... %d more\n", omitted)
		}
		_ = tw.Flush()
	}
	_, _ = fmt.Fprintf(out, "\nREMOVED MACHINES (%d: refused with REVOKED by the joinservice, their nodes' writes by the API server, until berth node readmit)\n", len(removed))
	if len(removed) == 0 {
		return
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "REMOVED\tNODE\tROLE\tIDENTITY\tETCD MEMBER")
	for _, m := range removed {
		etcd := dash(m.Etcd)
		if m.EtcdMessage != "" && m.Etcd == string(machines.EtcdPending) {
			etcd += " (" + oneLine(m.EtcdMessage) + ")"
		}
		row := []string{m.Removed.Format(time.RFC3339), m.Node, dash(m.Role), machines.Short(m.Identity), etcd}
		for i := range row {
			row[i] = printable(row[i])
		}
		_, _ = fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	_ = tw.Flush()
}
