// Package joinledger is the format of the join ledger: the contract between the joinservice, which
// writes it (joinservice/ledger), `berth node`, which adds membership events to it (Append), and
// `berth status`, which reads it.
//
// The ledger is ConfigMap berth-join-ledger in Berth's namespace. Its key entries.json holds a JSON
// array of Entry values, oldest first: the newest join attempts of all joinservice replicas, accepted
// and rejected, and the membership events (IsMembership): a control-plane join that finished, or
// whose slot a timeout freed (RPCControlPlaneJoin), a node an operator removed (RPCRemove) or
// re-admitted (RPCReadmit). An empty or missing key means no entries.
//
// The ledger keeps its evidence. Entries are of three kinds (KindOf), each with a share of the
// Capacity entries that no other kind can take (Quotas):
//
//	kind        what                                                         quota
//	accepted    accepted joins and rejoins                                   128
//	evidence    refusals that cost the peer a verified TPM operation: a      64
//	            replay or a transplant of a genuine quote, and refusals of a
//	            peer whose quote verified (measurement mismatch, role, disk
//	            binding, ...)
//	unverified  refusals of what a peer sent without proving anything:       64
//	            claims, rate limits, malformed or missing evidence, an EK no
//	            trusted CA vouches for, a bad signature, a key not activated
//
// Space a kind leaves unused goes to the newest entries of the other kinds, unverified ones last,
// so that a flood of unverified refusals (anyone who can reach the port can send them) never evicts
// an accepted join or a cryptographic failure. Refusals are aggregated per kind, peer, RPC, node and
// reason (Merge): one entry with Count attempts and the newest attempt's time, message and evidence.
package joinledger

import (
	"context"
	"errors"
	"sort"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/configmapkey"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// Names.
const (
	// ConfigMapName is the ledger's ConfigMap.
	ConfigMapName = joinconfig.JoinLedgerName
	// DataKey is the ConfigMap key holding the entries as a JSON array.
	DataKey = "entries.json"
)

// Outcomes.
const (
	OutcomeAccepted = "accepted"
	OutcomeRejected = "rejected"
)

// RPCAdminCredential is the RPC of an operator's request for an admin credential (berth
// kubeconfig): accepted entries are the audit trail of issued credentials (serial and expiry in the
// message), refused ones come from peers that proved nothing (KindUnverified).
const RPCAdminCredential = "admin-credential"

// RPCs of the membership events.
const (
	// RPCControlPlaneJoin: the control-plane join slot was freed, accepted when the joinservice saw
	// the node's etcd member voting and healthy and its API server ready, rejected (with
	// ReasonControlPlaneJoinTimeout) when the join timeout freed it.
	RPCControlPlaneJoin = "control-plane-join"
	// RPCRemove: an operator removed the node (berth node remove) and revoked its machine's identity.
	RPCRemove = "remove"
	// RPCReadmit: an operator re-admitted a removed machine (berth node readmit).
	RPCReadmit = "readmit"
)

// Reasons of membership events and of the refusals they cause.
const (
	// ReasonControlPlaneJoinTimeout: a control-plane join did not finish within the join timeout,
	// which freed the slot for the next one.
	ReasonControlPlaneJoinTimeout = "CONTROL_PLANE_JOIN_TIMEOUT"
	// ReasonRevoked: a join or rejoin of a machine an operator removed.
	ReasonRevoked = "REVOKED"
)

// IsMembership reports whether e is a membership event rather than a join attempt.
func IsMembership(e Entry) bool {
	switch e.RPC {
	case RPCControlPlaneJoin, RPCRemove, RPCReadmit:
		return true
	}
	return false
}

// Kinds of entries (see the package documentation).
const (
	KindAccepted   = "accepted"
	KindEvidence   = "evidence"
	KindUnverified = "unverified"
)

// Capacity is how many entries the ConfigMap keeps (about 500 bytes each: ~130 KB of 1 MiB).
const Capacity = 256

// Quotas are the entries each kind keeps whatever the others do; together they are Capacity.
var Quotas = map[string]int{KindAccepted: 128, KindEvidence: 64, KindUnverified: 64}

// KindOf is e's kind: the one its writer recorded, else accepted for an accepted attempt, unverified
// for a refused join, rejoin, check-in or handshake, and evidence for any other record (a writer's own
// records, such as membership changes, are kept apart from floods too).
func KindOf(e Entry) string {
	switch {
	case e.Kind == KindAccepted || e.Kind == KindEvidence || e.Kind == KindUnverified:
		return e.Kind
	case e.Outcome == OutcomeAccepted:
		return KindAccepted
	case e.RPC == "" || e.RPC == "join" || e.RPC == "rejoin" || e.RPC == "checkin" || e.RPC == "handshake":
		return KindUnverified
	default:
		return KindEvidence
	}
}

// Entry is one join attempt.
type Entry struct {
	Time time.Time `json:"time"`
	// Peer is the address the attempt came from.
	Peer string `json:"peer"`
	// Node is the instance name metadata reports for Peer; empty when unknown.
	Node string `json:"node,omitempty"`
	// Role is the role the node claimed.
	Role string `json:"role,omitempty"`
	// RPC is the method: join, rejoin, checkin (a joined node asking whether it may run before its
	// kubelet starts), handshake, RPCAdminCredential, or a membership event's.
	RPC string `json:"rpc,omitempty"`
	// EvidenceSHA256 is the hex SHA-256 of the peer's attestation document; empty without attestation.
	EvidenceSHA256 string `json:"evidenceSHA256,omitempty"`
	Outcome        string `json:"outcome"`
	// Reason is the rejection's reason code; empty when accepted.
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
	// Replica is the joinservice replica (its node) that answered.
	Replica string `json:"replica,omitempty"`
	// Count is how many attempts this entry stands for when above 1 (aggregated refusals).
	Count int `json:"count,omitempty"`
	// Kind is the entry's kind (Kind* constants); empty in entries of older writers (KindOf).
	Kind string `json:"kind,omitempty"`
	// Identity is the machine identity (package machines' encoding) of an accepted join, of a
	// refused one that had one, or of the machine a membership event removed or re-admitted.
	Identity string `json:"identity,omitempty"`
	// DiskUUID is the state disk UUID a join or rejoin call named (lower-case canonical form), once
	// it passed the format check; the disk key the call got, if any, is bound to this disk and to
	// Identity.
	DiskUUID string `json:"diskUUID,omitempty"`
	// TicketIssued is, for an RPCControlPlaneJoin event, when the ticket that started the join was
	// issued: the slot was held from then until Time.
	TicketIssued time.Time `json:"ticketIssued,omitzero"`
}

// ErrNoLedger is returned by Read when the cluster has no ledger yet (no join was attempted).
var ErrNoLedger = errors.New("the cluster has no join ledger yet")

// Read returns the ledger's entries, oldest first.
func Read(ctx context.Context, client kubernetes.Interface, namespace string) ([]Entry, error) {
	return configmapkey.ReadList[Entry](ctx, client, configmapkey.Ref{Namespace: namespace, Name: ConfigMapName, Key: DataKey}, "ledger", ErrNoLedger)
}

// Decode parses the value of DataKey.
func Decode(s string) ([]Entry, error) {
	return configmapkey.DecodeList[Entry](s, "ledger")
}

// Encode returns the value of DataKey for es.
func Encode(es []Entry) (string, error) {
	return configmapkey.EncodeList(es, "ledger")
}

// aggregateKey identifies the refusals Merge folds into one entry.
type aggregateKey struct{ kind, peer, rpc, node, reason, disk string }

// Aggregate folds the refusals of es with the same kind, peer, RPC, node and reason into one entry
// (Count attempts; the newest attempt's time, message, evidence, role and replica). Accepted entries
// stay one each. The result is sorted by time, oldest first.
func Aggregate(es []Entry) []Entry {
	out := make([]Entry, 0, len(es))
	at := map[aggregateKey]int{}
	for _, e := range es {
		if e.Outcome == OutcomeAccepted {
			out = append(out, e)
			continue
		}
		k := aggregateKey{KindOf(e), e.Peer, e.RPC, e.Node, e.Reason, e.DiskUUID}
		i, ok := at[k]
		if !ok {
			at[k] = len(out)
			out = append(out, e)
			continue
		}
		n := max(out[i].Count, 1) + max(e.Count, 1)
		if !e.Time.Before(out[i].Time) {
			out[i] = e
		}
		out[i].Count = n
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Time.Before(out[j].Time) })
	return out
}

