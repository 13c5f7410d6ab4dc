package supportbundle

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

const (
	secretValue = "s3cr3t-value-that-must-not-leave"
	privateKey  = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIIrYSSNQFaA2Hwf1duRSxKtLYX5CrlClbGvyDNNbvIEJoAoGCCqGSM49\n-----END EC PRIVATE KEY-----"
)

// untar returns the archive's files by name (without the bundle's directory) in order.
func untar(t *testing.T, b []byte, dir string) (map[string]string, []string) {
	t.Helper()
	gz, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	files := map[string]string{}
	var order []string
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Mode != 0o600 || !strings.HasPrefix(h.Name, dir+"/") {
			t.Errorf("%s: mode %o, want 0600 under %s/", h.Name, h.Mode, dir)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimPrefix(h.Name, dir+"/")
		files[name] = string(data)
		order = append(order, name)
	}
	return files, order
}

// TestCollectFromRealAPIServer: a bundle from a real API server holds the nodes, Berth's
// ConfigMaps, the Machines and JoinRecords, the Events and the caller's extra file; it names the
// refused machine that is no node; a Secret's value and a private key in a ConfigMap never reach it;
// the manifest comes first and lists every file. The API server runs no kubelet, so pod logs cannot
// be read and the manifest says so.
func TestCollectFromRealAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	kube := env.Client(t, apiservertest.AdminUser)
	rc, err := clientset.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	ns := joinconfig.Namespace
	if _, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kube.CoreV1().Nodes().Delete(context.Background(), "w1", metav1.DeleteOptions{}) })
	for _, o := range []struct {
		name string
		data map[string]string
	}{{"support-test-secret", map[string]string{"value": secretValue}}} {
		if _, err := kube.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: o.name}, StringData: o.data}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = kube.CoreV1().Secrets(ns).Delete(context.Background(), o.name, metav1.DeleteOptions{}) })
	}
	if _, err := kube.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "support-test-leak"},
		Data: map[string]string{"leaked.pem": privateKey, "settings": "token: " + secretValue}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = kube.CoreV1().ConfigMaps(ns).Delete(context.Background(), "support-test-leak", metav1.DeleteOptions{})
	})
	now := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	id := strings.Repeat("4c", 32)
	if _, err := rc.RecordsV1alpha1().Machines(ns).Create(ctx, &v1alpha1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(id), Namespace: ns},
		Spec:       v1alpha1.MachineSpec{Identity: id, Node: "w1", Role: "worker"},
		Status:     v1alpha1.MachineStatus{State: v1alpha1.StateAdmitted, Admitted: now},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	spec := v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassEvidence, Identity: strings.Repeat("9a", 32), Peer: "198.51.100.9", Node: "w9", RPC: "join", Reason: "MEASUREMENT_MISMATCH"}
	if _, err := rc.RecordsV1alpha1().JoinRecords(ns).Create(ctx, &v1alpha1.JoinRecord{
		ObjectMeta: metav1.ObjectMeta{Name: records.RecordName(spec), Namespace: ns}, Spec: spec,
		Status: v1alpha1.JoinRecordStatus{Count: 2, First: now, Last: now},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = rc.RecordsV1alpha1().Machines(ns).Delete(context.Background(), records.NameFor(id), metav1.DeleteOptions{})
		_ = rc.RecordsV1alpha1().JoinRecords(ns).Delete(context.Background(), records.RecordName(spec), metav1.DeleteOptions{})
	})

	var out bytes.Buffer
	when := time.Date(2026, 11, 27, 10, 0, 0, 0, time.UTC)
	s, err := Collect(ctx, &out, Sources{Kube: kube, Records: rc}, Options{Namespace: ns, TailLines: 100, Now: when,
		Extra: map[string]func(io.Writer) error{"status.json": func(w io.Writer) error { _, err := io.WriteString(w, `{"ok":true}`); return err }}})
	if err != nil {
		t.Fatal(err)
	}
	files, order := untar(t, out.Bytes(), "berth-support-20261127T100000Z")
	if order[0] != "MANIFEST.txt" {
		t.Errorf("the archive starts with %s, want MANIFEST.txt", order[0])
	}
	for _, name := range []string{"cluster/nodes.yaml", "cluster/version.txt", ns + "/configmaps.yaml", "records/machines.yaml", "records/joinrecords.yaml",
		"events/" + ns + ".yaml", "status.json", ns + "/pods.yaml"} {
		if _, ok := files[name]; !ok {
			t.Errorf("no %s in the bundle (files %v)", name, order)
		}
		if !strings.Contains(files["MANIFEST.txt"], "  "+name+"\n") {
			t.Errorf("the manifest does not list %s", name)
		}
	}
	if !strings.Contains(files["records/machines.yaml"], "node: w1") || !strings.Contains(files["records/joinrecords.yaml"], "MEASUREMENT_MISMATCH") {
		t.Errorf("the records are not in the bundle:\n%s\n%s", files["records/machines.yaml"], files["records/joinrecords.yaml"])
	}
	if !strings.Contains(files["MANIFEST.txt"], "198.51.100.9 w9, refused and not a node") {
		t.Errorf("the manifest does not name the refused machine that is no node:\n%s", files["MANIFEST.txt"])
	}
	if !strings.Contains(files["MANIFEST.txt"], "Secrets of every namespace: never read") {
		t.Errorf("the manifest does not say Secrets are left out:\n%s", files["MANIFEST.txt"])
	}
	for name, data := range files {
		if strings.Contains(data, secretValue) || strings.Contains(data, "MHcCAQEEIIrYSSNQ") {
			t.Errorf("%s holds a secret value", name)
		}
	}
	if s.Redacted["private key"] != 1 || s.Redacted["secret value"] != 1 {
		t.Errorf("redacted %v, want the ConfigMap's private key and token", s.Redacted)
	}
	if in := s.RedactedIn[ns+"/configmaps.yaml"]; in["private key"] != 1 || in["secret value"] != 1 || !strings.Contains(files["MANIFEST.txt"], "  "+ns+"/configmaps.yaml: private key 1, secret value 1\n") {
		t.Errorf("the manifest does not say where the values were redacted: %v\n%s", s.RedactedIn, files["MANIFEST.txt"])
	}
	if !strings.Contains(files[ns+"/configmaps.yaml"], "[REDACTED PRIVATE KEY]") {
		t.Errorf("the ConfigMap's private key is not marked redacted")
	}
	t.Logf("bundle: %d bytes, %d files, %d problems (no kubelet serves logs here), manifest:\n%s", out.Len(), len(order), len(s.Problems), files["MANIFEST.txt"])
}

