package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// TestBinaryAttestedInit runs init over attested TLS with the node's TPM being a real swtpm whose
// EK certificate comes from a local CA: a node that does not match the policy gets nothing, one that
// matches is initialized and extends its lock PCR, after which it no longer attests as fresh.
func TestBinaryAttestedInit(t *testing.T) {
	ca := vtpmtest.NewSwtpmCA(t) // skips when swtpm's tools are missing
	tpm := vtpmtest.StartSwtpm(t, ca)
	api := newAPIServer(t)
	secret := randomHex(t)
	n := startNode(t, api, secret, false, "--attestation=tpm", "--tpm="+tpm.Spec, "--lock-pcr=15")

	cfgDir := t.TempDir()
	write(t, filepath.Join(cfgDir, "ek-ca.pem"), string(ca.RootPEM(t))+string(ca.IssuerPEM(t)), 0o600)
	zero := strings.Repeat("00", 32)
	write(t, filepath.Join(cfgDir, "fresh.yaml"), "variant: tpm\nmeasurements:\n  15: {expected: "+zero+", source: lock PCR of a fresh node}\ntrustRoots:\n  - file: ek-ca.pem\n", 0o600)
	write(t, filepath.Join(cfgDir, "other-image.yaml"), "variant: tpm\nmeasurements:\n  4: {expected: "+strings.Repeat("ab", 32)+", source: another image}\n  15: {expected: "+zero+"}\ntrustRoots:\n  - file: ek-ca.pem\n", 0o600)
	write(t, filepath.Join(cfgDir, "init-secret"), secret, 0o600)
	for _, name := range []string{"fresh", "other-image"} {
		write(t, filepath.Join(cfgDir, name+"-cluster.yaml"), "initSecretFile: init-secret\nattestationPolicyFile: "+name+".yaml\n", 0o600)
	}

	// A node that does not run what the policy expects is told nothing.
	r := berthInit(t, n.addr, filepath.Join(cfgDir, "other-image-cluster.yaml"), filepath.Join(t.TempDir(), "ws"), "--connect-timeout=20s")
	if r.code != 3 || !strings.Contains(r.output, "failed attestation") || !strings.Contains(r.output, "4") {
		t.Fatalf("berth init against a mismatching node: exit %d\n%s", r.code, r.output)
	}
	if strings.Contains(n.out.String(), "init request accepted") {
		t.Fatal("the init request reached a node that failed attestation")
	}
	if strings.Contains(r.output, "master secret") {
		t.Fatal("a master secret was generated for a node that failed attestation")
	}

	t.Logf("mismatching node:\n%s", r.output)

	// The genuine node is initialized over attested TLS.
	ws := filepath.Join(t.TempDir(), "ws")
	r = berthInit(t, n.addr, filepath.Join(cfgDir, "fresh-cluster.yaml"), ws, "--connect-timeout=20s")
	if r.code != 0 || !strings.Contains(r.output, "Node attested (tpm)") || !strings.Contains(r.output, "Cluster initialized") {
		t.Fatalf("attested berth init: exit %d\n%s", r.code, r.output)
	}
	if _, err := os.Stat(filepath.Join(ws, "admin.conf")); err != nil {
		t.Fatal(err)
	}

	// Its lock PCR now holds the cluster ID: it cannot pass as a fresh node any more.
	r = berthInit(t, n.addr, filepath.Join(cfgDir, "fresh-cluster.yaml"), filepath.Join(t.TempDir(), "ws3"), "--connect-timeout=20s")
	if r.code != 3 || !strings.Contains(r.output, "15") {
		t.Fatalf("berth init against a bootstrapped node: exit %d\n%s", r.code, r.output)
	}
	t.Logf("bootstrapped node:\n%s", r.output)
	n.stop(t)
}