// Keep returns the entries the ledger keeps of es (sorted by time, oldest first): the newest of
// each kind up to its quota, then with the space left the newest of the rest, unverified entries
// last. The result is sorted by time and has at most Capacity entries; dropped is how many were not
// kept.
func Keep(es []Entry) (kept []Entry, dropped int) {
	if len(es) <= Capacity {
		return es, 0
	}
	take := make([]bool, len(es))
	used := map[string]int{}
	n := 0
	for i := len(es) - 1; i >= 0; i-- {
		if k := KindOf(es[i]); used[k] < Quotas[k] {
			used[k]++
			take[i] = true
			n++
		}
	}
	for _, unverifiedPass := range []bool{false, true} {
		for i := len(es) - 1; i >= 0 && n < Capacity; i-- {
			if !take[i] && (KindOf(es[i]) == KindUnverified) == unverifiedPass {
				take[i] = true
				n++
			}
		}
	}
	kept = make([]Entry, 0, n)
	for i, e := range es {
		if take[i] {
			kept = append(kept, e)
		}
	}
	return kept, len(es) - len(kept)
}

// Merge returns what the ledger holds after more is added to existing: both aggregated, then kept
// (Aggregate, Keep).
func Merge(existing, more []Entry) []Entry {
	all := make([]Entry, 0, len(existing)+len(more))
	all = append(all, existing...)
	all = append(all, more...)
	sort.SliceStable(all, func(i, j int) bool { return all[i].Time.Before(all[j].Time) })
	kept, _ := Keep(Aggregate(all))
	return kept
}

// appendAttempts bounds the read-merge-write rounds of Append; they follow each other at once.
var appendAttempts = wait.Backoff{Steps: 8}

// Append adds es to the ledger with optimistic concurrency (read, Merge, write with the read
// resourceVersion, again on a conflict: configmapkey.Update), creating the ConfigMap when there is
// none; a ledger it cannot decode is left alone. `berth node` records its membership events with it;
// the joinservice batches its own entries through joinservice/ledger.
func Append(ctx context.Context, client kubernetes.Interface, namespace string, es ...Entry) error {
	ref := configmapkey.Ref{Namespace: namespace, Name: ConfigMapName, Key: DataKey,
		Labels: map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf}}
	_, err := configmapkey.Update(ctx, client, ref, appendAttempts, func(data string) (string, error) {
		existing, err := Decode(data)
		if err != nil {
			return "", err
		}
		return Encode(Merge(existing, es))
	})
	return err
}
