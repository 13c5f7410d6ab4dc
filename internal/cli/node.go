package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
)

// ledgerPeerOperator is the peer of the ledger entries berth node writes.
const ledgerPeerOperator = "operator"

// etcdPoll is how often node remove looks whether a joinservice removed the etcd member.
const etcdPoll = 500 * time.Millisecond

// errNotAdmitted is a node no attested machine joined as (or whose machine is removed already).
var errNotAdmitted = errors.New("no machine is recorded for this node")

func newNodeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Remove nodes from the cluster and revoke their machines, or re-admit them",
		Long: `berth node removes a node for good and revokes the machine behind it, or re-admits a removed machine.

The joinservice records every machine it admits in ConfigMap berth-machines (berth-system) by its
attested identity: the digest of its TPM's endorsement key (or, where the attestation carries none,
its instance name). A removed machine is refused with reason REVOKED when it asks to join or for a
rejoin ticket, under any name, until it is re-admitted. berth status lists removed machines.`,
		Example: `  berth node remove w1 --drain
  berth node remove cp1 --kubeconfig /var/lib/berth-mini/admin.conf
  berth node readmit w1`,
		Args: cobra.NoArgs,
		RunE: groupHelp,
	}
	cmd.AddCommand(newNodeRemoveCmd(), newNodeReadmitCmd())
	return cmd
}

type nodeRemoveFlags struct {
	kube      kubeOptions
	output    outputFormat
	namespace string
	drain     bool
	force     bool
	timeout   time.Duration
}

