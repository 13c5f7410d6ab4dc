package joinledger

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestReadWhatEncodeWrote(t *testing.T) {
	es := []Entry{
		{Time: time.Date(2026, 11, 21, 6, 0, 0, 0, time.UTC), Peer: "198.51.100.11", Node: "worker-0", RPC: "join", Outcome: OutcomeAccepted},
		{Time: time.Date(2026, 11, 21, 6, 0, 1, 0, time.UTC), Peer: "203.0.113.9", RPC: "join", Outcome: OutcomeRejected, Reason: "RATE_LIMITED", Count: 40},
	}
	data, err := Encode(es)
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(&corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: ConfigMapName, Namespace: "berth-system"},
		Data:       map[string]string{DataKey: data},
	})
	got, err := Read(context.Background(), client, "berth-system")
	if err != nil || len(got) != 2 || got[0] != es[0] || got[1] != es[1] {
		t.Fatalf("Read() = %+v, %v; want %+v", got, err, es)
	}
}

func TestReadWithoutLedger(t *testing.T) {
	if _, err := Read(context.Background(), fake.NewClientset(), "berth-system"); !errors.Is(err, ErrNoLedger) {
		t.Fatalf("Read() = %v, want ErrNoLedger", err)
	}
}

func TestDecode(t *testing.T) {
	for name, tc := range map[string]struct {
		in      string
		n       int
		wantErr bool
	}{
		"empty":        {in: "", n: 0},
		"blank":        {in: " \n", n: 0},
		"one":          {in: `[{"time":"2026-11-21T06:00:00Z","peer":"198.51.100.11","outcome":"accepted"}]`, n: 1},
		"not an array": {in: `{"peer":"x"}`, wantErr: true},
	} {
		t.Run(name, func(t *testing.T) {
			es, err := Decode(tc.in)
			if (err != nil) != tc.wantErr || len(es) != tc.n {
				t.Fatalf("Decode(%q) = %d entries, %v", tc.in, len(es), err)
			}
		})
	}
}

func at(i int) time.Time {
	return time.Date(2026, 11, 21, 6, 0, 0, 0, time.UTC).Add(time.Duration(i) * time.Second)
}

func TestKindOf(t *testing.T) {
	for name, tc := range map[string]struct {
		e    Entry
		want string
	}{
		"written kind":              {Entry{Outcome: OutcomeRejected, RPC: "join", Kind: KindEvidence}, KindEvidence},
		"accepted, older writer":    {Entry{Outcome: OutcomeAccepted, RPC: "join"}, KindAccepted},
		"refused join, older":       {Entry{Outcome: OutcomeRejected, RPC: "join", Reason: "MEASUREMENT_MISMATCH"}, KindUnverified},
		"refused handshake, older":  {Entry{Outcome: OutcomeRejected, RPC: "handshake"}, KindUnverified},
		"another writer's record":   {Entry{Outcome: OutcomeRejected, RPC: "remove"}, KindEvidence},
		"a kind this does not know": {Entry{Outcome: OutcomeAccepted, Kind: "something"}, KindAccepted},
	} {
		if got := KindOf(tc.e); got != tc.want {
			t.Errorf("%s: KindOf() = %s, want %s", name, got, tc.want)
		}
	}
}

// TestFloodEvictsNoEvidence: whatever the number of unverified refusals, the newest accepted joins
// and cryptographic failures up to their quotas stay; unverified refusals only use space the others
// leave (and keep their own quota).
func TestFloodEvictsNoEvidence(t *testing.T) {
	var ledger []Entry
	for i := range 20 {
		ledger = append(ledger, Entry{Time: at(i), Peer: fmt.Sprintf("198.51.100.%d", i), RPC: "join", Outcome: OutcomeAccepted, Kind: KindAccepted})
	}
	for i := range 10 {
		ledger = append(ledger, Entry{Time: at(20 + i), Peer: fmt.Sprintf("198.51.100.%d", 50+i), RPC: "handshake", Outcome: OutcomeRejected,
			Reason: "NONCE_MISMATCH", Kind: KindEvidence})
	}
	var flood []Entry
	for i := range 2000 {
		flood = append(flood, Entry{Time: at(100 + i), Peer: fmt.Sprintf("127.0.%d.%d", i/250, i%250), RPC: "handshake", Outcome: OutcomeRejected,
			Reason: "MEASUREMENT_MISMATCH", Kind: KindUnverified})
	}
	got := Merge(ledger, flood)
	kinds := map[string]int{}
	for _, e := range got {
		kinds[KindOf(e)]++
	}
	if len(got) != Capacity || kinds[KindAccepted] != 20 || kinds[KindEvidence] != 10 || kinds[KindUnverified] != Capacity-30 {
		t.Fatalf("after the flood: %d entries, %v; want all 20 accepted and 10 evidence, the rest unverified", len(got), kinds)
	}
	// The unverified kept are the newest.
	if last := got[len(got)-1]; last.Peer != "127.0.7.249" {
		t.Fatalf("newest entry %+v, want the flood's last", last)
	}
	// With every kind over its quota, each keeps its quota of its newest.
	var many []Entry
	for i := range 300 {
		many = append(many, Entry{Time: at(i), Peer: fmt.Sprint(i), RPC: "join", Outcome: OutcomeAccepted})
	}
	for i := range 300 {
		many = append(many, Entry{Time: at(300 + i), Peer: fmt.Sprint(i), RPC: "join", Outcome: OutcomeRejected, Reason: "ROLE_MISMATCH", Kind: KindEvidence})
	}
	got = Merge(many, flood)
	kinds = map[string]int{}
	for _, e := range got {
		kinds[KindOf(e)]++
	}
	if kinds[KindAccepted] != Quotas[KindAccepted] || kinds[KindEvidence] != Quotas[KindEvidence] || kinds[KindUnverified] != Quotas[KindUnverified] {
		t.Fatalf("every kind over its quota: %v, want %v", kinds, Quotas)
	}
	for _, e := range got {
		if KindOf(e) == KindAccepted && e.Time.Before(at(300-Quotas[KindAccepted])) {
			t.Fatalf("an older accepted entry (%s) was kept over a newer one", e.Time)
		}
	}
}

