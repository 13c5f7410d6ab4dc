// Package noderemove takes a node out of the cluster for good and revokes the machine behind it,
// or re-admits a removed machine: the procedure of `berth node remove` and `berth node readmit`.
//
// A removal, in order:
//
//  1. optionally drains the node (drain.go: cordon, then evict its pods through
//     k8s.io/kubectl/pkg/drain, disruption budgets respected);
//  2. revokes the machine that joined as the node in the machine record (internal/machines):
//     from then on the joinservice refuses it with REVOKED;
//  3. for a control plane, waits until a joinservice replica decided the removal of its etcd
//     member (etcd's client certificates live on the control planes). A refusal (quorum) takes the
//     revocation back and ends with a *RefusedError;
//  4. deletes the Node object and appends the removal to the join ledger (internal/joinledger).
//
// Run again after a failure, Remove continues where the last run stopped: a machine whose
// removal is recorded is not revoked anew, only waited for.
package noderemove

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
)

// LedgerPeer is the peer of the ledger entries removals and re-admissions write.
const LedgerPeer = "operator"

// etcdPoll is how often Remove looks whether a joinservice removed the etcd member.
const etcdPoll = 500 * time.Millisecond

// ErrNotAdmitted is a node no attested machine joined as (or whose machine is removed already).
var ErrNotAdmitted = errors.New("no machine is recorded for this node")

// RefusedError is Remove's error when a joinservice refused to remove the control plane's etcd
// member (the voting members left would lack quorum): nothing is removed and the machine is not
// revoked.
type RefusedError struct {
	Node string
	// Reason is the joinservice's message.
	Reason string
	// Cordoned: the drain cordoned the node, and it stays cordoned.
	Cordoned bool
}

func (e *RefusedError) Error() string {
	suffix := ""
	if e.Cordoned {
		suffix = fmt.Sprintf("; the node stays cordoned (kubectl uncordon %s)", e.Node)
	}
	return fmt.Sprintf("not removing %s: %s; the machine is not revoked%s", e.Node, e.Reason, suffix)
}

// Options tune Remove.
type Options struct {
	// Namespace is where the machine record and the join ledger are (berth-system).
	Namespace string
	// Drain cordons the node and evicts its pods first.
	Drain bool
	// Force asks the joinservice to remove a control plane's etcd member even when the voting
	// members left would lack quorum.
	Force bool
	// Progress receives one line per step; nil discards them.
	Progress io.Writer
}

// Result is what a removal did.
type Result struct {
	Node     string
	Role     string
	Identity string
	// RevokedAt is when the machine was revoked.
	RevokedAt time.Time
	// Drained is true when the drain evicted the node's pods.
	Drained bool
	// Etcd is where the etcd member's removal stands (control planes): removed or absent; empty for
	// a worker. EtcdMessage is the joinservice's account of it.
	Etcd        machines.EtcdState
	EtcdMessage string
	// NodeDeleted is true when this run deleted the Node object (false: there was none).
	NodeDeleted bool
	// Took is how long the removal took until its ledger entry.
	Took time.Duration
}

// Message is the ledger's (and the CLI's) account of a removal.
func (r Result) Message() string {
	parts := []string{"machine " + machines.Short(r.Identity) + " revoked"}
	if r.Drained {
		parts = append(parts, "pods evicted")
	}
	if r.Etcd != "" {
		parts = append(parts, "etcd member "+string(r.Etcd))
	}
	if r.NodeDeleted {
		parts = append(parts, "Node deleted")
	} else {
		parts = append(parts, "no Node object")
	}
	return strings.Join(parts, "; ")
}

// Remove takes the node called name out of the cluster and revokes its machine (the package doc
// has the steps).
func Remove(ctx context.Context, client kubernetes.Interface, name string, opts Options) (Result, error) {
	start := time.Now()
	say := progress(opts.Progress)
	ms, err := machines.Read(ctx, client, opts.Namespace)
	if err != nil && !errors.Is(err, machines.ErrNoRecord) {
		return Result{}, err
	}
	m, ok := machines.ByNode(ms, name, false)
	resumed := false
	if !ok {
		// A removal that stopped half-way (the etcd member still pending, the Node still there).
		if m, ok = machines.ByNode(ms, name, true); !ok {
			return Result{}, fmt.Errorf("%w: %s (no attested machine joined as %s, see ConfigMap %s/%s)", ErrNotAdmitted, name, name, opts.Namespace, machines.ConfigMapName)
		}
		resumed = true
		say("machine %s of node %s was removed at %s: continuing that removal", machines.Short(m.Identity), name, m.Removal.Time.Format(time.RFC3339))
	}
	r := Result{Node: name, Role: m.Role, Identity: m.Identity}
	node, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		node = nil
	case err != nil:
		return r, fmt.Errorf("reading node %s: %w", name, err)
	}
	if opts.Drain && node != nil {
		if err := drainNode(ctx, client, node, say); err != nil {
			return r, err
		}
		r.Drained = true
	}
	if !resumed {
		removal := &machines.Removal{Time: time.Now().UTC().Truncate(time.Second), Force: opts.Force}
		if m.Role == machines.RoleControlPlane {
			removal.Etcd = machines.EtcdPending
		}
		if err := setRemoval(ctx, client, opts.Namespace, m.Identity, removal); err != nil {
			return r, err
		}
		say("revoked machine %s (%s %s): the joinservice refuses it from now on", machines.Short(m.Identity), m.Role, name)
		m.Removal = removal
	}
	r.RevokedAt = m.Removal.Time
	if m.Role == machines.RoleControlPlane {
		state, msg, err := waitEtcdRemoval(ctx, client, opts.Namespace, m.Identity, say)
		r.Etcd, r.EtcdMessage = state, msg
		if err != nil {
			return r, err
		}
		if state == machines.EtcdRefused {
			if err := setRemoval(ctx, client, opts.Namespace, m.Identity, nil); err != nil {
				return r, fmt.Errorf("the etcd member removal was refused (%s), and taking the revocation back failed: %w", msg, err)
			}
			return r, &RefusedError{Node: name, Reason: msg, Cordoned: r.Drained}
		}
		say("etcd member of %s: %s (%s)", name, state, msg)
	}
	if node != nil {
		err := client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return r, fmt.Errorf("deleting node %s: %w", name, err)
		}
		r.NodeDeleted = err == nil
	}
	r.Took = time.Since(start)
	entry := joinledger.Entry{Time: time.Now().UTC(), Peer: LedgerPeer, Node: name, Role: m.Role, RPC: joinledger.RPCRemove,
		Outcome: joinledger.OutcomeAccepted, Identity: m.Identity, Message: r.Message()}
	if err := joinledger.Append(ctx, client, opts.Namespace, entry); err != nil {
		return r, fmt.Errorf("recording the removal in the join ledger: %w", err)
	}
	return r, nil
}

