package initcluster

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/command/commandtest"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/metadata"
)

type meta struct{}

func (meta) Self(context.Context) (metadata.Instance, error) {
	return metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}, nil
}
func (meta) ControlPlaneEndpoint(context.Context) (string, error) { return "", metadata.ErrNotFound }

// recKubelet records its starts and stops among kubeadm's commands.
type recKubelet struct {
	rec    *commandtest.Recorder
	starts int
}

func (k *recKubelet) Start(ctx context.Context) error {
	k.starts++
	return k.rec.Run(ctx, io.Discard, "kubelet", "start")
}

func (k *recKubelet) Stop(ctx context.Context) error {
	return k.rec.Run(ctx, io.Discard, "kubelet", "stop")
}

type readyWaiter struct{}

func (readyWaiter) WaitReady(context.Context, string) error { return nil }

type nopComponents struct{}

func (nopComponents) Install(context.Context, string, *Job) error { return nil }

func setup(version string) (*Initializer, *commandtest.Recorder, afero.Fs, *recKubelet) {
	fsys := afero.NewMemMapFs()
	_ = afero.WriteFile(fsys, "/run/cri.sock", nil, 0o600)
	rec := &commandtest.Recorder{Script: map[string][]commandtest.Result{"kubeadm version": {{Output: version + "\n"}}}}
	k := &recKubelet{rec: rec}
	i := New(Config{StateDir: "/state", CRISocket: "unix:///run/cri.sock", CgroupDriver: "cgroupfs"}, fsys, meta{},
		&kubeadm.Runner{Path: "kubeadm", Exec: rec}, k, readyWaiter{}, nopComponents{})
	return i, rec, fsys, k
}

func newJob(t *testing.T, i *Initializer) *Job {
	job := &Job{Req: Request{ClusterName: "berth", KubernetesVersion: "v1.34.2", ServiceCIDR: "10.96.0.0/12", PodCIDR: "10.244.0.0/16"}, Out: &bytes.Buffer{}}
	if err := i.Prepare(context.Background(), job); err != nil {
		t.Fatal(err)
	}
	return job
}

func TestPreflightChecksKubeadmVersion(t *testing.T) {
	i, _, _, _ := setup("v1.33.6")
	job := newJob(t, i)
	err := i.Phases(false)[0].Run(context.Background(), job)
	if err == nil || !strings.Contains(err.Error(), "v1.33.6") {
		t.Fatalf("preflight = %v, want a version mismatch naming v1.33.6", err)
	}
}

func TestPhasesAndRetryOfKubeadmInit(t *testing.T) {
	i, rec, fsys, k := setup("v1.34.2")
	job := newJob(t, i)
	if job.ControlPlaneEndpoint != "198.51.100.10:6443" {
		t.Fatalf("endpoint = %q, want the node's IP on 6443 when metadata publishes none", job.ControlPlaneEndpoint)
	}
	ctx := context.Background()
	byName := map[string]Phase{}
	for _, p := range i.Phases(false) {
		byName[p.Name] = p
	}
	for _, name := range []string{PhasePreflight, PhaseKubeadmConfig, PhaseCerts, PhaseKubeadmInit, PhaseKubeadmInit} {
		if err := byName[name].Run(ctx, job); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	cfg, err := afero.ReadFile(fsys, "/state/kubeadm-init.yaml")
	if err != nil || !strings.Contains(string(cfg), "advertiseAddress: 198.51.100.10") {
		t.Fatalf("kubeadm config = %s, %v", cfg, err)
	}
	// The API server gets the admission configuration that exempts the joinservice's RuntimeClass.
	admission, err := afero.ReadFile(fsys, "/etc/kubernetes/berth/admission.yaml")
	if err != nil || !strings.Contains(string(admission), "berth-host") {
		t.Fatalf("admission configuration = %s, %v", admission, err)
	}
	if !strings.Contains(string(cfg), "value: /etc/kubernetes/berth/admission.yaml") {
		t.Fatalf("kubeadm config does not point the API server at the admission configuration:\n%s", cfg)
	}
	want := strings.Join([]string{
		"kubeadm version -o short",
		"kubeadm init phase certs all --config /state/kubeadm-init.yaml",
		"kubelet start",
		"kubeadm init --config /state/kubeadm-init.yaml --skip-token-print --skip-phases=certs",
		// The retry: the kubelet is stopped before the reset and started after it.
		"kubelet stop",
		"kubeadm reset --force --cri-socket unix:///run/cri.sock",
		"kubeadm init phase certs all --config /state/kubeadm-init.yaml",
		"kubelet start",
		"kubeadm init --config /state/kubeadm-init.yaml --skip-token-print --skip-phases=certs",
	}, "\n")
	if got := rec.String(); got != want {
		t.Fatalf("calls:\n%s\nwant:\n%s", got, want)
	}
	if k.starts != 2 {
		t.Fatalf("kubelet started %d times, want once per kubeadm-init attempt", k.starts)
	}
	_ = afero.WriteFile(fsys, "/etc/kubernetes/admin.conf", []byte("kind: Config\n"), 0o600)
	if err := byName[PhaseAdminKubeconfig].Run(ctx, job); err != nil || string(job.Kubeconfig) != "kind: Config\n" {
		t.Fatalf("admin-kubeconfig: %v, %q", err, job.Kubeconfig)
	}
}

func TestPreflightNeedsCRISocket(t *testing.T) {
	i, _, fsys, _ := setup("v1.34.2")
	_ = fsys.Remove("/run/cri.sock")
	if err := i.Phases(false)[0].Run(context.Background(), newJob(t, i)); err == nil || !strings.Contains(err.Error(), "cri.sock") {
		t.Fatalf("preflight = %v, want an error naming the socket", err)
	}
}

type workerMeta struct{ meta }

func (workerMeta) Self(context.Context) (metadata.Instance, error) {
	return metadata.Instance{Name: "w-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.11"}}, nil
}

