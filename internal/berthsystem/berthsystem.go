// Package berthsystem builds the objects Berth keeps in its berth-system namespace: the namespace
// itself and its image guard, the cluster Secret, the join ConfigMap, and the joinservice with its
// ServiceAccount, RBAC and DaemonSet. The names, ports and data encodings are joinconfig's; this
// package only assembles them into objects, so the bootstrapper installs exactly what a test harness
// installs.
package berthsystem

import (
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// ErrNoJoinServiceImage is returned when Config names no joinservice image.
var ErrNoJoinServiceImage = errors.New("no joinservice image configured")

const (
	controlPlaneLabel = "node-role.kubernetes.io/control-plane"
	// joinServiceRole names the joinservice's Role and RoleBinding.
	joinServiceRole = "berth:joinservice"
	pkiDir          = "/etc/kubernetes/pki"
)

// Config is how the components are deployed.
type Config struct {
	// JoinServiceImage is the joinservice's container image.
	JoinServiceImage string
	// ImagePullPolicy for Berth's images; empty means IfNotPresent ("Never" when images are
	// pre-imported).
	ImagePullPolicy string
	// JoinServiceEnv is passed to the joinservice container (metadata provider, attestation variant).
	JoinServiceEnv map[string]string
	// JoinServiceHostPaths are host paths (the TPM's socket directory or device) mounted into the
	// joinservice at the same path, so it can attest with its node's TPM.
	JoinServiceHostPaths []string
	// GuardImages are the images besides the joinservice's that may run in berth-system (the webhook's).
	GuardImages []string
}

// Cluster is what init decided about the cluster.
type Cluster struct {
	Secrets joinconfig.ClusterSecrets
	Join    joinconfig.Config
}

// Objects returns every object of berth-system in the order they must be applied: the namespace, its
// guard, the cluster Secret, the join ConfigMap, then the joinservice.
func Objects(cfg Config, c Cluster) ([]*unstructured.Unstructured, error) {
	if cfg.JoinServiceImage == "" {
		return nil, ErrNoJoinServiceImage
	}
	objs := []map[string]any{{
		"apiVersion": "v1", "kind": "Namespace",
		"metadata": map[string]any{"name": joinconfig.Namespace, "labels": map[string]any{"app.kubernetes.io/part-of": "berth"}},
	}}
	objs = append(objs, Guard(append([]string{cfg.JoinServiceImage}, cfg.GuardImages...))...)
	objs = append(objs, clusterData(c)...)
	objs = append(objs, joinService(cfg)...)
	out := make([]*unstructured.Unstructured, len(objs))
	for n, o := range objs {
		out[n] = &unstructured.Unstructured{Object: o}
	}
	return out, nil
}

// clusterData returns the cluster Secret and the join ConfigMap.
func clusterData(c Cluster) []map[string]any {
	secretData := map[string]any{}
	for k, v := range c.Secrets.Data() {
		secretData[k] = base64.StdEncoding.EncodeToString(v)
	}
	configData := map[string]any{}
	for k, v := range c.Join.Data() {
		configData[k] = v
	}
	return []map[string]any{
		{
			"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
			"metadata": map[string]any{"name": joinconfig.SecretName, "namespace": joinconfig.Namespace},
			"data":     secretData,
		},
		{
			"apiVersion": "v1", "kind": "ConfigMap",
			"metadata": map[string]any{"name": joinconfig.JoinConfigName, "namespace": joinconfig.Namespace},
			"data":     configData,
		},
	}
}

// joinService returns the joinservice's ServiceAccount, Role, RoleBinding and DaemonSet.
func joinService(cfg Config) []map[string]any {
	pull := cfg.ImagePullPolicy
	if pull == "" {
		pull = "IfNotPresent"
	}
	env := []any{
		map[string]any{"name": "NODE_NAME", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "spec.nodeName"}}},
		map[string]any{"name": "HOST_IP", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "status.hostIP"}}},
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.JoinServiceEnv)) {
		env = append(env, map[string]any{"name": k, "value": cfg.JoinServiceEnv[k]})
	}
	labels := map[string]any{"app.kubernetes.io/name": joinconfig.JoinServiceName, "app.kubernetes.io/part-of": "berth"}
	mounts := []any{map[string]any{"name": "pki", "mountPath": pkiDir, "readOnly": true}}
	volumes := []any{map[string]any{"name": "pki", "hostPath": map[string]any{"path": pkiDir, "type": "Directory"}}}
	privileged := false
	for n, p := range cfg.JoinServiceHostPaths {
		name := fmt.Sprintf("host-%d", n)
		mounts = append(mounts, map[string]any{"name": name, "mountPath": p})
		volumes = append(volumes, map[string]any{"name": name, "hostPath": map[string]any{"path": p}})
		if strings.HasPrefix(p, "/dev/") {
			privileged = true // a TPM character device needs device access
		}
	}
	ns := joinconfig.Namespace
	return []map[string]any{
		{
			"apiVersion": "v1", "kind": "ServiceAccount",
			"metadata": map[string]any{"name": joinconfig.ServiceAccountName, "namespace": ns},
		},
		{
			// Everything the joinservice touches is in berth-system: a Role, not a ClusterRole.
			"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
			"metadata": map[string]any{"name": joinServiceRole, "namespace": ns},
			"rules": []any{
				map[string]any{"apiGroups": []any{""}, "resources": []any{"secrets"}, "resourceNames": []any{joinconfig.SecretName}, "verbs": []any{"get"}},
				map[string]any{"apiGroups": []any{""}, "resources": []any{"configmaps"}, "verbs": []any{"get", "list", "watch", "create"}},
				// The join ledger is the one ConfigMap the joinservice rewrites.
				map[string]any{"apiGroups": []any{""}, "resources": []any{"configmaps"}, "resourceNames": []any{joinconfig.JoinLedgerName}, "verbs": []any{"update"}},
				map[string]any{"apiGroups": []any{""}, "resources": []any{"events"}, "verbs": []any{"create", "patch"}},
				map[string]any{"apiGroups": []any{"coordination.k8s.io"}, "resources": []any{"leases"}, "verbs": []any{"create", "get", "update", "delete"}},
			},
		},
		{
			"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
			"metadata": map[string]any{"name": joinServiceRole, "namespace": ns},
			"roleRef":  map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": joinServiceRole},
			"subjects": []any{map[string]any{"kind": "ServiceAccount", "name": joinconfig.ServiceAccountName, "namespace": ns}},
		},
		{
			"apiVersion": "apps/v1", "kind": "DaemonSet",
			"metadata": map[string]any{"name": joinconfig.JoinServiceName, "namespace": ns, "labels": labels},
			"spec": map[string]any{
				"selector": map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": joinconfig.JoinServiceName}},
				"template": map[string]any{
					"metadata": map[string]any{"labels": labels},
					"spec": map[string]any{
						"serviceAccountName": joinconfig.ServiceAccountName,
						"hostNetwork":        true,
						"priorityClassName":  "system-cluster-critical",
						"nodeSelector":       map[string]any{controlPlaneLabel: ""},
						"tolerations":        []any{map[string]any{"operator": "Exists"}},
						"containers": []any{map[string]any{
							"name":            "joinservice",
							"image":           cfg.JoinServiceImage,
							"imagePullPolicy": pull,
							"args": []any{
								fmt.Sprintf("--listen=:%d", joinconfig.JoinPort),
								"--pki-dir=" + pkiDir,
								// Metrics and probes on the node's own address, not every interface.
								fmt.Sprintf("--metrics-listen=$(HOST_IP):%d", joinconfig.MetricsPort),
							},
							"ports": []any{
								map[string]any{"name": "join", "containerPort": joinconfig.JoinPort, "protocol": "TCP"},
								map[string]any{"name": "metrics", "containerPort": joinconfig.MetricsPort, "protocol": "TCP"},
							},
							"livenessProbe": map[string]any{
								"httpGet":          map[string]any{"path": "/livez", "port": joinconfig.MetricsPort},
								"periodSeconds":    10,
								"failureThreshold": 6,
							},
							"readinessProbe": map[string]any{
								"httpGet":       map[string]any{"path": "/readyz", "port": joinconfig.MetricsPort},
								"periodSeconds": 5,
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
	}
}