func newNodeRemoveCmd() *cobra.Command {
	var f nodeRemoveFlags
	cmd := &cobra.Command{
		Use:   "remove NODE",
		Short: "Remove a node, its etcd member, and revoke its machine",
		Long: `remove takes a node out of the cluster for good:

  1. with --drain, it cordons the node and evicts its pods (DaemonSet and static pods stay; pod
     disruption budgets are respected; on a node that is not Ready, evicted pods are not waited for);
  2. it revokes the machine that joined as NODE (its attested identity, from ConfigMap
     berth-machines): from now on the joinservice refuses it with REVOKED;
  3. for a control plane, a joinservice replica removes its etcd member (etcd's client certificates
     live on the control planes). It refuses when the remaining voting members that answer would be
     fewer than their quorum; then nothing is removed, the revocation is taken back and remove exits
     with code 3. --force skips that check (etcd's own reconfiguration check may still refuse);
  4. it deletes the Node object, and records the removal in the join ledger (berth status).

Run it again after a failure: it continues where it stopped. The machine stays revoked until berth
node readmit; a removed control plane comes back only from a blank state disk (its etcd member is
gone).`,
		Example: `  berth node remove w1 --drain
  berth node remove cp1                     # a dead control plane: its etcd member goes too
  berth node remove cp2 --force -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			client, err := f.kube.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			return runNodeRemove(ctx, cmd.OutOrStdout(), cmd.ErrOrStderr(), client, args[0], f)
		},
	}
	fl := cmd.Flags()
	f.kube.addFlags(fl)
	addOutputFlag(fl, &f.output)
	fl.StringVarP(&f.namespace, "namespace", "n", joinconfig.Namespace, "namespace of Berth's components")
	fl.BoolVar(&f.drain, "drain", false, "cordon the node and evict its pods first")
	fl.BoolVar(&f.force, "force", false, "remove a control plane's etcd member even when the voting members left would not have quorum")
	fl.DurationVar(&f.timeout, "timeout", 3*time.Minute, "how long to wait for the drain and for a joinservice to remove the etcd member")
	return cmd
}

// client returns a Kubernetes client for the kubeconfig the flags name.
func (k *kubeOptions) client() (kubernetes.Interface, error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating Kubernetes client: %w", err)
	}
	return client, nil
}

// removeReport is what node remove -o json|yaml prints. Its field names are stable.
type removeReport struct {
	Node     string `json:"node"`
	Role     string `json:"role"`
	Identity string `json:"identity"`
	// RevokedAt is when the machine was revoked.
	RevokedAt time.Time `json:"revokedAt"`
	// Drained is true when --drain evicted the node's pods.
	Drained bool `json:"drained"`
	// Etcd is where the etcd member's removal stands (control planes): removed, absent; empty for a
	// worker.
	Etcd        string `json:"etcd,omitempty"`
	EtcdMessage string `json:"etcdMessage,omitempty"`
	// NodeDeleted is true when this run deleted the Node object (false: there was none).
	NodeDeleted bool    `json:"nodeDeleted"`
	Seconds     float64 `json:"seconds"`
}

func runNodeRemove(ctx context.Context, out, errOut io.Writer, client kubernetes.Interface, name string, f nodeRemoveFlags) error {
	start := time.Now()
	say := func(format string, args ...any) { _, _ = fmt.Fprintf(errOut, format+"\n", args...) }
	ms, err := machines.Read(ctx, client, f.namespace)
	if err != nil && !errors.Is(err, machines.ErrNoRecord) {
		return err
	}
	m, ok := machines.ByNode(ms, name, false)
	resumed := false
	if !ok {
		// A removal that stopped half-way (the etcd member still pending, the Node still there).
		if m, ok = machines.ByNode(ms, name, true); !ok {
			return fmt.Errorf("%w: %s (no attested machine joined as %s, see ConfigMap %s/%s)", errNotAdmitted, name, name, f.namespace, machines.ConfigMapName)
		}
		resumed = true
		say("machine %s of node %s was removed at %s: continuing that removal", machines.Short(m.Identity), name, m.Removal.Time.Format(time.RFC3339))
	}
	r := removeReport{Node: name, Role: m.Role, Identity: m.Identity}
	node, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		node = nil
	case err != nil:
		return fmt.Errorf("reading node %s: %w", name, err)
	}
	if f.drain && node != nil {
		if err := drainNode(ctx, client, node, say); err != nil {
			return err
		}
		r.Drained = true
	}
	if !resumed {
		removal := &machines.Removal{Time: time.Now().UTC().Truncate(time.Second), Force: f.force}
		if m.Role == machines.RoleControlPlane {
			removal.Etcd = machines.EtcdPending
		}
		if err := setRemoval(ctx, client, f.namespace, m.Identity, removal); err != nil {
			return err
		}
		say("revoked machine %s (%s %s): the joinservice refuses it from now on", machines.Short(m.Identity), m.Role, name)
		m.Removal = removal
	}
	r.RevokedAt = m.Removal.Time
	if m.Role == machines.RoleControlPlane {
		state, msg, err := waitEtcdRemoval(ctx, client, f.namespace, m.Identity, say)
		r.Etcd, r.EtcdMessage = string(state), msg
		if err != nil {
			return err
		}
		if state == machines.EtcdRefused {
			if err := setRemoval(ctx, client, f.namespace, m.Identity, nil); err != nil {
				return fmt.Errorf("the etcd member removal was refused (%s), and taking the revocation back failed: %w", msg, err)
			}
			suffix := ""
			if r.Drained {
				suffix = fmt.Sprintf("; the node stays cordoned (kubectl uncordon %s)", name)
			}
			return &exitError{code: exitRejected, err: fmt.Errorf("not removing %s: %s; the machine is not revoked%s", name, msg, suffix)}
		}
		say("etcd member of %s: %s (%s)", name, state, msg)
	}
	if node != nil {
		err := client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting node %s: %w", name, err)
		}
		r.NodeDeleted = err == nil
	}
	r.Seconds = time.Since(start).Seconds()
	entry := joinledger.Entry{Time: time.Now().UTC(), Peer: ledgerPeerOperator, Node: name, Role: m.Role, RPC: joinledger.RPCRemove,
		Outcome: joinledger.OutcomeAccepted, Identity: m.Identity, Message: removeMessage(r)}
	if err := joinledger.Append(ctx, client, f.namespace, entry); err != nil {
		return fmt.Errorf("recording the removal in the join ledger: %w", err)
	}
	if f.output.structured() {
		return f.output.encode(out, r)
	}
	_, _ = fmt.Fprintf(out, "removed %s %s in %.1fs: %s\n", m.Role, name, r.Seconds, removeMessage(r))
	return nil
}

// removeMessage is the ledger's and the text output's account of a removal.
func removeMessage(r removeReport) string {
	parts := []string{"machine " + machines.Short(r.Identity) + " revoked"}
	if r.Drained {
		parts = append(parts, "pods evicted")
	}
	if r.Etcd != "" {
		parts = append(parts, "etcd member "+r.Etcd)
	}
	if r.NodeDeleted {
		parts = append(parts, "Node deleted")
	} else {
		parts = append(parts, "no Node object")
	}
	return strings.Join(parts, "; ")
}

// setRemoval records removal (nil: none) for the machine with identity.
func setRemoval(ctx context.Context, client kubernetes.Interface, ns, identity string, removal *machines.Removal) error {
	_, err := machines.Update(ctx, client, ns, func(ms []machines.Machine) ([]machines.Machine, error) {
		i := machines.Index(ms, identity)
		if i < 0 {
			return nil, fmt.Errorf("%w: machine %s left the record", errNotAdmitted, machines.Short(identity))
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
			return false, fmt.Errorf("%w: the removal of machine %s was taken back meanwhile", errNotAdmitted, machines.Short(identity))
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

// drainNode cordons node and evicts its pods but DaemonSet and static (mirror) pods, as kubectl
// drain does, retrying evictions a disruption budget refuses, and waits until they are gone; on a
// node that is not Ready (a dead machine cannot stop its pods) it does not wait.
func drainNode(ctx context.Context, client kubernetes.Interface, node *corev1.Node, say func(string, ...any)) error {
	if !node.Spec.Unschedulable {
		patch := []byte(`{"spec":{"unschedulable":true}}`)
		if _, err := client.CoreV1().Nodes().Patch(ctx, node.Name, "application/merge-patch+json", patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("cordoning %s: %w", node.Name, err)
		}
	}
	say("cordoned %s", node.Name)
	pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node.Name})
	if err != nil {
		return fmt.Errorf("listing pods of %s: %w", node.Name, err)
	}
	var evict []corev1.Pod
	for _, p := range pods.Items {
		if _, mirror := p.Annotations[corev1.MirrorPodAnnotationKey]; mirror || ownedByDaemonSet(p) || p.DeletionTimestamp != nil || p.Spec.NodeName != node.Name {
			continue
		}
		evict = append(evict, p)
	}
	for _, p := range evict {
		err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
			err := client.CoreV1().Pods(p.Namespace).EvictV1(ctx, &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}})
			switch {
			case err == nil, apierrors.IsNotFound(err):
				return true, nil
			case apierrors.IsTooManyRequests(err): // a disruption budget says not now
				return false, nil
			}
			return false, err
		})
		if err != nil {
			return fmt.Errorf("evicting pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
	say("evicted %d pods from %s", len(evict), node.Name)
	if !nodeReady(node) {
		say("%s is not Ready: not waiting for its evicted pods to stop", node.Name)
		return nil
	}
	for _, p := range evict {
		err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
			cur, err := client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err) || err == nil && cur.UID != p.UID, nil
		})
		if err != nil {
			return fmt.Errorf("waiting for pod %s/%s to stop: %w", p.Namespace, p.Name, err)
		}
	}
	return nil
}

func ownedByDaemonSet(p corev1.Pod) bool {
	for _, o := range p.OwnerReferences {
		if o.Kind == "DaemonSet" {
			return true
		}
	}
	return false
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

type nodeReadmitFlags struct {
	kube      kubeOptions
	output    outputFormat
	namespace string
	timeout   time.Duration
}

func newNodeReadmitCmd() *cobra.Command {
	var f nodeReadmitFlags
	cmd := &cobra.Command{
		Use:   "readmit NODE",
		Short: "Re-admit the removed machine that joined as NODE",
		Long: `readmit takes back the revocation of the machine that joined as NODE and was removed with berth node
remove: the joinservice admits it again, and it joins (or rejoins) on its next attempt. The
re-admission is recorded in the join ledger (berth status).

A re-admitted control plane's etcd member was removed: it must join from a blank state disk.`,
		Example: `  berth node readmit w1
  berth node readmit w1 -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			client, err := f.kube.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			return runNodeReadmit(ctx, cmd.OutOrStdout(), client, args[0], f)
		},
	}
	fl := cmd.Flags()
	f.kube.addFlags(fl)
	addOutputFlag(fl, &f.output)
	fl.StringVarP(&f.namespace, "namespace", "n", joinconfig.Namespace, "namespace of Berth's components")
	fl.DurationVar(&f.timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

// readmitReport is what node readmit -o json|yaml prints. Its field names are stable.
type readmitReport struct {
	Node      string    `json:"node"`
	Role      string    `json:"role"`
	Identity  string    `json:"identity"`
	RemovedAt time.Time `json:"removedAt"`
}

func runNodeReadmit(ctx context.Context, out io.Writer, client kubernetes.Interface, name string, f nodeReadmitFlags) error {
	ms, err := machines.Read(ctx, client, f.namespace)
	if err != nil && !errors.Is(err, machines.ErrNoRecord) {
		return err
	}
	m, ok := machines.ByNode(ms, name, true)
	if !ok {
		return fmt.Errorf("%w: %s has no removed machine (see berth status)", errNotAdmitted, name)
	}
	if err := setRemoval(ctx, client, f.namespace, m.Identity, nil); err != nil {
		return err
	}
	r := readmitReport{Node: name, Role: m.Role, Identity: m.Identity, RemovedAt: m.Removal.Time}
	msg := "machine " + machines.Short(m.Identity) + " re-admitted (removed " + m.Removal.Time.Format(time.RFC3339) + ")"
	entry := joinledger.Entry{Time: time.Now().UTC(), Peer: ledgerPeerOperator, Node: name, Role: m.Role, RPC: joinledger.RPCReadmit,
		Outcome: joinledger.OutcomeAccepted, Identity: m.Identity, Message: msg}
	if err := joinledger.Append(ctx, client, f.namespace, entry); err != nil {
		return fmt.Errorf("recording the re-admission in the join ledger: %w", err)
	}
	if f.output.structured() {
		return f.output.encode(out, r)
	}
	_, _ = fmt.Fprintf(out, "%s: %s; it joins on its next attempt\n", name, msg)
	return nil
}
