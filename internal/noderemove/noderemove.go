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
//  4. deletes the Node object and every pod still bound to the node (the machine cannot run them
//     any more), and appends the removal to the join ledger (internal/joinledger).
//
// Revoking the machine in the record also lists its node name in the record's key
// machines.RevokedNodesKey, in the same write. That list is the parameter of the API server's
// revocation policy (berthsystem.Revocation), which refuses every write made with the node's
// credentials: the kubelet cannot register its Node again, report status, renew its Lease or its
// client certificate. With the Node and its pods deleted, the Node authorizer lets those credentials
// read no Secret. When Options.AsNode is set, Remove waits after step 2 until the API server refuses
// a dry-run registration of the Node made with the node's identity (impersonated), and reports how
// long that took; Readmit waits until it is accepted again.
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

	"github.com/berth-k8s/berth/internal/berthsystem"
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
	// AsNode, when set, returns a client that acts as node's kubelet (system:node:NAME in
	// system:nodes, impersonated): Remove and Readmit check with it that the API server refuses
	// (accepts) the node's writes.
	AsNode func(node string) (kubernetes.Interface, error)
	// RefusalTimeout bounds the wait for the API server to refuse (accept again) the node's writes;
	// zero means RefusalTimeout.
	RefusalTimeout time.Duration
}

// RefusalTimeout bounds the wait for the API server to refuse (or accept again) a node's writes:
// the policy's parameter reaches every API server through a watch, within seconds.
const RefusalTimeout = 60 * time.Second

// refusalPoll is how often the refusal is checked.
const refusalPoll = 200 * time.Millisecond

// ErrNotRefused is a revocation the API server does not enforce: its revocation policy is missing
// (a cluster installed before it) or its binding was deleted.
var ErrNotRefused = errors.New("the API server still accepts the node's writes")

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
	// PodsDeleted is how many pods bound to the node this run deleted.
	PodsDeleted int
	// Refused is how long after the revocation the API server refused the node's writes (zero: not
	// checked, Options.AsNode unset).
	Refused time.Duration
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
	if r.Refused > 0 {
		parts = append(parts, fmt.Sprintf("kubelet refused by the API server %.2fs after the revocation", r.Refused.Seconds()))
	}
	if r.NodeDeleted {
		parts = append(parts, "Node deleted")
	} else {
		parts = append(parts, "no Node object")
	}
	if r.PodsDeleted > 0 {
		parts = append(parts, fmt.Sprintf("%d bound pods deleted", r.PodsDeleted))
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
		say("revoked machine %s (%s %s): the joinservice refuses it from now on, the API server its node's credentials", machines.Short(m.Identity), m.Role, name)
		m.Removal = removal
	}
	r.RevokedAt = m.Removal.Time
	if opts.AsNode != nil {
		revoked := time.Now()
		if err := waitNodeWrites(ctx, opts, name, true); err != nil {
			return r, err
		}
		r.Refused = time.Since(revoked)
		say("the API server refuses every write of %s's kubelet (%.2fs after the revocation)", name, r.Refused.Seconds())
	}
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
	if r.PodsDeleted, err = deleteBoundPods(ctx, client, name); err != nil {
		return r, err
	}
	if r.PodsDeleted > 0 {
		say("deleted %d pods bound to %s: its kubelet may read none of their Secrets", r.PodsDeleted, name)
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

// Readmit takes back the revocation of the removed machine that joined as name, waits (with
// opts.AsNode) until the API server accepts the node's writes again, and records the re-admission
// in the join ledger. Only opts.Namespace and opts.AsNode count.
func Readmit(ctx context.Context, client kubernetes.Interface, name string, opts Options) (Readmission, error) {
	namespace := opts.Namespace
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
	if opts.AsNode != nil {
		if err := waitNodeWrites(ctx, opts, name, false); err != nil {
			return r, err
		}
		r.Message += "; the API server accepts its kubelet again"
	}
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

// waitNodeWrites waits until the API server refuses (refused) or accepts a dry-run registration of
// Node name made as that node: the write a kubelet makes first when it finds no Node. Only a refusal
// by the revocation policy counts as refused; any other error (the Node exists, say) means accepted
// by the policy.
func waitNodeWrites(ctx context.Context, opts Options, name string, refused bool) error {
	kubelet, err := opts.AsNode(name)
	if err != nil {
		return fmt.Errorf("acting as node %s: %w", name, err)
	}
	timeout := opts.RefusalTimeout
	if timeout <= 0 {
		timeout = RefusalTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	last := "no answer"
	probe := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	err = wait.PollUntilContextCancel(ctx, refusalPoll, true, func(ctx context.Context) (bool, error) {
		_, err := kubelet.CoreV1().Nodes().Create(ctx, probe, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if ctx.Err() != nil {
			return false, nil // the wait's end, not the API server's answer
		}
		last = "accepted"
		if err != nil {
			last = err.Error()
		}
		return RefusedByRevocation(err) == refused, nil
	})
	if err == nil {
		return nil
	}
	if refused {
		return fmt.Errorf("%w after %s (last answer to a dry-run registration as %s: %s): is policy %s installed (the bootstrapper installs it)? The machine stays revoked: %w",
			ErrNotRefused, timeout, name, last, berthsystem.RevocationName, err)
	}
	return fmt.Errorf("the API server still refuses node %s's writes after %s (last: %s): %w", name, timeout, last, err)
}

// RefusedByRevocation reports whether err is the API server's refusal of a write by the revocation
// policy of removed nodes.
func RefusedByRevocation(err error) bool {
	return apierrors.IsForbidden(err) && strings.Contains(err.Error(), berthsystem.RevocationName)
}

// deleteBoundPods deletes, without a grace period, every pod bound to node name: the machine is
// revoked and its kubelet can no longer report a pod's end, which would otherwise keep the pods (and
// the Node authorizer's grant of their Secrets to that node) until the pod garbage collector removes
// them. Their controllers schedule replacements elsewhere.
func deleteBoundPods(ctx context.Context, client kubernetes.Interface, name string) (int, error) {
	pods, err := client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
	if err != nil {
		return 0, fmt.Errorf("listing the pods bound to %s: %w", name, err)
	}
	zero := int64(0)
	deleted := 0
	for _, p := range pods.Items {
		if p.Spec.NodeName != name {
			continue // a client that ignores field selectors
		}
		err := client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return deleted, fmt.Errorf("deleting pod %s/%s bound to %s: %w", p.Namespace, p.Name, name, err)
		default:
			deleted++
		}
	}
	return deleted, nil
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
