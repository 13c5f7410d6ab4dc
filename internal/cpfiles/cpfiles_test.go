package cpfiles

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/afero"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/joinproto"
)

const config = `apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
apiServer:
  audit:
    policy: {omitStages: [RequestReceived], rules: [{level: Metadata, namespaces: [default]}, {level: None}]}
  admission:
    enablePlugins: [EventRateLimit]
    plugins:
    - name: EventRateLimit
      configuration: {apiVersion: eventratelimit.admission.k8s.io/v1alpha1, kind: Configuration, limits: [{type: Server, qps: 50, burst: 100}]}
patches:
- {target: kube-apiserver, type: merge, patch: "metadata: {annotations: {a: b}}"}
- {target: etcd, patch: "metadata: {annotations: {c: d}}"}
`

func parse(t *testing.T, doc string) clusterconfig.ClusterConfiguration {
	t.Helper()
	c, _, err := clusterconfig.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func byPath(files []*joinproto.File) map[string]*joinproto.File {
	m := map[string]*joinproto.File{}
	for _, f := range files {
		m[f.GetRoot().String()+":"+f.GetPath()] = f
	}
	return m
}

// TestRender: the admission configuration (Berth's PodSecurity first, then the operator's plugin),
// the audit policy as a Policy document, and one file per patch in kubeadm's naming, each with its
// root; a configuration without them has Berth's admission configuration alone.
func TestRender(t *testing.T) {
	c := parse(t, config)
	files, err := Render(&c)
	if err != nil {
		t.Fatal(err)
	}
	m := byPath(files)
	if len(files) != 4 {
		t.Fatalf("%d files, want 4: %v", len(files), m)
	}
	adm := m["FILE_ROOT_KUBERNETES:berth/admission.yaml"]
	if adm == nil {
		t.Fatalf("no admission configuration: %v", m)
	}
	ps, er := strings.Index(string(adm.GetData()), "name: PodSecurity"), strings.Index(string(adm.GetData()), "name: EventRateLimit")
	if ps < 0 || er < ps {
		t.Errorf("admission configuration has not PodSecurity then EventRateLimit:\n%s", adm.GetData())
	}
	want, err := berthsystem.AdmissionConfiguration()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(adm.GetData()), string(want)) {
		t.Errorf("admission configuration does not start as Berth's:\n%s\nBerth's:\n%s", adm.GetData(), want)
	}
	audit := m["FILE_ROOT_KUBERNETES:berth/audit-policy.yaml"]
	if audit == nil || !strings.Contains(string(audit.GetData()), "kind: Policy") || !strings.Contains(string(audit.GetData()), "apiVersion: audit.k8s.io/v1") ||
		!strings.Contains(string(audit.GetData()), "- RequestReceived") || audit.GetMode() != 0o600 {
		t.Errorf("audit policy = %+v", audit)
	}
	if p := m["FILE_ROOT_PATCHES:kube-apiserver000+merge.yaml"]; p == nil || string(p.GetData()) != "metadata: {annotations: {a: b}}" {
		t.Errorf("kube-apiserver patch = %+v (files %v)", p, m)
	}
	if p := m["FILE_ROOT_PATCHES:etcd001+strategic.yaml"]; p == nil {
		t.Errorf("no etcd patch: %v", m)
	}

	plain := parse(t, "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\n")
	files, err = Render(&plain)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 1 || string(files[0].GetData()) != string(want) {
		t.Errorf("a plain configuration renders %v, want Berth's admission configuration alone", byPath(files))
	}
}

// TestPathRefusesEscapes: a path outside its root's directory is ErrUnsafePath, whatever the root.
func TestPathRefusesEscapes(t *testing.T) {
	d := Dirs{Kubernetes: "/etc/kubernetes", State: "/var/lib/berth"}
	const (
		pki     = joinproto.FileRoot_FILE_ROOT_UNSPECIFIED
		kube    = joinproto.FileRoot_FILE_ROOT_KUBERNETES
		patches = joinproto.FileRoot_FILE_ROOT_PATCHES
	)
	for _, tc := range []struct {
		root joinproto.FileRoot
		path string
		want string // "" refused
	}{
		{pki, "etcd/ca.key", "/etc/kubernetes/pki/etcd/ca.key"},
		{kube, "berth/audit-policy.yaml", "/etc/kubernetes/berth/audit-policy.yaml"},
		{kube, "berth/admission.yaml", "/etc/kubernetes/berth/admission.yaml"},
		{patches, "etcd000+json.yaml", "/var/lib/berth/kubeadm-patches/etcd000+json.yaml"},
		{pki, "../../etc/shadow", ""},
		{pki, "/etc/shadow", ""},
		{pki, "", ""},
		{pki, "etcd/../../admin.conf", ""},
		{pki, "./ca.key", ""},
		{kube, "admin.conf", ""},
		{kube, "manifests/kube-apiserver.yaml", ""},
		{kube, "berth/../admin.conf", ""},
		{kube, "berth/..", ""},
		{kube, "berth/", ""},
		{kube, "berth/sub/x.yaml", ""},
		{kube, "/etc/kubernetes/berth/audit-policy.yaml", ""},
		{patches, "../kubeadm-init.yaml", ""},
		{patches, "..", ""},
		{patches, "sub/etcd.yaml", ""},
		{patches, `..\x.yaml`, ""},
		{joinproto.FileRoot(7), "x.yaml", ""},
	} {
		got, err := d.Path(&joinproto.File{Root: tc.root, Path: tc.path})
		switch {
		case tc.want == "" && !errors.Is(err, ErrUnsafePath):
			t.Errorf("Path(%v, %q) = %q, %v; want ErrUnsafePath", tc.root, tc.path, got, err)
		case tc.want != "" && (err != nil || got != tc.want):
			t.Errorf("Path(%v, %q) = %q, %v; want %q", tc.root, tc.path, got, err, tc.want)
		}
	}
}

