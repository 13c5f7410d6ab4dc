package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/noderemove"
)

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
     berth-machines): from now on the joinservice refuses it with REVOKED (no join or rejoin
     ticket, no disk key), and the API server refuses every write made with NODE's credentials
     (policy berth-node-revocation): its kubelet cannot register the Node again, report status,
     renew its Lease or get a certificate. remove waits until the API server refuses a dry-run
     registration of NODE made as NODE (impersonated), at most 60s, and prints how long that took
     (about a second: the API server watches the list);
  3. for a control plane, a joinservice replica removes its etcd member (etcd's client certificates
     live on the control planes). It refuses when the remaining voting members that answer would be
     fewer than their quorum; then nothing is removed, the revocation is taken back and remove exits
     with code 3. --force skips that check (etcd's own reconfiguration check may still refuse);
  4. it deletes the Node object and every pod still bound to NODE (with the Node and its pods gone,
     the API server's Node authorizer lets NODE's credentials read no Secret), and records the
     removal in the join ledger (berth status).

So the revocation holds within a minute whether the machine is running, rebooting or off: a
machine that keeps its state disk and its still-valid kubelet certificate does not come back. Run
remove again after a failure: it continues where it stopped. The machine stays revoked until berth
node readmit; a removed control plane comes back only from a blank state disk (its etcd member is
gone), and keeps what it held (the cluster's CA keys, the master secret): rotate them.

While a machine that joined as NODE is revoked, every credential of the name NODE is refused, also
that of another machine later joined under the same name.`,
		Example: `  berth node remove w1 --drain
  berth node remove cp1                     # a dead control plane: its etcd member goes too
  berth node remove cp2 --force -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			client, asNode, err := f.kube.nodeClients()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			return runNodeRemove(ctx, cmd.OutOrStdout(), cmd.ErrOrStderr(), client, asNode, args[0], f)
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
	NodeDeleted bool `json:"nodeDeleted"`
	// PodsDeleted is how many pods still bound to the node were deleted.
	PodsDeleted int `json:"podsDeleted"`
	// RefusedSeconds is how long after the revocation the API server refused the node's writes.
	RefusedSeconds float64 `json:"refusedSeconds"`
	Seconds        float64 `json:"seconds"`
}

func runNodeRemove(ctx context.Context, out, errOut io.Writer, client kubernetes.Interface, asNode func(string) (kubernetes.Interface, error), name string, f nodeRemoveFlags) error {
	res, err := noderemove.Remove(ctx, client, name, noderemove.Options{Namespace: f.namespace, Drain: f.drain, Force: f.force, Progress: errOut, AsNode: asNode})
	if refused := (*noderemove.RefusedError)(nil); errors.As(err, &refused) {
		return &exitError{code: exitRejected, err: err}
	}
	if err != nil {
		return err
	}
	if f.output.structured() {
		return f.output.encode(out, removeReport{Node: res.Node, Role: res.Role, Identity: res.Identity, RevokedAt: res.RevokedAt,
			Drained: res.Drained, Etcd: string(res.Etcd), EtcdMessage: res.EtcdMessage, NodeDeleted: res.NodeDeleted,
			PodsDeleted: res.PodsDeleted, RefusedSeconds: res.Refused.Seconds(), Seconds: res.Took.Seconds()})
	}
	_, _ = fmt.Fprintf(out, "removed %s %s in %.1fs: %s\n", res.Role, name, res.Took.Seconds(), res.Message())
	return nil
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
remove: the joinservice admits it again, and it joins (or rejoins) on its next attempt; the API
server accepts NODE's credentials again (readmit waits for that), so a kubelet that kept its state
registers its Node again by itself. The re-admission is recorded in the join ledger (berth status).

A re-admitted control plane's etcd member was removed: it must join from a blank state disk.`,
		Example: `  berth node readmit w1
  berth node readmit w1 -o json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			client, asNode, err := f.kube.nodeClients()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), f.timeout)
			defer cancel()
			return runNodeReadmit(ctx, cmd.OutOrStdout(), client, asNode, args[0], f)
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

func runNodeReadmit(ctx context.Context, out io.Writer, client kubernetes.Interface, asNode func(string) (kubernetes.Interface, error), name string, f nodeReadmitFlags) error {
	res, err := noderemove.Readmit(ctx, client, name, noderemove.Options{Namespace: f.namespace, AsNode: asNode})
	if err != nil {
		return err
	}
	if f.output.structured() {
		return f.output.encode(out, readmitReport{Node: res.Node, Role: res.Role, Identity: res.Identity, RemovedAt: res.RemovedAt})
	}
	_, _ = fmt.Fprintf(out, "%s: %s; it joins on its next attempt\n", name, res.Message)
	return nil
}