// Readmission is what a re-admission did.
type Readmission struct {
	Node     string
	Role     string
	Identity string
	// RemovedAt is when the machine had been removed.
	RemovedAt time.Time
	// Message is the ledger's account of it.
	Message string
}

// Readmit takes back the revocation of the removed machine that joined as name, and records the
// re-admission in the join ledger.
func Readmit(ctx context.Context, client kubernetes.Interface, name, namespace string) (Readmission, error) {
	ms, err := machines.Read(ctx, client, namespace)
	if err != nil && !errors.Is(err, machines.ErrNoRecord) {
		return Readmission{}, err
	}
	m, ok := machines.ByNode(ms, name, true)
	if !ok {
		return Readmission{}, fmt.Errorf("%w: %s has no removed machine (see berth status)", ErrNotAdmitted, name)
	}
	if err := setRemoval(ctx, client, namespace, m.Identity, nil); err != nil {
		return Readmission{}, err
	}
	r := Readmission{Node: name, Role: m.Role, Identity: m.Identity, RemovedAt: m.Removal.Time,
		Message: "machine " + machines.Short(m.Identity) + " re-admitted (removed " + m.Removal.Time.Format(time.RFC3339) + ")"}
	entry := joinledger.Entry{Time: time.Now().UTC(), Peer: LedgerPeer, Node: name, Role: m.Role, RPC: joinledger.RPCReadmit,
		Outcome: joinledger.OutcomeAccepted, Identity: m.Identity, Message: r.Message}
	if err := joinledger.Append(ctx, client, namespace, entry); err != nil {
		return r, fmt.Errorf("recording the re-admission in the join ledger: %w", err)
	}
	return r, nil
}

// progress returns a printer of one line to w (nil: nowhere).
func progress(w io.Writer) func(string, ...any) {
	if w == nil {
		w = io.Discard
	}
	return func(format string, args ...any) { _, _ = fmt.Fprintf(w, format+"\n", args...) }
}

// setRemoval records removal (nil: none) for the machine with identity.
func setRemoval(ctx context.Context, client kubernetes.Interface, ns, identity string, removal *machines.Removal) error {
	_, err := machines.Update(ctx, client, ns, func(ms []machines.Machine) ([]machines.Machine, error) {
		i := machines.Index(ms, identity)
		if i < 0 {
			return nil, fmt.Errorf("%w: machine %s left the record", ErrNotAdmitted, machines.Short(identity))
		}
		ms[i].Removal = removal
		return ms, nil
	})
	if err != nil {
		return fmt.Errorf("recording the removal in ConfigMap %s/%s: %w", ns, machines.ConfigMapName, err)
	}
	return nil
}

// waitEtcdRemoval waits until a joinservice decided the removal of the machine's etcd member.
func waitEtcdRemoval(ctx context.Context, client kubernetes.Interface, ns, identity string, say func(string, ...any)) (machines.EtcdState, string, error) {
	state, msg, last := machines.EtcdPending, "", ""
	err := wait.PollUntilContextCancel(ctx, etcdPoll, true, func(ctx context.Context) (bool, error) {
		ms, err := machines.Read(ctx, client, ns)
		if err != nil {
			return false, nil // transient: the wait's end names the last state
		}
		i := machines.Index(ms, identity)
		if i < 0 || ms[i].Removal == nil {
			return false, fmt.Errorf("%w: the removal of machine %s was taken back meanwhile", ErrNotAdmitted, machines.Short(identity))
		}
		state, msg = ms[i].Removal.Etcd, ms[i].Removal.EtcdMessage
		if state == machines.EtcdPending && msg != "" && msg != last {
			say("waiting for a joinservice to remove the etcd member: %s", msg)
			last = msg
		}
		return state != machines.EtcdPending, nil
	})
	if err != nil && state == machines.EtcdPending {
		detail := ""
		if msg != "" {
			detail = " (last: " + msg + ")"
		}
		return state, msg, fmt.Errorf("no joinservice removed the etcd member in time%s: the machine stays revoked; run berth node remove again to wait: %w", detail, err)
	}
	return state, msg, err
}

// nodeReady is the Node's Ready condition.
func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