// TestBinaryAttestedInitResumesAfterCrash kills the daemon with SIGKILL while kubeadm init runs:
// kubeadm and the kubelet die with it (Pdeathsig), kubeadm's own background child (which Pdeathsig
// does not reach) is killed by the restarted daemon from its child record, and the same berth init
// command resumes on the node although its lock PCR now holds the cluster ID: the workspace's
// unfinished attempt says which cluster to expect. A berth init with a fresh workspace is refused
// on PCR 15, as before.
func TestBinaryAttestedInitResumesAfterCrash(t *testing.T) {
	ca := vtpmtest.NewSwtpmCA(t)
	tpm := vtpmtest.StartSwtpm(t, ca)
	api := newAPIServer(t)
	secret := randomHex(t)
	n := startNode(t, api, secret, false, "--attestation=tpm", "--tpm="+tpm.Spec, "--lock-pcr=15")
	write(t, filepath.Join(n.dir, "hang-once"), "", 0o600)

	cfgDir := t.TempDir()
	write(t, filepath.Join(cfgDir, "ek-ca.pem"), string(ca.RootPEM(t))+string(ca.IssuerPEM(t)), 0o600)
	write(t, filepath.Join(cfgDir, "fresh.yaml"), "variant: tpm\nmeasurements:\n  15: {expected: "+strings.Repeat("00", 32)+", source: lock PCR of a fresh node}\ntrustRoots:\n  - file: ek-ca.pem\n", 0o600)
	write(t, filepath.Join(cfgDir, "init-secret"), secret, 0o600)
	config := filepath.Join(cfgDir, "cluster.yaml")
	write(t, config, "initSecretFile: init-secret\nattestationPolicyFile: fresh.yaml\n", 0o600)
	ws := filepath.Join(t.TempDir(), "ws")

	first := make(chan result, 1)
	go func() { first <- berthInitAsync(n.addr, config, ws) }()
	kubeadmPID := readPIDFile(t, filepath.Join(n.dir, "kubeadm.pid"))
	childPID := readPIDFile(t, filepath.Join(n.dir, "kubeadm-child.pid"))
	kubeletPID := readPIDFile(t, filepath.Join(n.dir, "kubelet.pid"))
	t.Cleanup(func() {
		for _, pid := range []int{kubeadmPID, childPID, kubeletPID} {
			if !gone(pid) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})

	// The crash.
	if err := n.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-n.done
	n.done <- nil
	for name, pid := range map[string]int{"kubeadm": kubeadmPID, "kubelet": kubeletPID} {
		waitGone(t, name, pid)
	}
	if gone(childPID) {
		t.Fatal("kubeadm's background child died with the daemon: the test no longer shows the restart's cleanup")
	}
	r := <-first
	t.Logf("berth init interrupted by the crash (exit %d):\n%s", r.code, r.output)
	if r.code != 1 || !strings.Contains(r.output, "run the same command again to resume") {
		t.Fatalf("interrupted berth init: exit %d\n%s", r.code, r.output)
	}

	// The restart kills what the dead daemon left.
	n.start(t)
	waitGone(t, "kubeadm's background child", childPID)
	if !strings.Contains(n.out.String(), "killed a process a previous daemon left behind") {
		t.Errorf("the restarted daemon does not log what it killed:\n%s", n.out.String())
	}

	// Without the workspace's attempt the node is no longer fresh (the failure).
	r = berthInit(t, n.addr, config, filepath.Join(t.TempDir(), "ws-other"), "--connect-timeout=20s")
	if r.code != 3 || !strings.Contains(r.output, "index 15") {
		t.Fatalf("berth init with another workspace: exit %d\n%s", r.code, r.output)
	}

	// The same command resumes.
	r = berthInit(t, n.addr, config, ws, "--connect-timeout=20s")
	t.Logf("berth init, the same command again (exit %d):\n%s", r.code, r.output)
	if r.code != 0 || !strings.Contains(r.output, "Resuming the unfinished init in "+ws) ||
		!strings.Contains(r.output, "Node attested (tpm)") || !strings.Contains(r.output, "Cluster initialized") {
		t.Fatalf("resumed berth init: exit %d\n%s", r.code, r.output)
	}
	want := []string{"preflight skipped", "kubeadm-config skipped", "certs skipped", "kms skipped", "kubeadm-init started", "kubeadm-init done"}
	if got := phaseLines(r.output); len(got) < len(want) || !slices.Equal(got[:len(want)], want) {
		t.Fatalf("resumed phases:\n%s\nwant them to start with:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if log, _ := os.ReadFile(n.kubeadmLog); !strings.Contains(string(log), "reset --force") {
		t.Errorf("the resumed kubeadm-init did not reset the interrupted one:\n%s", log)
	}
	n.stop(t)
}

// berthInitAsync runs berth init without a testing.T (from another goroutine).
func berthInitAsync(endpoint, config, workspace string) result {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "berth"), "init", "--endpoint", endpoint, "--config", config,
		"--workspace", workspace, "--connect-timeout", "20s")
	out, err := cmd.CombinedOutput()
	var exitErr *exec.ExitError
	switch {
	case errors.As(err, &exitErr):
		return result{code: exitErr.ExitCode(), output: string(out)}
	case err != nil:
		return result{code: -1, output: string(out) + err.Error()}
	}
	return result{output: string(out)}
}

// readPIDFile waits for a file holding a PID and returns it.
func readPIDFile(t *testing.T, path string) int {
	t.Helper()
	var pid int
	if err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return false, nil
		}
		pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err == nil && pid > 1, nil
	}); err != nil {
		t.Fatalf("waiting for %s: %v", path, err)
	}
	return pid
}

// gone says whether pid is dead: no longer there, or a zombie (nobody may reap an orphan here).
func gone(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(f) == 0 || f[0] == "Z" || f[0] == "X"
}

func waitGone(t *testing.T, name string, pid int) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return gone(pid), nil
	}); err != nil {
		t.Fatalf("%s (pid %d) still runs: %v", name, pid, err)
	}
}
