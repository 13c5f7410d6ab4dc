// Package policydiff judges the admitted machines of a cluster against two measurement policies on
// the evidence the record API recorded for them (records.berth.dev Machines' status.evidence): which
// machines a new policy would refuse that the old one accepts, which it would accept again, and which
// cannot be judged (no recorded evidence, evidence of another variant, unreadable measurements).
//
// It judges measurements only, offline: no machine is contacted, and signatures, trust roots and key
// activation were checked when the evidence was recorded. `berth policy diff` and
// `berth upgrade plan` (internal/upgradeplan) both report with it.
package policydiff

import (
	"context"
	"encoding/hex"
	"fmt"
	"sort"
	"strconv"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// Report is the judgement of the admitted machines under an old and a new policy. Its JSON field
// names are stable: the CLI prints them with -o json.
type Report struct {
	// Judged counts the admitted machines with recorded evidence of the new policy's variant.
	Judged int `json:"judged"`
	// NewlyRefused are the machines the new policy refuses and the old one accepts; NewlyAccepted
	// the other way round. Both are sorted by node name.
	NewlyRefused  []Verdict `json:"newlyRefused"`
	NewlyAccepted []Verdict `json:"newlyAccepted"`
	// Unjudged are the admitted machines without usable recorded evidence of the variant.
	Unjudged []Verdict `json:"unjudged"`
}

// Verdict is one machine in a Report.
type Verdict struct {
	Node     string `json:"node"`
	Identity string `json:"identity"`
	Role     string `json:"role"`
	// Evidence is the hex SHA-256 of the judged attestation document.
	Evidence string `json:"evidence,omitempty"`
	// Reason is the refusing policy's mismatch, or why the machine was not judged.
	Reason string `json:"reason"`
}

// Judge judges the recorded measurements of the admitted machines in ms against both policies.
// Machines that are not admitted (locked, removed) are left out.
func Judge(oldPolicy, newPolicy *policy.Policy, ms []v1alpha1.Machine) Report {
	r := Report{NewlyRefused: []Verdict{}, NewlyAccepted: []Verdict{}, Unjudged: []Verdict{}}
	for _, m := range ms {
		if m.Status.State != v1alpha1.StateAdmitted {
			continue
		}
		v := Verdict{Node: m.Spec.Node, Identity: m.Spec.Identity, Role: m.Spec.Role}
		ev := m.Status.Evidence
		switch {
		case ev == nil:
			v.Reason = "no recorded evidence"
			r.Unjudged = append(r.Unjudged, v)
			continue
		case ev.Variant != newPolicy.Variant:
			v.Reason = "evidence of variant " + ev.Variant + ", the new policy's is " + newPolicy.Variant
			r.Unjudged = append(r.Unjudged, v)
			continue
		}
		measured, err := Measurements(ev)
		if err != nil {
			v.Reason = err.Error()
			r.Unjudged = append(r.Unjudged, v)
			continue
		}
		r.Judged++
		v.Evidence = ev.SHA256
		_, oldErr := oldPolicy.Evaluate(measured)
		_, newErr := newPolicy.Evaluate(measured)
		switch {
		case oldErr == nil && newErr != nil:
			v.Reason = newErr.Error()
			r.NewlyRefused = append(r.NewlyRefused, v)
		case oldErr != nil && newErr == nil:
			v.Reason = oldErr.Error()
			r.NewlyAccepted = append(r.NewlyAccepted, v)
		}
	}
	for _, l := range [][]Verdict{r.NewlyRefused, r.NewlyAccepted, r.Unjudged} {
		sort.Slice(l, func(i, j int) bool { return l[i].Node < l[j].Node })
	}
	return r
}

// Measurements turns a Machine's recorded evidence back into attestation's form: decimal indices,
// hex values.
func Measurements(ev *v1alpha1.Evidence) (attestation.Measurements, error) {
	out := make(attestation.Measurements, len(ev.Measurements))
	for k, v := range ev.Measurements {
		i, err := strconv.ParseUint(k, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("recorded measurement index %q: %w", k, err)
		}
		b, err := hex.DecodeString(v)
		if err != nil {
			return nil, fmt.Errorf("recorded measurement %d: %w", i, err)
		}
		out[uint32(i)] = b
	}
	return out, nil
}

// machinesPage is how many Machines one list request of ListMachines asks for.
const machinesPage = 1000

// ListMachines lists every Machine in namespace, in pages: what Judge takes.
func ListMachines(ctx context.Context, rc clientset.Interface, namespace string) ([]v1alpha1.Machine, error) {
	var out []v1alpha1.Machine
	opts := metav1.ListOptions{Limit: machinesPage}
	for {
		list, err := rc.RecordsV1alpha1().Machines(namespace).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("listing machines: %w", err)
		}
		out = append(out, list.Items...)
		if opts.Continue = list.Continue; opts.Continue == "" {
			return out, nil
		}
	}
}