// TestWrite: every file lands at its path with its mode, stale patches go, and one bad path
// refuses the whole set before anything is written.
func TestWrite(t *testing.T) {
	c := parse(t, config)
	files, err := Render(&c)
	if err != nil {
		t.Fatal(err)
	}
	fsys := afero.NewMemMapFs()
	d := Dirs{Kubernetes: "/etc/kubernetes", State: "/var/lib/berth"}
	stale := filepath.Join(d.Patches(), "kube-scheduler000+strategic.yaml")
	if err := afero.WriteFile(fsys, stale, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	files = append(files, &joinproto.File{Path: "ca.crt", Data: []byte("crt"), Mode: 0o755})
	if err := Write(fsys, d, files); err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		p, _ := d.Path(f)
		data, err := afero.ReadFile(fsys, p)
		if err != nil || string(data) != string(f.GetData()) {
			t.Errorf("%s: %q, %v", p, data, err)
		}
	}
	if fi, err := fsys.Stat("/etc/kubernetes/pki/ca.crt"); err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("ca.crt mode = %v, %v; want 0644 (at most)", fi.Mode(), err)
	}
	if fi, err := fsys.Stat(d.AuditPolicy()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("audit policy mode = %v, %v; want 0600", fi.Mode(), err)
	}
	if _, err := fsys.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("a stale patch stayed: %v", err)
	}
	if a, au, p := d.Written(files); a != "/etc/kubernetes/berth/admission.yaml" || au != "/etc/kubernetes/berth/audit-policy.yaml" || p != "/var/lib/berth/kubeadm-patches" {
		t.Errorf("Written = %q, %q, %q", a, au, p)
	}

	fresh := afero.NewMemMapFs()
	bad := append([]*joinproto.File{{Root: joinproto.FileRoot_FILE_ROOT_KUBERNETES, Path: "berth/audit-policy.yaml", Data: []byte("x")}},
		&joinproto.File{Root: joinproto.FileRoot_FILE_ROOT_KUBERNETES, Path: "berth/../manifests/kube-apiserver.yaml", Data: []byte("x")})
	if err := Write(fresh, d, bad); !errors.Is(err, ErrUnsafePath) {
		t.Fatalf("Write with an escaping path = %v, want ErrUnsafePath", err)
	}
	if _, err := fresh.Stat(d.AuditPolicy()); !os.IsNotExist(err) {
		t.Errorf("a refused set wrote its first file: %v", err)
	}
}

// TestFromCluster: the files of the configuration the cluster keeps; none for a cluster without
// the ConfigMap; an error for one that does not decode.
func TestFromCluster(t *testing.T) {
	ctx := context.Background()
	files, err := FromCluster(ctx, fake.NewClientset())
	if err != nil || files != nil {
		t.Fatalf("no ConfigMap: %v, %v; want none", files, err)
	}
	cm, err := clusterconfig.ConfigMap(parse(t, config))
	if err != nil {
		t.Fatal(err)
	}
	files, err = FromCluster(ctx, fake.NewClientset(cm))
	if err != nil {
		t.Fatal(err)
	}
	if m := byPath(files); len(files) != 4 || m["FILE_ROOT_KUBERNETES:berth/audit-policy.yaml"] == nil {
		t.Errorf("FromCluster = %v", m)
	}
	broken := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Namespace: clusterconfig.ConfigMapNamespace, Name: clusterconfig.ConfigMapName},
		Data:       map[string]string{clusterconfig.ConfigMapKey: "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\nbogus: 1\n"},
	}
	if _, err := FromCluster(ctx, fake.NewClientset(broken)); !errors.Is(err, clusterconfig.ErrInvalid) {
		t.Errorf("an undecodable ConfigMap: %v, want clusterconfig.ErrInvalid", err)
	}
}