// TestCollectLogsAndProblems: each container's log is collected, with its previous instance's
// when it restarted; a list the caller may not read is a problem in the manifest, not a failure.
func TestCollectLogsAndProblems(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "berth-joinservice-x", Namespace: "berth-system"},
		Spec:   corev1.PodSpec{Containers: []corev1.Container{{Name: "joinservice"}}},
		Status: corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{{Name: "joinservice", RestartCount: 2}}}}
	kube := fake.NewClientset(pod)
	kube.PrependReactor("list", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New(`configmaps is forbidden: User "ops" cannot list resource "configmaps"`)
	})
	var out bytes.Buffer
	s, err := Collect(context.Background(), &out, Sources{Kube: kube}, Options{Namespace: "berth-system", Now: time.Unix(0, 0)})
	if err != nil {
		t.Fatal(err)
	}
	files, _ := untar(t, out.Bytes(), s.Dir)
	for _, name := range []string{"logs/berth-system/berth-joinservice-x/joinservice.log", "logs/berth-system/berth-joinservice-x/joinservice.previous.log"} {
		if _, ok := files[name]; !ok {
			t.Errorf("no %s", name)
		}
	}
	if !strings.Contains(files["MANIFEST.txt"], "ConfigMaps in berth-system: configmaps is forbidden") {
		t.Errorf("the manifest does not list the forbidden ConfigMaps:\n%s", files["MANIFEST.txt"])
	}
	if !strings.Contains(files["MANIFEST.txt"], "the record API (Machines, JoinRecords): no client") {
		t.Errorf("the manifest does not say the records are left out")
	}
	if _, err := Collect(context.Background(), nil, Sources{Kube: kube}, Options{}); !errors.Is(err, ErrNoOutput) {
		t.Errorf("Collect without a writer: %v", err)
	}
}

// TestRedact: what looks like a credential is replaced and counted; digests, names and addresses
// an operator needs stay.
func TestRedact(t *testing.T) {
	for _, tc := range []struct{ in, want, kind string }{
		{privateKey, "[REDACTED PRIVATE KEY]", "private key"},
		{"Authorization: Bearer abcdefgh12345678", "Authorization: Bearer [REDACTED]", "bearer token"},
		{"token=eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJlLXZhbHVl", "token=[REDACTED TOKEN]", "JSON web token"},
		{"kubeadm join --token abcdef.0123456789abcdef", "kubeadm join --token [REDACTED BOOTSTRAP TOKEN]", "bootstrap token"},
		{"abcdef.0123456789abcdef", "[REDACTED BOOTSTRAP TOKEN]", "bootstrap token"},
		{`"token":"abcdef.0123456789abcdef"`, `"token":"[REDACTED BOOTSTRAP TOKEN]"`, "bootstrap token"},
		{`{"password": "hunter22"}`, `{"password": "[REDACTED]"}`, "secret value"},
		{"certificate-key=0123456789abcdef0123", "certificate-key=[REDACTED]", "secret value"},
	} {
		counts := map[string]int{}
		if got := string(redact([]byte(tc.in), counts)); got != tc.want || counts[tc.kind] != 1 {
			t.Errorf("redact(%q) = %q %v, want %q and one %s", tc.in, got, counts, tc.want, tc.kind)
		}
	}
	for _, keep := range []string{
		"evidence sha256 " + strings.Repeat("ab", 32),
		"peer 198.51.100.7:43122 node w1.example.internal reason MEASUREMENT_MISMATCH",
		`{"level":"info","msg":"token budget spent","peer":"10.0.0.1"}`,
		"kekGeneration: 2",
		"name: berth-join-ledger.187b2c3d4e5f6a7b",
		"event w1ledge.187b2c3d4e5f6a7b",
	} {
		counts := map[string]int{}
		if got := string(redact([]byte(keep), counts)); got != keep || len(counts) != 0 {
			t.Errorf("redact(%q) = %q %v, want it unchanged", keep, got, counts)
		}
	}
}
