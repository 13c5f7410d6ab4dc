// Package components installs the cluster's own components after kubeadm init, in a fixed order:
//
//  1. extra manifests from a directory (the pod network, for example), applied in file-name order;
//  2. the berth-system namespace, and a ValidatingAdmissionPolicy that admits only Berth's own images
//     there (the webhook exempts the namespace, so it must be locked down another way);
//  3. the cluster secrets the joinservice derives join keys from (Secret berth-cluster-secrets);
//  4. the join configuration: attestation policy, measurement salt, cluster ID, Kubernetes version
//     (ConfigMap berth-join-config);
//  5. the joinservice: ServiceAccount, RBAC and DaemonSet berth-joinservice on the control planes.
//
// Every object is server-side applied with one field manager, so a re-run is a no-op. The image-policy
// webhook is installed last by its own installer once its backend serves.
package components

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/afero"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/internal/apply"
)

// Names of the objects Berth installs.
const (
	Namespace       = "berth-system"
	SecretName      = "berth-cluster-secrets"
	JoinConfigName  = "berth-join-config"
	JoinLedgerName  = "berth-join-ledger"
	JoinServiceName = "berth-joinservice"
	JoinServicePort = 30090
	// JoinServiceMetricsPort serves the joinservice's /metrics and /healthz (host network).
	JoinServiceMetricsPort = 30091
	controlPlaneLabel      = "node-role.kubernetes.io/control-plane"
	joinServiceAccount     = "berth-joinservice"
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
		fmt.Fprintf(job.Out, "[berth] applied %s %s\n", obj.GetKind(), qualifiedName(obj))
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
	pull := i.cfg.ImagePullPolicy
	if pull == "" {
		pull = "IfNotPresent"
	}
	if i.cfg.JoinServiceImage == "" {
		return nil, fmt.Errorf("no joinservice image configured")
	}
	clusterID := job.Req.Keys.ClusterID()
	env := []any{map[string]any{"name": "NODE_NAME", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "spec.nodeName"}}}}
	names := make([]string, 0, len(i.cfg.JoinServiceEnv))
	for k := range i.cfg.JoinServiceEnv {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		env = append(env, map[string]any{"name": k, "value": i.cfg.JoinServiceEnv[k]})
	}
	labels := map[string]any{"app.kubernetes.io/name": JoinServiceName, "app.kubernetes.io/part-of": "berth"}
	mounts := []any{map[string]any{"name": "pki", "mountPath": "/etc/kubernetes/pki", "readOnly": true}}
	volumes := []any{map[string]any{"name": "pki", "hostPath": map[string]any{"path": "/etc/kubernetes/pki", "type": "Directory"}}}
	privileged := false
	for n, p := range i.cfg.JoinServiceHostPaths {
		name := fmt.Sprintf("host-%d", n)
		mounts = append(mounts, map[string]any{"name": name, "mountPath": p})
		volumes = append(volumes, map[string]any{"name": name, "hostPath": map[string]any{"path": p}})
		if strings.HasPrefix(p, "/dev/") {
			privileged = true // a TPM character device needs device access
		}
	}
	images := []string{i.cfg.JoinServiceImage}
	if i.cfg.WebhookImage != "" {
		images = append(images, i.cfg.WebhookImage)
	}
	objs := []map[string]any{
		{
			"apiVersion": "v1", "kind": "Namespace",
			"metadata": map[string]any{"name": Namespace, "labels": map[string]any{"app.kubernetes.io/part-of": "berth"}},
		},
	}
	objs = append(objs, namespaceGuard(images)...)
	objs = append(objs, []map[string]any{
		{
			"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
			"metadata": map[string]any{"name": SecretName, "namespace": Namespace},
			"data": map[string]any{
				"masterSecret": base64.StdEncoding.EncodeToString(job.Req.Keys.MasterSecret()),
				"salt":         base64.StdEncoding.EncodeToString(job.Req.Salt),
			},
		},
		{
			"apiVersion": "v1", "kind": "ConfigMap",
			"metadata": map[string]any{"name": JoinConfigName, "namespace": Namespace},
			"data": map[string]any{
				"attestationPolicy": string(job.Req.AttestationPolicy),
				"measurementSalt":   hex.EncodeToString(job.Req.Salt),
				"clusterID":         hex.EncodeToString(clusterID),
				"kubernetesVersion": job.Req.KubernetesVersion,
				"apiServerEndpoint": job.ControlPlaneEndpoint,
			},
		},
		{
			"apiVersion": "v1", "kind": "ServiceAccount",
			"metadata": map[string]any{"name": joinServiceAccount, "namespace": Namespace},
		},
		{
			// Everything the joinservice touches is in berth-system: a Role, not a ClusterRole.
			"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
			"metadata": map[string]any{"name": "berth:joinservice", "namespace": Namespace},
			"rules": []any{
				map[string]any{"apiGroups": []any{""}, "resources": []any{"secrets"}, "resourceNames": []any{SecretName}, "verbs": []any{"get"}},
				map[string]any{"apiGroups": []any{""}, "resources": []any{"configmaps"}, "verbs": []any{"get", "list", "watch", "create"}},
				// The join ledger is the one ConfigMap the joinservice rewrites.
				map[string]any{"apiGroups": []any{""}, "resources": []any{"configmaps"}, "resourceNames": []any{JoinLedgerName}, "verbs": []any{"update"}},
				map[string]any{"apiGroups": []any{""}, "resources": []any{"events"}, "verbs": []any{"create", "patch"}},
				map[string]any{"apiGroups": []any{"coordination.k8s.io"}, "resources": []any{"leases"}, "verbs": []any{"create", "get", "update", "delete"}},
			},
		},
		{
			"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
			"metadata": map[string]any{"name": "berth:joinservice", "namespace": Namespace},
			"roleRef":  map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "berth:joinservice"},
			"subjects": []any{map[string]any{"kind": "ServiceAccount", "name": joinServiceAccount, "namespace": Namespace}},
		},
		{
			"apiVersion": "apps/v1", "kind": "DaemonSet",
			"metadata": map[string]any{"name": JoinServiceName, "namespace": Namespace, "labels": labels},
			"spec": map[string]any{
				"selector": map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": JoinServiceName}},
				"template": map[string]any{
					"metadata": map[string]any{"labels": labels},
					"spec": map[string]any{
						"serviceAccountName": joinServiceAccount,
						"hostNetwork":        true,
						"priorityClassName":  "system-cluster-critical",
						"nodeSelector":       map[string]any{controlPlaneLabel: ""},
						"tolerations":        []any{map[string]any{"operator": "Exists"}},
						"containers": []any{map[string]any{
							"name":            "joinservice",
							"image":           i.cfg.JoinServiceImage,
							"imagePullPolicy": pull,
							"args": []any{
								fmt.Sprintf("--listen=:%d", JoinServicePort),
								"--pki-dir=/etc/kubernetes/pki",
								fmt.Sprintf("--metrics-listen=:%d", JoinServiceMetricsPort),
							},
							"ports": []any{
								map[string]any{"name": "join", "containerPort": JoinServicePort, "protocol": "TCP"},
								map[string]any{"name": "metrics", "containerPort": JoinServiceMetricsPort, "protocol": "TCP"},
							},
							"livenessProbe": map[string]any{
								"httpGet":          map[string]any{"path": "/healthz", "port": JoinServiceMetricsPort},
								"periodSeconds":    10,
								"failureThreshold": 6,
							},
							"env":             env,
							"volumeMounts":    mounts,
							"securityContext": map[string]any{"privileged": privileged},
						}},
						"volumes": volumes,
					},
				},
			},
		},
	}...)
	out := make([]*unstructured.Unstructured, len(objs))
	for n, o := range objs {
		out[n] = &unstructured.Unstructured{Object: o}
	}
	return out, nil
}

// applier applies objects.
type applier interface {
	// Apply server-side applies objs in order.
	Apply(ctx context.Context, objs ...*unstructured.Unstructured) error
}
