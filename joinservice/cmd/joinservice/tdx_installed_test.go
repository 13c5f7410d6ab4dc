package main

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// podRun is the joinservice container of an installer-built DaemonSet, laid out to run as a process: the
// container's file system is a directory whose mount points are links to the host paths of their volumes,
// and every absolute path in the container's arguments and environment is taken below that directory.
type podRun struct {
	args []string
	env  []string
}

// runFromDaemonSet lays out the container of ds below containerRoot, with the host's files below hostRoot,
// and returns its arguments and environment. fieldEnv gives the values of environment variables the pod
// takes from its own fields (node name, host address); listen replaces the container's listen addresses
// (the pod shares the host's network with every other test).
func runFromDaemonSet(t *testing.T, ds *appsv1.DaemonSet, hostRoot, containerRoot string, fieldEnv, listen map[string]string) podRun {
	t.Helper()
	pod := ds.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("the joinservice's pod has %d containers", len(pod.Containers))
	}
	c := pod.Containers[0]
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	for _, m := range c.VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok || v.HostPath == nil {
			t.Fatalf("mount %s of volume %+v: only host paths are laid out", m.MountPath, v)
		}
		host := filepath.Join(hostRoot, v.HostPath.Path)
		if v.HostPath.Type != nil && *v.HostPath.Type == corev1.HostPathDirectoryOrCreate {
			if err := os.MkdirAll(host, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := os.Stat(host); err != nil {
			t.Fatalf("volume %s: the host has no %s: %v", m.Name, v.HostPath.Path, err)
		}
		at := filepath.Join(containerRoot, m.MountPath)
		if err := os.MkdirAll(filepath.Dir(at), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(host, at); err != nil {
			t.Fatal(err)
		}
	}
	inContainer := func(v string) string {
		if strings.HasPrefix(v, "/") {
			return filepath.Join(containerRoot, v)
		}
		return v
	}
	var run podRun
	values := map[string]string{}
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom != nil {
			var ok bool
			if v, ok = fieldEnv[e.ValueFrom.FieldRef.FieldPath]; !ok {
				t.Fatalf("environment variable %s from field %s: no value for it", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		}
		values[e.Name] = v
		run.env = append(run.env, e.Name+"="+inContainer(v))
	}
	for _, a := range c.Args {
		name, value, ok := strings.Cut(a, "=")
		if !ok {
			run.args = append(run.args, a)
			continue
		}
		if addr, ok := listen[name]; ok {
			value = addr
		}
		// $(VAR) takes the container's environment, as the kubelet expands it.
		value = regexp.MustCompile(`\$\(([A-Z_]+)\)`).ReplaceAllStringFunc(value, func(ref string) string { return values[ref[2:len(ref)-1]] })
		run.args = append(run.args, name+"="+inContainer(value))
	}
	return run
}

// TestAttestedBinaryTDXFromInstaller runs the real joinservice binary as the installer's objects configure it
// on a TDX control plane: berthsystem.Objects builds berth-system for a node whose environment names a TPM as
// the OS image's does, and the test runs the DaemonSet's container, its arguments, environment and host-path
// volumes as they are, in a directory standing for the container's file system (see runFromDaemonSet). Only
// what a cluster gives a pod and a test cannot is added: the API server's address and credentials, the
// node's metadata, free listen addresses. The software TD serves configfs-tsm on the host's configfs; the
// joinservice finds it through the DaemonSet's mount and BERTH_TDX_ROOT. A node of the same platform whose
// measurements match joins; one whose RTMR2 differs is refused, and the ledger names index 3 (RTMR2). The
// joinservice's own quote generation time, a phase of every handshake, is read from its log and reported.
func TestAttestedBinaryTDXFromInstaller(t *testing.T) {
	// An API server of its own: the tests of this package share one join ledger on the shared one, and
	// TestAttestedBinaryTDX reads the entries of the same peer address.
	env := apiservertest.Start(t) // skips without kube-apiserver and etcd
	ctx := context.Background()
	started := time.Now().Add(-time.Second)

	mrtd := [tdx.MeasurementSize]byte{0x4d, 0x52, 0x54, 0x44, 0x02}
	platform, service, pol := tdxControlPlane(t, mrtd)
	clusterPolicy := pol.cluster(pol.bundle)

	// berth-system as init builds it on this control plane.
	objs, err := berthsystem.Objects(berthsystem.Config{
		JoinServiceImage: "berth.local/joinservice:dev",
		JoinServiceEnv: map[string]string{
			joinconfig.EnvAttestation: "tdx", joinconfig.EnvTPM: "/dev/tpmrm0", joinconfig.EnvMetadata: "static",
		},
		JoinServiceHostPaths: berthsystem.TPMHostPaths("/dev/tpmrm0"),
	}, berthsystem.Cluster{Join: joinconfig.Config{AttestationPolicy: []byte(clusterPolicy), KubernetesVersion: "v1.34.2"}})
	if err != nil {
		t.Fatalf("building berth-system for a TDX control plane: %v", err)
	}
	var ds appsv1.DaemonSet
	for _, o := range objs {
		if o.GetKind() == "DaemonSet" && o.GetName() == joinconfig.JoinServiceName {
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &ds); err != nil {
				t.Fatal(err)
			}
		}
	}
	if ds.Name == "" {
		t.Fatal("no joinservice DaemonSet among berth-system's objects")
	}
	if err := env.InstallBerth(ctx, clusterPolicy); err != nil {
		t.Fatal(err)
	}

	// The host: its configfs, where the software TD serves configfs-tsm, and the kubeadm PKI.
	hostRoot, containerRoot := t.TempDir(), t.TempDir()
	tdxtest.ServeTSM(t, service, hostRoot) // skips without FUSE; unmounted after the joinservice stops
	pki := filepath.Join(hostRoot, "etc/kubernetes/pki")
	if err := os.MkdirAll(filepath.Dir(pki), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(catest.WriteControlPlaneDir(t), pki); err != nil {
		t.Fatal(err)
	}
	addr := proctest.FreeAddr(t)
	run := runFromDaemonSet(t, &ds, hostRoot, containerRoot,
		map[string]string{"spec.nodeName": "cp-0", "status.hostIP": "127.0.0.1"},
		map[string]string{"--listen": addr, "--metrics-listen": proctest.FreeAddr(t)})
	for _, e := range run.env {
		if strings.HasPrefix(e, joinconfig.EnvTPM+"=") {
			t.Fatalf("the TDX control plane's joinservice gets %s", e)
		}
	}
	t.Logf("joinservice %s\n  environment %s", strings.Join(run.args, " "), strings.Join(run.env, " "))

	dir := t.TempDir()
	metaFile := filepath.Join(dir, "metadata.yaml")
	if err := os.WriteFile(metaFile, []byte("self: {name: cp-0, role: control-plane, ips: [198.51.100.10]}\npeers:\n  - {name: worker-9, role: worker, ips: [127.0.0.1]}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.JoinServiceUser)
	if err != nil {
		t.Fatal(err)
	}
	logFile := filepath.Join(dir, "joinservice.log")
	js := proctest.Start(t, proctest.Cmd{
		Name: "joinservice", Path: proctest.Build(t, "."), Grace: stopGrace, LogFile: logFile,
		Env:  append(run.env, joinconfig.EnvLogLevel+"=debug", joinconfig.EnvLogFormat+"=json"),
		Args: append(run.args, "--kubeconfig="+kubeconfig, "--metadata-file="+metaFile, "--replica=cp-0"),
	})

	joinPolicy, err := policy.Parse([]byte(pol.join(pol.bundle)), "join policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	checkTDXJoins(ctx, t, js, addr, joinPolicy, platform, "5d0c3e5a-8f7b-4c2d-9e1a-6b3f2a7c9d11")

	admin := env.Client(t, apiservertest.AdminUser)
	var mine []ledger.Entry
	_ = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		entries, _ := joinledger.Read(ctx, admin, joinconfig.Namespace)
		mine = mine[:0]
		for _, e := range entries {
			if e.Peer == "127.0.0.1" && e.RPC == "join" && e.Time.After(started) {
				mine = append(mine, e)
			}
		}
		return len(mine) >= 2, nil
	})
	for _, e := range mine {
		t.Logf("ledger: %s %s %s %s %q", e.RPC, e.Outcome, e.Node, e.Reason, e.Message)
	}
	if len(mine) < 2 {
		t.Fatalf("%d join entries in the ledger, want the genuine node's and the tampered one's", len(mine))
	}
	if e := mine[0]; e.Reason != "" || e.Node != "worker-9" {
		t.Errorf("first entry %+v, want the genuine node's join", e)
	}
	if e := mine[1]; e.Reason != "MEASUREMENT_MISMATCH" || !strings.Contains(e.Message, "index 3: expected "+zeroMeasurement) {
		t.Errorf("second entry %+v, want the tampered node refused for index 3 (RTMR2)", e)
	}

	// The joinservice quoted through the DaemonSet's configfs-tsm mount once per handshake.
	quotes := quoteDurations(t, logFile)
	if len(quotes) == 0 {
		t.Fatal("the joinservice logged no TDX quote generation")
	}
	t.Logf("joinservice TDX quote generation through configfs-tsm (software TD over FUSE): %d quotes, %v", len(quotes), quotes)
}

// quoteDurations returns the quote generation times the joinservice logged (the tdx Issuer's debug record).
func quoteDurations(t *testing.T, logFile string) []time.Duration {
	t.Helper()
	f, err := os.Open(logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []time.Duration
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		var rec struct {
			Msg           string  `json:"msg"`
			QuoteDuration float64 `json:"quoteDuration"`
		}
		if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == "TDX quote generated" {
			out = append(out, time.Duration(rec.QuoteDuration*float64(time.Second)))
		}
	}
	return out
}
