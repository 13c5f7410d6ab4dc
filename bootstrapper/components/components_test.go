package components

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"

	"github.com/spf13/afero"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

type recorder struct{ applied []string }

func (r *recorder) Apply(_ context.Context, objs ...*unstructured.Unstructured) error {
	for _, o := range objs {
		r.applied = append(r.applied, o.GetKind()+" "+qualifiedName(o))
	}
	return nil
}

func job(t *testing.T) *initcluster.Job {
	keys, err := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return &initcluster.Job{Req: initcluster.Request{Keys: keys, Salt: bytes.Repeat([]byte{2}, 32), KubernetesVersion: "v1.34.2"},
		Out: io.Discard, ControlPlaneEndpoint: "198.51.100.10:6443"}
}

func TestInstallOrder(t *testing.T) {
	fsys := afero.NewMemMapFs()
	_ = afero.WriteFile(fsys, "/m/20-dns.yaml", []byte("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: dns, namespace: kube-system}\n"), 0o644)
	_ = afero.WriteFile(fsys, "/m/10-net.yaml", []byte("apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: flannel, namespace: kube-system}\n---\n"), 0o644)
	_ = afero.WriteFile(fsys, "/m/README.md", []byte("not a manifest"), 0o644)
	rec := &recorder{}
	i := New(Config{ManifestDir: "/m", JoinServiceImage: "berth.local/joinservice:test"}, fsys)
	i.newClient = func(string) (applier, error) { return rec, nil }
	if err := i.Install(context.Background(), "/admin.conf", job(t)); err != nil {
		t.Fatal(err)
	}
	want := strings.Join([]string{
		"ServiceAccount kube-system/flannel",
		"ConfigMap kube-system/dns",
		"ConfigMap kube-system/berth-cluster-config",
		"Namespace berth-system",
		"RuntimeClass berth-host",
		"ValidatingAdmissionPolicy berth-system-images", "ValidatingAdmissionPolicyBinding berth-system-images",
		"ValidatingAdmissionPolicy berth-host-runtime", "ValidatingAdmissionPolicyBinding berth-host-runtime",
		"ValidatingAdmissionPolicy berth-node-revocation", "ValidatingAdmissionPolicyBinding berth-node-revocation",
		"Secret berth-system/berth-cluster-secrets",
		"ConfigMap berth-system/berth-join-config",
		"CustomResourceDefinition machines.records.berth.dev", "CustomResourceDefinition joinrecords.records.berth.dev",
		"ConfigMap berth-system/berth-join-ledger",
		"ConfigMap berth-system/berth-machines",
		"Lease berth-system/berth-control-plane-slot",
		"Lease berth-system/berth-cert-keeper",
		"ConfigMap berth-system/berth-backup", "Lease berth-system/berth-backup",
		"ServiceAccount berth-system/berth-joinservice",
		"Role berth-system/berth:joinservice",
		"RoleBinding berth-system/berth:joinservice",
		"Role kube-system/berth:joinservice:cluster-config",
		"RoleBinding kube-system/berth:joinservice:cluster-config",
		"ClusterRole berth:joinservice:kubelet-serving-approver",
		"ClusterRoleBinding berth:joinservice:kubelet-serving-approver",
		"ClusterRole berth:joinservice:webhook-spread",
		"ClusterRoleBinding berth:joinservice:webhook-spread",
		"DaemonSet berth-system/berth-joinservice",
	}, "\n")
	if got := strings.Join(rec.applied, "\n"); got != want {
		t.Fatalf("applied:\n%s\nwant:\n%s", got, want)
	}
}

func TestInstallNeedsImage(t *testing.T) {
	i := New(Config{}, afero.NewMemMapFs())
	i.newClient = func(string) (applier, error) { return &recorder{}, nil }
	if err := i.Install(context.Background(), "/admin.conf", job(t)); err == nil {
		t.Fatal("Install() without a joinservice image = nil")
	}
}

func TestBadManifestIsNamed(t *testing.T) {
	fsys := afero.NewMemMapFs()
	_ = afero.WriteFile(fsys, "/m/bad.yaml", []byte("kind: [\n"), 0o644)
	i := New(Config{ManifestDir: "/m", JoinServiceImage: "x"}, fsys)
	i.newClient = func(string) (applier, error) { return &recorder{}, nil }
	err := i.Install(context.Background(), "/admin.conf", job(t))
	if err == nil || !strings.Contains(err.Error(), "bad.yaml") {
		t.Fatalf("Install() = %v, want an error naming bad.yaml", err)
	}
}

// TestInstallStoresClusterConfig: the first object is the ConfigMap keeping the request's cluster
// configuration, which reads back as that configuration.
func TestInstallStoresClusterConfig(t *testing.T) {
	j := job(t)
	c, _, err := clusterconfig.Parse([]byte("apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\nkubelet: {maxPods: 42}\n"))
	if err != nil {
		t.Fatal(err)
	}
	j.Req.Cluster = c
	objs, err := New(Config{JoinServiceImage: "berth.local/joinservice:test"}, afero.NewMemMapFs()).objects(j)
	if err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(objs[0].Object, &cm); err != nil {
		t.Fatal(err)
	}
	stored, err := clusterconfig.FromConfigMap(&cm)
	if err != nil || cm.Namespace != "kube-system" || cm.Name != "berth-cluster-config" || stored.Kubelet == nil || stored.Kubelet.MaxPods != 42 {
		t.Errorf("stored %s/%s = %+v, %v", cm.Namespace, cm.Name, stored, err)
	}
}
