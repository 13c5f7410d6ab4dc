package initcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"go.uber.org/zap"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeclient"
	"github.com/berth-k8s/berth/internal/machines"
	recordsclient "github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// restoreDirName is where restore-etcd builds the member directory inside the etcd directory (on the
// same file system, so that the finished member moves into place in one rename).
const restoreDirName = ".berth-restore"

// mirrorPodAnnotation marks the kubelet's mirror of a static pod.
const mirrorPodAnnotation = "kubernetes.io/config.mirror"

// etcdPeerPort is the peer port of kubeadm's local etcd.
const etcdPeerPort = "2380"

// restoreEtcd restores the snapshot's etcd data into the etcd directory as this node's one-member
// cluster, named and addressed as kubeadm's local etcd will be (the node's name, its first address).
// A member directory left by an earlier attempt is replaced: until kubeadm init ran, nothing but
// this phase wrote there.
func (i *Initializer) restoreEtcd(_ context.Context, job *Job) error {
	r := job.Req.Restore
	if r == nil {
		return errors.New("restoring etcd: the request carries no snapshot")
	}
	if err := os.MkdirAll(i.cfg.EtcdDir, 0o700); err != nil {
		return fmt.Errorf("restoring etcd: %w", err)
	}
	tmp := filepath.Join(i.cfg.EtcdDir, restoreDirName)
	member := filepath.Join(i.cfg.EtcdDir, "member")
	for _, p := range []string{tmp, member} {
		if err := os.RemoveAll(p); err != nil {
			return fmt.Errorf("restoring etcd: removing an earlier attempt's data: %w", err)
		}
	}
	f, err := os.Open(r.Snapshot)
	if err != nil {
		return fmt.Errorf("restoring etcd: %w", err)
	}
	defer f.Close()
	m := backup.Member{Name: job.Self.Name, PeerURL: "https://" + net.JoinHostPort(job.Self.IPs[0], etcdPeerPort)}
	if _, err := backup.Restore(f, job.Req.Keys, m, tmp, zap.NewNop()); err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	if err := os.Rename(filepath.Join(tmp, "member"), member); err != nil {
		return fmt.Errorf("restoring etcd: moving the restored member into place: %w", err)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] restored etcd data of cluster %s (taken %s) into %s as member %s (%s), revision moved on by %d\n",
		r.Manifest.ClusterID, r.Manifest.Taken.UTC().Format("2006-01-02T15:04:05Z"), i.cfg.EtcdDir, m.Name, m.PeerURL, backup.RevisionBump)
	return nil
}

// snapshotKeySet is the KMS plugin's key set of a snapshot: every generation it carries, its
// active one active.
func snapshotKeySet(k backup.KMSKeys) (kmsplugin.KeySet, error) {
	set := kmsplugin.KeySet{Active: k.Active}
	for g, kek := range k.Keys {
		gen, err := strconv.ParseUint(g, 10, 32)
		if err != nil {
			return kmsplugin.KeySet{}, fmt.Errorf("the snapshot's KMS keys: generation %q is not a number", g)
		}
		set.Keys = append(set.Keys, kmsplugin.Key{Generation: uint32(gen), KEK: kek})
	}
	slices.SortFunc(set.Keys, func(a, b kmsplugin.Key) int { return int(a.Generation) - int(b.Generation) })
	if err := set.Validate(); err != nil {
		return kmsplugin.KeySet{}, fmt.Errorf("the snapshot's KMS keys: %w", err)
	}
	return set, nil
}

// restoreCleanup removes the old cluster's machines from the restored one: the Node objects of every
// node but this one, every pod bound to a node (they ran on the old machines; their controllers make
// new ones), the machines the old cluster admitted from its machine record and their Machines, so
// that fresh machines join as new ones and `kubectl get machines` lists only what joined the
// restored cluster; and the image-policy webhook's configuration, whose backends were the old
// machines' pods (the components phase installs it again). Machines an operator removed stay in the
// record, and their Machines with them: a restore must not re-admit a lost or stolen machine.
func (i *Initializer) restoreCleanup(ctx context.Context, job *Job) error {
	c, err := i.cleaner.Clean(ctx, i.adminConfPath(), job.Self.Name)
	if err != nil {
		return fmt.Errorf("clearing the old machines: %w", err)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] cleared the old cluster: %d Node objects %v, %d pods, %d admitted machines (record and Machines), "+
		"the image-policy webhook configuration; %d removed machines stay refused\n", len(c.Nodes), c.Nodes, c.Pods, c.Machines, c.KeptRemoved)
	return nil
}

