// Package components installs the cluster's own components after kubeadm init, in a fixed order:
//
//  1. extra manifests from a directory (the pod network, for example), applied in file-name order;
//  2. the objects of berth-system (internal/berthsystem): the namespace and its image guard, the
//     cluster Secret, the join ConfigMap, the record API's CustomResourceDefinitions (internal/records),
//     and the joinservice with its RBAC and DaemonSet.
//
// Every object is server-side applied with one field manager, so a re-run is a no-op. The image-policy
// webhook is installed last by its own installer once its backend serves.
package components

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"

	"github.com/spf13/afero"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// Config configures the installer.
type Config struct {
	// ManifestDir holds extra manifests (*.yaml, *.yml, *.json) applied first; empty means none.
	ManifestDir string
	// JoinServiceImage is the joinservice's container image.
	JoinServiceImage string
	// ImagePullPolicy for Berth's images ("Never" when images are pre-imported).
	ImagePullPolicy string
	// JoinServiceEnv is passed to the joinservice container (metadata provider, attestation variant).
	JoinServiceEnv map[string]string
	// WebhookImage is the image-policy webhook's container image; empty leaves the webhook out.
	WebhookImage string
	// JoinServiceHostPaths are host paths (the TPM's socket directory or device) mounted into the
	// joinservice at the same path, so it can attest with this node's TPM.
	JoinServiceHostPaths []string
}

// Installer installs the components.
type Installer struct {
	cfg       Config
	fs        afero.Fs
	newClient func(kubeconfigPath string) (applier, error)
}

// New returns an installer that applies through a client built from the init kubeconfig.
func New(cfg Config, fsys afero.Fs) *Installer {
	return &Installer{cfg: cfg, fs: fsys, newClient: func(path string) (applier, error) {
		return apply.NewFromKubeconfig(path)
	}}
}

// Install applies every component in order.
func (i *Installer) Install(ctx context.Context, kubeconfigPath string, job *initcluster.Job) error {
	client, err := i.newClient(kubeconfigPath)
	if err != nil {
		return err
	}
	extra, err := i.extraManifests()
	if err != nil {
		return err
	}
	objs, err := i.objects(job)
	if err != nil {
		return err
	}
	all := append(extra, objs...)
	for _, obj := range all {
		if err := client.Apply(ctx, obj); err != nil {
			return err
		}
		_, _ = fmt.Fprintf(job.Out, "[berth] applied %s %s\n", obj.GetKind(), qualifiedName(obj))
	}
	return i.installWebhook(ctx, kubeconfigPath, job)
}

func qualifiedName(obj *unstructured.Unstructured) string {
	if ns := obj.GetNamespace(); ns != "" {
		return ns + "/" + obj.GetName()
	}
	return obj.GetName()
}

func (i *Installer) extraManifests() ([]*unstructured.Unstructured, error) {
	if i.cfg.ManifestDir == "" {
		return nil, nil
	}
	entries, err := afero.ReadDir(i.fs, i.cfg.ManifestDir)
	if err != nil {
		return nil, fmt.Errorf("reading manifest directory: %w", err)
	}
	var names []string
	for _, e := range entries {
		switch filepath.Ext(e.Name()) {
		case ".yaml", ".yml", ".json":
			if !e.IsDir() {
				names = append(names, e.Name())
			}
		}
	}
	slices.Sort(names)
	var objs []*unstructured.Unstructured
	for _, n := range names {
		data, err := afero.ReadFile(i.fs, filepath.Join(i.cfg.ManifestDir, n))
		if err != nil {
			return nil, fmt.Errorf("reading manifest %s: %w", n, err)
		}
		o, err := apply.Decode(data)
		if err != nil {
			return nil, fmt.Errorf("manifest %s: %w", n, err)
		}
		objs = append(objs, o...)
	}
	return objs, nil
}

func (i *Installer) objects(job *initcluster.Job) ([]*unstructured.Unstructured, error) {
	var guard []string
	if i.cfg.WebhookImage != "" {
		guard = append(guard, i.cfg.WebhookImage)
	}
	// The configuration in force, first: later changes and upgrades read it.
	cm, err := clusterconfig.ConfigMap(job.Req.Cluster)
	if err != nil {
		return nil, err
	}
	stored, err := runtime.DefaultUnstructuredConverter.ToUnstructured(cm)
	if err != nil {
		return nil, fmt.Errorf("encoding the cluster configuration's ConfigMap: %w", err)
	}
	objs, err := berthsystem.Objects(berthsystem.Config{
		JoinServiceImage:     i.cfg.JoinServiceImage,
		ImagePullPolicy:      i.cfg.ImagePullPolicy,
		JoinServiceEnv:       i.cfg.JoinServiceEnv,
		JoinServiceHostPaths: i.cfg.JoinServiceHostPaths,
		GuardImages:          guard,
	}, berthsystem.Cluster{
		Secrets: joinconfig.ClusterSecrets{MasterSecret: job.Req.Keys.MasterSecret(), Salt: job.Req.Salt},
		Join: joinconfig.Config{
			AttestationPolicy: job.Req.AttestationPolicy,
			MeasurementSalt:   job.Req.Salt,
			ClusterID:         job.Req.Keys.ClusterID(),
			KubernetesVersion: job.Req.KubernetesVersion,
			APIServerEndpoint: job.ControlPlaneEndpoint,
		},
	})
	if err != nil {
		return nil, err
	}
	return append([]*unstructured.Unstructured{{Object: stored}}, objs...), nil
}

// applier applies objects.
type applier interface {
	// Apply server-side applies objs in order.
	Apply(ctx context.Context, objs ...*unstructured.Unstructured) error
}