// TestAggregate: refusals of one kind, peer, RPC, node and reason become one entry with their count
// and the newest attempt's fields; accepted joins and other keys stay apart.
func TestAggregate(t *testing.T) {
	es := []Entry{
		{Time: at(1), Peer: "203.0.113.5", RPC: "handshake", Outcome: OutcomeRejected, Reason: "MEASUREMENT_MISMATCH", Message: "first", Kind: KindUnverified},
		{Time: at(2), Peer: "203.0.113.5", RPC: "join", Outcome: OutcomeAccepted},
		{Time: at(3), Peer: "203.0.113.5", RPC: "handshake", Outcome: OutcomeRejected, Reason: "MEASUREMENT_MISMATCH", Message: "second", Count: 4, Kind: KindUnverified},
		{Time: at(4), Peer: "203.0.113.5", RPC: "join", Outcome: OutcomeAccepted},
		{Time: at(5), Peer: "203.0.113.5", RPC: "handshake", Outcome: OutcomeRejected, Reason: "NONCE_MISMATCH", Kind: KindEvidence},
		{Time: at(6), Peer: "203.0.113.6", RPC: "handshake", Outcome: OutcomeRejected, Reason: "MEASUREMENT_MISMATCH", Kind: KindUnverified},
	}
	got := Aggregate(es)
	if len(got) != 5 {
		t.Fatalf("Aggregate() = %d entries, want 5: %+v", len(got), got)
	}
	var claims Entry
	for _, e := range got {
		if e.Peer == "203.0.113.5" && e.Reason == "MEASUREMENT_MISMATCH" {
			claims = e
		}
	}
	if claims.Count != 5 || claims.Message != "second" || !claims.Time.Equal(at(3)) {
		t.Fatalf("aggregated refusal %+v, want 5 attempts with the newest's message and time", claims)
	}
	for i := 1; i < len(got); i++ {
		if got[i].Time.Before(got[i-1].Time) {
			t.Fatal("Aggregate() is not sorted by time")
		}
	}
}

// TestAppendCreatesThenMerges: Append creates the ledger, then merges later events in time order
// with what the joinservice wrote, and keeps what Merge keeps.
func TestAppendCreatesThenMerges(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	removed := Entry{Time: at(5), Peer: "operator", Node: "w1", Role: "worker", RPC: RPCRemove, Outcome: OutcomeAccepted, Identity: "ab"}
	if err := Append(ctx, client, "berth-system", removed); err != nil {
		t.Fatalf("Append to no ledger: %v", err)
	}
	join := Entry{Time: at(1), Peer: "198.51.100.11", Node: "w1", RPC: "join", Outcome: OutcomeAccepted}
	readmitted := Entry{Time: at(9), Peer: "operator", Node: "w1", RPC: RPCReadmit, Outcome: OutcomeAccepted}
	if err := Append(ctx, client, "berth-system", readmitted, join); err != nil {
		t.Fatalf("Append: %v", err)
	}
	got, err := Read(ctx, client, "berth-system")
	if err != nil || len(got) != 3 || got[0] != join || got[1] != removed || got[2] != readmitted {
		t.Fatalf("ledger = %+v, %v; want join, remove, readmit in time order", got, err)
	}
	var many []Entry
	for i := range Capacity + 10 {
		many = append(many, Entry{Time: at(10 + i), Peer: fmt.Sprintf("p%d", i), RPC: "join", Outcome: OutcomeAccepted})
	}
	if err := Append(ctx, client, "berth-system", many...); err != nil {
		t.Fatal(err)
	}
	got, _ = Read(ctx, client, "berth-system")
	want, _ := Keep(Aggregate(append([]Entry{join, removed, readmitted}, many...)))
	if len(got) != len(want) || !got[len(got)-1].Time.Equal(at(10+Capacity+9)) {
		t.Fatalf("after %d more entries the ledger holds %d, last at %v; want what Merge keeps (%d)", len(many), len(got), got[len(got)-1].Time, len(want))
	}
}

// TestAppendRefusesAnUnreadableLedger: Append never overwrites a ledger it cannot decode.
func TestAppendRefusesAnUnreadableLedger(t *testing.T) {
	client := fake.NewClientset(&corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: ConfigMapName, Namespace: "berth-system"},
		Data:       map[string]string{DataKey: "{not json"},
	})
	if err := Append(context.Background(), client, "berth-system", Entry{Time: at(1), RPC: RPCRemove}); err == nil {
		t.Fatal("Append over an unreadable ledger succeeded")
	}
	cm, _ := client.CoreV1().ConfigMaps("berth-system").Get(context.Background(), ConfigMapName, metav1.GetOptions{})
	if cm.Data[DataKey] != "{not json" {
		t.Fatalf("ledger changed to %q", cm.Data[DataKey])
	}
}

func TestIsMembership(t *testing.T) {
	for rpc, want := range map[string]bool{"join": false, "rejoin": false, "handshake": false, RPCControlPlaneJoin: true, RPCRemove: true, RPCReadmit: true} {
		if got := IsMembership(Entry{RPC: rpc}); got != want {
			t.Errorf("IsMembership(%s) = %v, want %v", rpc, got, want)
		}
	}
}