// cleanup is what a restore's cleanup deleted and kept.
type cleanup struct {
	// Nodes are the names of the deleted Node objects.
	Nodes []string
	// Pods is how many pods were deleted.
	Pods int
	// Machines is how many admitted machines left the machine record or lost their Machine.
	Machines int
	// KeptRemoved is how many removed machines the record keeps.
	KeptRemoved int
}

// restoreCleaner clears the old machines out of a restored cluster.
type restoreCleaner interface {
	// Clean deletes, through kubeconfig's API server, every Node but self, every pod bound to a node
	// but mirror pods, every machine of the machine record but the removed ones, every Machine but
	// those of the removed machines, and the image-policy webhook's configuration.
	Clean(ctx context.Context, kubeconfig, self string) (cleanup, error)
}

// kubeCleaner is the restoreCleaner of a real API server.
type kubeCleaner struct{}

func (kubeCleaner) Clean(ctx context.Context, kubeconfig, self string) (cleanup, error) {
	var c cleanup
	cfg, err := kubeclient.FromFile(kubeconfig)
	if err != nil {
		return c, err
	}
	cs, err := kubeclient.Clientset(cfg)
	if err != nil {
		return c, err
	}
	rc, err := recordsclient.NewForConfig(cfg)
	if err != nil {
		return c, fmt.Errorf("the record API's client: %w", err)
	}
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return c, fmt.Errorf("listing Nodes: %w", err)
	}
	for _, n := range nodes.Items {
		if n.Name == self {
			continue
		}
		if err := cs.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return c, fmt.Errorf("deleting Node %s: %w", n.Name, err)
		}
		c.Nodes = append(c.Nodes, n.Name)
	}
	// Every pod bound to a node ran on an old machine, this node's name included: its status tells
	// of containers that do not exist here, and a kubelet given such a pod does not run its init
	// containers again (flannel's install-cni), so it never becomes ready. Deleted, their controllers
	// create them anew. Mirror pods are the kubelet's own.
	pods, err := cs.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName!="})
	if err != nil {
		return c, fmt.Errorf("listing pods: %w", err)
	}
	now := int64(0)
	for _, p := range pods.Items {
		if _, mirror := p.Annotations[mirrorPodAnnotation]; mirror {
			continue
		}
		err := cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &now})
		if err != nil && !apierrors.IsNotFound(err) {
			return c, fmt.Errorf("deleting pod %s/%s: %w", p.Namespace, p.Name, err)
		}
		c.Pods++
	}
	kept, err := clearAdmitted(ctx, cs, rc, &c)
	if err != nil {
		return c, err
	}
	c.KeptRemoved = len(kept)
	// The image-policy webhook's configuration names the old cluster's pods, which are gone: armed,
	// it would refuse every workload the components phase applies. That phase installs and arms it
	// again once its new pods serve.
	err = cs.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(ctx, webhookconfig.ConfigName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return c, fmt.Errorf("deleting the image-policy webhook's configuration: %w", err)
	}
	return c, nil
}

// clearAdmitted removes the machines the old cluster admitted from the machine record, keeping the
// removed ones (so that the joinservice still refuses them and the API server still refuses their
// node names until an operator re-admits them), then deletes every Machine but the kept machines'.
// It returns the kept identities and counts what it cleared in c.
func clearAdmitted(ctx context.Context, cs kubernetes.Interface, rc recordsclient.Interface, c *cleanup) (map[string]bool, error) {
	kept := map[string]bool{}
	cleared := map[string]bool{}
	_, err := machines.Update(ctx, cs, joinconfig.Namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
		clear(kept)
		clear(cleared)
		var left []machines.Machine
		for _, m := range ms {
			if m.Revoked() {
				kept[m.Identity] = true
				left = append(left, m)
				continue
			}
			cleared[m.Identity] = true
		}
		if len(left) == len(ms) {
			return nil, machines.ErrUnchanged
		}
		return left, nil
	})
	if err != nil {
		return nil, fmt.Errorf("clearing the machine record: %w", err)
	}
	opts := metav1.ListOptions{Limit: 500}
	for {
		list, err := rc.RecordsV1alpha1().Machines(joinconfig.Namespace).List(ctx, opts)
		if apierrors.IsNotFound(err) {
			break // a snapshot of a cluster without the record API
		}
		if err != nil {
			return nil, fmt.Errorf("listing Machines: %w", err)
		}
		for _, m := range list.Items {
			if kept[m.Spec.Identity] {
				continue
			}
			err := rc.RecordsV1alpha1().Machines(joinconfig.Namespace).Delete(ctx, m.Name, metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return nil, fmt.Errorf("deleting Machine %s: %w", m.Name, err)
			}
			cleared[m.Spec.Identity] = true
		}
		if opts.Continue = list.Continue; opts.Continue == "" {
			break
		}
	}
	c.Machines = len(cleared)
	return kept, nil
}
