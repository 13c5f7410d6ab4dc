package initcluster

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/internal/records"
	recordsclient "github.com/berth-k8s/berth/internal/records/clientset"
	recordsv1alpha1 "github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

func TestMain(m *testing.M) { os.Exit(apiservertest.StoppingShared(m).Run()) }

func phaseNames(ps []Phase) string {
	var names []string
	for _, p := range ps {
		names = append(names, p.Name)
	}
	return strings.Join(names, " ")
}

// A restore's phases: restore-etcd after kms and before kubeadm-init, restore-cleanup after the API
// server is ready and before the components; a plain init has neither.
func TestRestorePhaseOrder(t *testing.T) {
	i, _, _, _ := setup("v1.34.2")
	if got := phaseNames(i.Phases(false)); strings.Contains(got, "restore") {
		t.Errorf("init phases = %s", got)
	}
	want := "preflight kubeadm-config certs kms restore-etcd kubeadm-init wait-apiserver restore-cleanup components admin-kubeconfig"
	if got := phaseNames(i.Phases(true)); got != want {
		t.Errorf("restore phases = %s, want %s", got, want)
	}
}

// TestRestoreOnRealEtcd takes a sealed snapshot of a real etcd holding a canary, runs a restore's
// kms, restore-etcd and kubeadm-init phases on it, and starts a real etcd on the directory
// restore-etcd wrote, as kubeadm's static pod would: the canary is there, the member is the node,
// the KMS plugin got the snapshot's generations, kubeadm init passes over its etcd directory check
// (and only for a restore), and a kubeadm-init that must reset restores etcd again.
func TestRestoreOnRealEtcd(t *testing.T) {
	env := apiservertest.Shared(t)
	etcdBin, err := apiservertest.EtcdBinary()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	const canaryKey, canary = "/berth-test/initcluster-restore", "restore-canary-7d41"
	if _, err := src.Put(ctx, canaryKey, canary); err != nil {
		t.Fatal(err)
	}
	keys, err := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	taken, err := backup.Take(ctx, src, keys, backup.KMSKeysOf(keys, []uint32{1, 2}, 2), t.TempDir(), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(taken.Path)
	if err != nil {
		t.Fatal(err)
	}
	man, _, err := backup.Open(f, keys)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}

	i, rec, _, _ := setup("v1.34.2")
	etcdDir := filepath.Join(t.TempDir(), "var-lib-etcd")
	i.cfg.EtcdDir = etcdDir
	k := &kmsRecorder{}
	i.WithKMS(k, kubeadm.Encryption{ConfigFile: "/etc/kubernetes/berth/encryption-config.yaml", SocketDir: "/run/berth/kms"})
	job := newJob(t, i)
	job.Req.Keys = keys
	job.Req.Restore = &Restore{Snapshot: taken.Path, Manifest: man}
	byName := map[string]Phase{}
	for _, p := range i.Phases(true) {
		byName[p.Name] = p
	}
	// A member directory left by an interrupted attempt is replaced, not reused.
	if err := os.MkdirAll(filepath.Join(etcdDir, "member", "junk"), 0o700); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{PhaseKubeadmConfig, PhaseKMS, PhaseRestoreEtcd, PhaseKubeadmInit} {
		if err := byName[name].Run(ctx, job); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	want := kmsplugin.KeySet{Active: 2, Keys: []kmsplugin.Key{{Generation: 1, KEK: keys.KMSKey(1)}, {Generation: 2, KEK: keys.KMSKey(2)}}}
	if len(k.sets) != 1 || !k.sets[0].Equal(want) {
		t.Errorf("the KMS plugin got %v, want the snapshot's generations 1 and 2, 2 active", k.sets)
	}
	if _, err := os.Stat(filepath.Join(etcdDir, "member", "junk")); !os.IsNotExist(err) {
		t.Errorf("the earlier attempt's member directory survived: %v", err)
	}
	if entries, _ := os.ReadDir(etcdDir); len(entries) != 1 || entries[0].Name() != "member" {
		t.Errorf("%s holds %v, want only member", etcdDir, entries)
	}
	init := rec.Calls()[len(rec.Calls())-1]
	if !strings.HasPrefix(init, "kubeadm init ") || !strings.Contains(init, "--ignore-preflight-errors="+kubeadm.EtcdDataCheck) {
		t.Errorf("kubeadm init of a restore = %q, want it to pass over %s", init, kubeadm.EtcdDataCheck)
	}

	// kubeadm reset empties etcd's directory; the next kubeadm-init restores it again.
	if err := os.RemoveAll(filepath.Join(etcdDir, "member")); err != nil {
		t.Fatal(err)
	}
	if err := byName[PhaseKubeadmInit].Run(ctx, job); err != nil {
		t.Fatal(err)
	}
	calls := strings.Join(rec.Calls(), "\n")
	if !strings.Contains(calls, "kubeadm reset") {
		t.Fatalf("the second kubeadm-init did not reset:\n%s", calls)
	}

	peer := "http://" + proctest.FreeAddr(t)
	clientURL := "http://" + proctest.FreeAddr(t)
	p := proctest.Start(t, proctest.Cmd{Name: "restored-etcd", Path: etcdBin, Args: []string{
		"--name", "cp-0", "--data-dir", etcdDir,
		"--listen-client-urls", clientURL, "--advertise-client-urls", clientURL,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", "https://198.51.100.10:2380",
		"--initial-cluster", "cp-0=https://198.51.100.10:2380", "--initial-cluster-state", "new",
	}})
	restored, err := clientv3.New(clientv3.Config{Endpoints: []string{clientURL}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer restored.Close()
	var got *clientv3.GetResponse
	if err := proctest.WaitReady(ctx, 100*time.Millisecond, time.Minute, func(ctx context.Context) error {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		got, err = restored.Get(c, canaryKey)
		return err
	}, p); err != nil {
		t.Fatal(err)
	}
	if len(got.Kvs) != 1 || string(got.Kvs[0].Value) != canary {
		t.Fatalf("the restored etcd holds %d values for the canary", len(got.Kvs))
	}
	members, err := restored.MemberList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(members.Members) != 1 || members.Members[0].Name != "cp-0" || !slices.Equal(members.Members[0].PeerURLs, []string{"https://198.51.100.10:2380"}) {
		t.Errorf("members = %v, want only cp-0 at https://198.51.100.10:2380", members.Members)
	}

	plain, prec, _, _ := setup("v1.34.2")
	pjob := newJob(t, plain)
	pjob.Req.Keys = keys
	if err := plain.Phases(false)[4].Run(ctx, pjob); err != nil { // kubeadm-init
		t.Fatal(err)
	}
	if calls := strings.Join(prec.Calls(), "\n"); strings.Contains(calls, kubeadm.EtcdDataCheck) {
		t.Errorf("a plain init passes over the etcd directory check:\n%s", calls)
	}
}

// restore-etcd refuses a snapshot that does not open with the request's master secret, and leaves
// no member behind.
func TestRestoreEtcdWrongSecret(t *testing.T) {
	keys, _ := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	other, _ := clusterkeys.New(bytes.Repeat([]byte{9}, 32), bytes.Repeat([]byte{2}, 32))
	var buf bytes.Buffer
	if _, err := backup.Seal(&buf, other, backup.Manifest{KMS: backup.KMSKeysOf(other, []uint32{1}, 1)}, strings.NewReader("etcd")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "snap")
	if err := os.WriteFile(path, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	i, _, _, _ := setup("v1.34.2")
	i.cfg.EtcdDir = filepath.Join(t.TempDir(), "etcd")
	job := newJob(t, i)
	job.Req.Keys = keys
	job.Req.Restore = &Restore{Snapshot: path}
	if err := i.restoreEtcd(context.Background(), job); !errors.Is(err, backup.ErrWrongSecret) {
		t.Fatalf("restore-etcd with another cluster's snapshot = %v, want ErrWrongSecret", err)
	}
	if entries, _ := os.ReadDir(i.cfg.EtcdDir); len(entries) != 0 {
		t.Errorf("a refused restore left %v", entries)
	}
}

// restore-cleanup on a real API server deletes every Node but this one, every pod bound to a node
// (this one's too) but mirror pods, the admitted machines of the machine record and their Machines
// (a Machine the record no longer holds too), and the image-policy webhook's configuration; a
// removed machine stays in the record, refused, with its Machine and its node name revoked.
func TestRestoreCleanupRealAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := env.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	client := env.Client(t, apiservertest.AdminUser)
	rc, err := recordsclient.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"cp-0", "old-cp-1", "old-worker-0"} {
		if _, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// The old cluster's record: two admitted machines and one an operator removed (stolen, say).
	id := func(c string) string { return strings.Repeat(c, 64) }
	admitted := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	old := []machines.Machine{
		{Identity: id("a"), Node: "old-cp-1", Role: machines.RoleControlPlane, Admitted: admitted},
		{Identity: id("b"), Node: "old-worker-0", Role: machines.RoleWorker, Admitted: admitted},
		{Identity: id("c"), Node: "old-worker-1", Role: machines.RoleWorker, Admitted: admitted, Removal: &machines.Removal{Time: admitted}},
	}
	if _, err := machines.Update(ctx, client, joinconfig.Namespace, func([]machines.Machine) ([]machines.Machine, error) { return old, nil }); err != nil {
		t.Fatal(err)
	}
	for _, m := range append(old, machines.Machine{Identity: id("d"), Node: "old-worker-2", Role: machines.RoleWorker}) {
		mc := &recordsv1alpha1.Machine{ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(m.Identity)},
			Spec:   recordsv1alpha1.MachineSpec{Identity: m.Identity, Node: m.Node, Role: m.Role},
			Status: recordsv1alpha1.MachineStatus{State: recordsv1alpha1.StateAdmitted, Admitted: metav1.NewTime(admitted)}}
		if m.Revoked() {
			removed := metav1.NewTime(admitted)
			mc.Status.State, mc.Status.Removed = recordsv1alpha1.StateRemoved, &removed
		}
		if _, err := rc.RecordsV1alpha1().Machines(joinconfig.Namespace).Create(ctx, mc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	podNS := "restore-cleanup"
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: podNS}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, _ = client.CoreV1().ServiceAccounts(podNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	no := false
	for name, node := range map[string]string{"on-self": "cp-0", "on-old": "old-worker-0", "unbound": "", "mirror": "cp-0"} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.PodSpec{NodeName: node, AutomountServiceAccountToken: &no,
			Containers: []corev1.Container{{Name: "c", Image: "registry.example/c:1"}}}}
		if name == "mirror" {
			pod.Annotations = map[string]string{mirrorPodAnnotation: "hash"}
		}
		if _, err := client.CoreV1().Pods(podNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	none := admissionv1.SideEffectClassNone
	if _, err := client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, &admissionv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.ConfigName},
		Webhooks: []admissionv1.ValidatingWebhook{{Name: "old.berth.example", SideEffects: &none, AdmissionReviewVersions: []string{"v1"},
			ClientConfig: admissionv1.WebhookClientConfig{Service: &admissionv1.ServiceReference{Namespace: joinconfig.Namespace, Name: "berth-webhook"}}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.AdminUser)
	if err != nil {
		t.Fatal(err)
	}
	i, _, _, _ := setup("v1.34.2")
	c, err := i.cleaner.Clean(ctx, kubeconfig, "cp-0")
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(c.Nodes)
	if !slices.Equal(c.Nodes, []string{"old-cp-1", "old-worker-0"}) || c.Pods != 2 || c.Machines != 3 || c.KeptRemoved != 1 {
		t.Errorf("cleanup = %+v, want Nodes old-cp-1 old-worker-0, 2 pods, 3 machines, 1 removed kept", c)
	}
	nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes.Items) != 1 || nodes.Items[0].Name != "cp-0" {
		t.Errorf("Nodes left: %d, want only cp-0", len(nodes.Items))
	}
	record, err := machines.Read(ctx, client, joinconfig.Namespace)
	if err != nil {
		t.Fatal(err)
	}
	if len(record) != 1 || record[0].Identity != id("c") || !record[0].Revoked() {
		t.Errorf("the machine record after the cleanup: %+v, want only the removed machine", record)
	}
	cm, err := client.CoreV1().ConfigMaps(joinconfig.Namespace).Get(ctx, joinconfig.MachinesName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data[machines.RevokedNodesKey]; got != "old-worker-1" {
		t.Errorf("revoked node names after the cleanup: %q, want old-worker-1", got)
	}
	left, err := rc.RecordsV1alpha1().Machines(joinconfig.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(left.Items) != 1 || left.Items[0].Spec.Identity != id("c") {
		var names []string
		for _, m := range left.Items {
			names = append(names, m.Spec.Node)
		}
		t.Errorf("Machines after the cleanup: %v, want only the removed machine's (old-worker-1)", names)
	}
	if _, err := client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the old image-policy webhook configuration after the cleanup: %v, want NotFound", err)
	}
	pods, err := client.CoreV1().Pods(podNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var podsLeft []string
	for _, p := range pods.Items {
		podsLeft = append(podsLeft, p.Name)
	}
	slices.Sort(podsLeft)
	if !slices.Equal(podsLeft, []string{"mirror", "unbound"}) {
		t.Errorf("pods left: %v, want the mirror pod and the unbound one", podsLeft)
	}
	// A second run (a resumed restore) finds nothing left to delete and keeps the removed machine.
	if c, err := i.cleaner.Clean(ctx, kubeconfig, "cp-0"); err != nil || len(c.Nodes) != 0 || c.Pods != 0 || c.Machines != 0 || c.KeptRemoved != 1 {
		t.Errorf("second Clean = %+v, %v", c, err)
	}
}
