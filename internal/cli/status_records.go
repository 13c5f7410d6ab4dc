package cli

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// recordsPage is how many objects one list request of berth status asks for.
const recordsPage = 1000

// recordsReport is the record API's section of berth status (internal/records).
type recordsReport struct {
	// Served is false when the cluster does not serve the record API (a cluster installed before it).
	Served bool `json:"served"`
	// Machines counts the Machines by state.
	Machines map[string]int `json:"machines"`
	// Refusals are the JoinRecords, latest refusal first, at most --limit; OmittedRefusals counts
	// the ones left out.
	Refusals        []refusalRecord `json:"refusals"`
	OmittedRefusals int             `json:"omittedRefusals"`
	// Node is the one node berth status NODE asked for.
	Node *nodeReport `json:"node,omitempty"`
}

// refusalRecord is one JoinRecord.
type refusalRecord struct {
	Class          string    `json:"class"`
	Identity       string    `json:"identity,omitempty"`
	Peer           string    `json:"peer"`
	Node           string    `json:"node"`
	RPC            string    `json:"rpc"`
	Reason         string    `json:"reason"`
	Count          int64     `json:"count"`
	First          time.Time `json:"first"`
	Last           time.Time `json:"last"`
	Message        string    `json:"message"`
	EvidenceSHA256 string    `json:"evidenceSHA256"`
}

// nodeReport is what the record API holds about one node.
type nodeReport struct {
	Name     string             `json:"name"`
	Machines []v1alpha1.Machine `json:"machines"`
	Refusals []refusalRecord    `json:"refusals"`
}

// readRecords reads the record API's Machines and JoinRecords in namespace; node, if set, selects
// one node's machines and refusals for the node section.
func readRecords(ctx context.Context, rc clientset.Interface, namespace, node string, limit int) (*recordsReport, error) {
	r := &recordsReport{Machines: map[string]int{}}
	var nodeMachines []v1alpha1.Machine
	opts := metav1.ListOptions{Limit: recordsPage}
	for {
		list, err := rc.RecordsV1alpha1().Machines(namespace).List(ctx, opts)
		if apierrors.IsNotFound(err) {
			return r, nil // the record API is not installed
		}
		if err != nil {
			return nil, fmt.Errorf("listing machines: %w", err)
		}
		for _, m := range list.Items {
			r.Machines[string(m.Status.State)]++
			if node != "" && m.Spec.Node == node {
				nodeMachines = append(nodeMachines, m)
			}
		}
		if opts.Continue = list.Continue; opts.Continue == "" {
			break
		}
	}
	r.Served = true
	var all []refusalRecord
	opts = metav1.ListOptions{Limit: recordsPage}
	for {
		list, err := rc.RecordsV1alpha1().JoinRecords(namespace).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("listing join records: %w", err)
		}
		for _, jr := range list.Items {
			all = append(all, refusalRecord{Class: jr.Spec.Class, Identity: jr.Spec.Identity, Peer: jr.Spec.Peer, Node: jr.Spec.Node,
				RPC: jr.Spec.RPC, Reason: jr.Spec.Reason, Count: jr.Status.Count, First: jr.Status.First.Time, Last: jr.Status.Last.Time,
				Message: jr.Status.Message, EvidenceSHA256: jr.Status.EvidenceSHA256})
		}
		if opts.Continue = list.Continue; opts.Continue == "" {
			break
		}
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].Last.After(all[j].Last) })
	if node != "" {
		r.Node = &nodeReport{Name: node, Machines: nodeMachines}
		// A refusal of what a node sent before it proved anything (the handshake's) carries only its
		// address: berth status ADDRESS shows those.
		for _, rr := range all {
			if rr.Node == node || rr.Peer == node {
				r.Node.Refusals = append(r.Node.Refusals, rr)
			}
		}
		sort.SliceStable(r.Node.Machines, func(i, j int) bool {
			return r.Node.Machines[i].Status.Admitted.After(r.Node.Machines[j].Status.Admitted.Time)
		})
	}
	r.Refusals = all
	if limit > 0 && len(all) > limit {
		r.Refusals, r.OmittedRefusals = all[:limit], len(all)-limit
	}
	return r, nil
}

// printRecords prints the record API's section: the machines by state and the refusals.
func printRecords(out io.Writer, r *recordsReport) {
	if r == nil {
		return
	}
	if !r.Served {
		_, _ = fmt.Fprintln(out, "\nThe cluster does not serve the record API ("+records.MachineCRDName+"): it was installed by an earlier version.")
		return
	}
	states := []string{string(v1alpha1.StateAdmitted), string(v1alpha1.StateLocked), string(v1alpha1.StateRemoved)}
	var parts []string
	for _, s := range states {
		parts = append(parts, strconv.Itoa(r.Machines[s])+" "+strings.ToLower(s))
	}
	_, _ = fmt.Fprintf(out, "\nMACHINES (kubectl get %s): %s\n", records.MachinePlural, strings.Join(parts, ", "))
	_, _ = fmt.Fprintf(out, "\nREFUSED JOINS BY MACHINE OR PEER AND REASON (kubectl get %s), latest first\n", records.JoinRecordPlural)
	if len(r.Refusals) == 0 {
		_, _ = fmt.Fprintln(out, "  none")
		return
	}
	printRefusals(out, r.Refusals)
	if r.OmittedRefusals > 0 {
		_, _ = fmt.Fprintf(out, "  ... %d more (--limit)\n", r.OmittedRefusals)
	}
}