// TestPrepareRefusesAWorker: a node that metadata calls a worker is refused with the named error
// (the InitServer checks it before it takes the node lock).
func TestPrepareRefusesAWorker(t *testing.T) {
	i := New(Config{StateDir: "/state"}, afero.NewMemMapFs(), workerMeta{}, nil, nil, nil, nil)
	err := i.Prepare(context.Background(), &Job{})
	if !errors.Is(err, ErrNotControlPlane) || !strings.Contains(err.Error(), "worker") {
		t.Fatalf("Prepare() on a worker = %v, want ErrNotControlPlane naming its role", err)
	}
}

type kmsRecorder struct {
	sets []kmsplugin.KeySet
	err  error
}

func (k *kmsRecorder) Install(_ context.Context, set kmsplugin.KeySet) error {
	k.sets = append(k.sets, set)
	return k.err
}

// With KMS, the kubeadm configuration makes the API server encrypt through the plugin, and the kms
// phase, after certs and before kubeadm init, installs generation 1 derived from the request's master
// secret; a re-run installs the same key. Without KMS neither happens.
func TestKMSPhase(t *testing.T) {
	i, _, fsys, _ := setup("v1.34.2")
	k := &kmsRecorder{}
	i.WithKMS(k, kubeadm.Encryption{ConfigFile: "/etc/kubernetes/berth/encryption-config.yaml", SocketDir: "/run/berth/kms"})
	var names []string
	for _, p := range i.Phases(false) {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, " "); !strings.Contains(got, PhaseCerts+" "+PhaseKMS+" "+PhaseKubeadmInit) {
		t.Fatalf("phases = %s, want kms between certs and kubeadm-init", got)
	}
	job := newJob(t, i)
	keys, err := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	job.Req.Keys = keys
	byName := map[string]Phase{}
	for _, p := range i.Phases(false) {
		byName[p.Name] = p
	}
	ctx := context.Background()
	for _, name := range []string{PhaseKubeadmConfig, PhaseKMS, PhaseKMS} {
		if err := byName[name].Run(ctx, job); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	cfg, _ := afero.ReadFile(fsys, "/state/kubeadm-init.yaml")
	if !strings.Contains(string(cfg), "encryption-provider-config") || !strings.Contains(string(cfg), "/run/berth/kms") {
		t.Errorf("kubeadm config does not encrypt:\n%s", cfg)
	}
	want := kmsplugin.KeySet{Active: 1, Keys: []kmsplugin.Key{{Generation: 1, KEK: keys.KMSKey(1)}}}
	if len(k.sets) != 2 || !k.sets[0].Equal(want) || !k.sets[1].Equal(want) {
		t.Fatalf("installed %v, want generation 1 of the master secret twice", k.sets)
	}
	k.err = errors.New("disk full")
	if err := byName[PhaseKMS].Run(ctx, job); err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Errorf("kms phase with a failing install = %v", err)
	}

	plain, _, pfs, _ := setup("v1.34.2")
	pjob := newJob(t, plain)
	pjob.Req.Keys = keys
	for _, p := range plain.Phases(false) {
		if p.Name == PhaseKubeadmConfig || p.Name == PhaseKMS {
			if err := p.Run(ctx, pjob); err != nil {
				t.Fatal(err)
			}
		}
	}
	if cfg, _ := afero.ReadFile(pfs, "/state/kubeadm-init.yaml"); strings.Contains(string(cfg), "encryption-provider-config") {
		t.Error("without KMS the kubeadm config encrypts")
	}
}
