package recordwriter_test

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
)

// TestPruneRefusals, against a real API server: JoinRecords whose latest refusal is older than
// the retention are deleted, newer ones and every Machine stay, and a second pass finds nothing.
func TestPruneRefusals(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	now := time.Now().UTC().Truncate(time.Second)
	w.Admit(recordwriter.Admission{Time: now.Add(-90 * 24 * time.Hour), Identity: identity(4), Node: "w4", Role: "worker", RPC: "join", Peer: "198.51.100.4"})
	w.Flush(ctx, nil)
	ages := map[string]time.Duration{"198.51.100.10": 40 * 24 * time.Hour, "198.51.100.11": 31 * 24 * time.Hour, "198.51.100.12": 29 * 24 * time.Hour, "198.51.100.13": time.Minute}
	for peer, age := range ages {
		spec := v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassUnverified, Peer: peer, RPC: "join", Reason: "NO_EVIDENCE"}
		last := metav1.NewTime(now.Add(-age))
		if _, err := rc.RecordsV1alpha1().JoinRecords(ns).Create(ctx, &v1alpha1.JoinRecord{
			ObjectMeta: metav1.ObjectMeta{Name: records.RecordName(spec), Namespace: ns, Labels: map[string]string{records.ClassLabel: spec.Class}},
			Spec:       spec, Status: v1alpha1.JoinRecordStatus{Count: 1, First: last, Last: last},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	n, err := w.PruneRefusals(ctx, now, recordwriter.DefaultRefusalRetention)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Errorf("pruned %d records, want the 2 older than 30 days", n)
	}
	list, err := rc.RecordsV1alpha1().JoinRecords(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kept := map[string]bool{}
	for _, jr := range list.Items {
		kept[jr.Spec.Peer] = true
	}
	if len(kept) != 2 || !kept["198.51.100.12"] || !kept["198.51.100.13"] {
		t.Errorf("kept %v, want the records of 29 days and a minute", kept)
	}
	if _, err := rc.RecordsV1alpha1().Machines(ns).Get(ctx, records.NameFor(identity(4)), metav1.GetOptions{}); err != nil {
		t.Errorf("pruning touched a Machine: %v", err)
	}
	if n, err := w.PruneRefusals(ctx, now, recordwriter.DefaultRefusalRetention); err != nil || n != 0 {
		t.Errorf("second pass pruned %d, %v; want 0", n, err)
	}
}