func printRefusals(out io.Writer, rs []refusalRecord) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "  LAST\tNODE\tPEER\tCLASS\tREASON\tCOUNT\tMESSAGE")
	for _, rr := range rs {
		_, _ = fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%d\t%s\n", rr.Last.UTC().Format(time.RFC3339), printable(dash(rr.Node)), printable(rr.Peer),
			rr.Class, printable(rr.Reason), rr.Count, printable(oneLine(rr.Message)))
	}
	_ = tw.Flush()
	codes := make([]string, 0, len(rs))
	for _, rr := range rs {
		codes = append(codes, rr.Reason)
	}
	printReasonLegend(out, codes)
}

// printNode prints berth status NODE: the node's machines, their latest join and evidence, and the
// node's refusals.
func printNode(out io.Writer, r *recordsReport) {
	n := r.Node
	if n == nil {
		return
	}
	if !r.Served {
		_, _ = fmt.Fprintln(out, "The cluster does not serve the record API ("+records.MachineCRDName+"): it was installed by an earlier version.")
		return
	}
	if len(n.Machines) == 0 {
		_, _ = fmt.Fprintf(out, "No machine joined as node %s: the cluster never admitted it.\n", printable(n.Name))
		if len(n.Refusals) == 0 {
			_, _ = fmt.Fprintln(out, "No refusal names it. A refusal in the handshake, before the node proved anything, carries only its address: try berth status ADDRESS. "+
				"The node's own trace is "+jointrace.FileName+" in its state directory.")
		} else {
			_, _ = fmt.Fprintln(out, "What the joinservices saw of it is below; its own trace is "+jointrace.FileName+" in its state directory.")
		}
	}
	for _, m := range n.Machines {
		_, _ = fmt.Fprintf(out, "Node %s: machine %s (%s), %s, admitted %s\n", printable(m.Spec.Node), machines.Short(m.Spec.Identity), m.Spec.Role,
			m.Status.State, m.Status.Admitted.UTC().Format(time.RFC3339))
		if m.Status.Removed != nil {
			_, _ = fmt.Fprintf(out, "  removed %s\n", m.Status.Removed.UTC().Format(time.RFC3339))
		}
		if j := m.Status.LastJoin; j != nil {
			_, _ = fmt.Fprintf(out, "  last %s %s from %s, answered by %s\n", j.RPC, j.Time.UTC().Format(time.RFC3339), printable(dash(j.Peer)), printable(dash(j.Replica)))
		}
		if ev := m.Status.Evidence; ev != nil {
			_, _ = fmt.Fprintf(out, "  evidence %s (%s)\n", shortDigest(ev.SHA256), printable(ev.Variant))
			idx := make([]int, 0, len(ev.Measurements))
			for k := range ev.Measurements {
				if i, err := strconv.Atoi(k); err == nil {
					idx = append(idx, i)
				}
			}
			slices.Sort(idx)
			for _, i := range idx {
				_, _ = fmt.Fprintf(out, "    %2d  %s\n", i, printable(ev.Measurements[strconv.Itoa(i)]))
			}
		}
		printTrace(out, m.Status.JoinTrace)
	}
	if len(n.Refusals) > 0 {
		_, _ = fmt.Fprintln(out, "Refused joins of this node, latest first:")
		printRefusals(out, n.Refusals)
	}
}

// printTrace prints a Machine's join trace: one line per phase with its outcome, duration and
// start, a failed phase's reason and its explanation, and the total.
func printTrace(out io.Writer, tr *v1alpha1.JoinTrace) {
	if tr == nil {
		_, _ = fmt.Fprintln(out, "  join trace: not reported (a node reports it once its join ended; its own copy is "+jointrace.FileName+" in its state directory)")
		return
	}
	_, _ = fmt.Fprintf(out, "  join trace, reported %s:\n", tr.Reported.UTC().Format(time.RFC3339))
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "    PHASE\tOUTCOME\tDURATION\tSTARTED\tREASON\tMESSAGE")
	var codes []string
	for _, p := range tr.Phases {
		_, _ = fmt.Fprintf(tw, "    %s\t%s\t%s\t%s\t%s\t%s\n", printable(p.Name), printable(p.Outcome), formatDuration(p.Duration.Duration),
			p.Start.UTC().Format(time.RFC3339), printable(dash(p.Reason)), printable(dash(oneLine(p.Message))))
		if p.Reason != "" {
			codes = append(codes, p.Reason)
		}
	}
	_ = tw.Flush()
	if n := len(tr.Phases); n > 0 {
		end := tr.Phases[n-1].Start.Add(tr.Phases[n-1].Duration.Duration)
		_, _ = fmt.Fprintf(out, "    in all %s, from the first phase's start to the last one's end\n", formatDuration(end.Sub(tr.Phases[0].Start.Time)))
	}
	printReasonLegend(out, codes)
}

// formatDuration prints d to the millisecond below a minute and to the second above.
func formatDuration(d time.Duration) string {
	if d >= time.Minute {
		return d.Round(time.Second).String()
	}
	return d.Round(time.Millisecond).String()
}
