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

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeclient"
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
// new ones), and the machine record (the components phase applies it again, empty), so that fresh
// machines join as new ones; and the image-policy webhook's configuration, whose backends were the
// old machines' pods (the components phase installs it again).
func (i *Initializer) restoreCleanup(ctx context.Context, job *Job) error {
	removed, err := i.cleaner.Clean(ctx, i.adminConfPath(), job.Self.Name)
	if err != nil {
		return fmt.Errorf("clearing the old machines: %w", err)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] deleted the old cluster's pods, machine record, image-policy webhook configuration and %d Node objects %v\n", len(removed), removed)
	return nil
}

// restoreCleaner clears the old machines out of a restored cluster.
type restoreCleaner interface {
	// Clean deletes every Node but self, every pod bound to a node but mirror pods, the machine
	// record and the image-policy webhook's configuration through kubeconfig's API server,
	// returning the deleted Nodes' names.
	Clean(ctx context.Context, kubeconfig, self string) ([]string, error)
}

// kubeCleaner is the restoreCleaner of a real API server.
type kubeCleaner struct{}

func (kubeCleaner) Clean(ctx context.Context, kubeconfig, self string) ([]string, error) {
	cfg, err := kubeclient.FromFile(kubeconfig)
	if err != nil {
		return nil, err
	}
	cs, err := kubeclient.Clientset(cfg)
	if err != nil {
		return nil, err
	}
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("listing Nodes: %w", err)
	}
	var removed []string
	for _, n := range nodes.Items {
		if n.Name == self {
			continue
		}
		if err := cs.CoreV1().Nodes().Delete(ctx, n.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return removed, fmt.Errorf("deleting Node %s: %w", n.Name, err)
		}
		removed = append(removed, n.Name)
	}
	// Every pod bound to a node ran on an old machine, this node's name included: its status tells
	// of containers that do not exist here, and a kubelet given such a pod does not run its init
	// containers again (flannel's install-cni), so it never becomes ready. Deleted, their controllers
	// create them anew. Mirror pods are the kubelet's own.
	pods, err := cs.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName!="})
	if err != nil {
		return removed, fmt.Errorf("listing pods: %w", err)
	}
	now := int64(0)
	for _, p := range pods.Items {
		if _, mirror := p.Annotations[mirrorPodAnnotation]; mirror {
			continue
		}
		err := cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &now})
		if err != nil && !apierrors.IsNotFound(err) {
			return removed, fmt.Errorf("deleting pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
	err = cs.CoreV1().ConfigMaps(joinconfig.Namespace).Delete(ctx, joinconfig.MachinesName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return removed, fmt.Errorf("deleting the machine record: %w", err)
	}
	// The image-policy webhook's configuration names the old cluster's pods, which are gone: armed,
	// it would refuse every workload the components phase applies. That phase installs and arms it
	// again once its new pods serve.
	err = cs.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(ctx, webhookconfig.ConfigName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return removed, fmt.Errorf("deleting the image-policy webhook's configuration: %w", err)
	}
	return removed, nil
}
