package mini

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/prereq"
)

// TestStateDirsScript runs a node's state-dirs script for real in a private mount namespace whose
// state paths are the read-only placeholders a node starts with, after the "bootstrapper" bound the
// disk's node state directory: containerd's root comes from the seed, and it, the CNI state and
// /var/log are the disk's directories (a write lands on the disk); a second run (the kubelet's
// wrapper after containerd's) mounts nothing twice and copies nothing again.
func TestStateDirsScript(t *testing.T) {
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root (mount namespaces)")
	}
	for _, bin := range []string{"unshare", "flock", "stat", "mount"} {
		if _, err := exec.LookPath(bin); err != nil {
			prereq.Missing(t, "%s not installed", bin)
		}
	}
	dir := t.TempDir()
	disk, seed := filepath.Join(dir, "disk"), filepath.Join(dir, "seed")
	if err := writeFile(filepath.Join(seed, "root", "io.containerd.metadata.v1.bolt", "meta.db"), []byte("seeded"), 0o600); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, "state-dirs")
	if err := writeFile(script, stateDirsScript(disk, seed, true), 0o755); err != nil {
		t.Fatal(err)
	}
	placeholder := "mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk"
	node := strings.Join([]string{
		"set -e",
		"mount -t tmpfs tmpfs /run",
		// The host need not have these directories: a private /var/lib holds the mount points.
		"mount -t tmpfs tmpfs /var/lib",
		"mkdir -p /var/lib/containerd /var/lib/cni " + NodeStateDir,
		placeholder + " /var/lib/containerd",
		placeholder + " /var/lib/cni",
		placeholder + " /var/log",
		placeholder + " " + NodeStateDir,
		// What the bootstrapper's boot stage does once the disk is open.
		"mkdir -p " + disk + "/var-lib-berth",
		"mount --bind " + disk + "/var-lib-berth " + NodeStateDir,
		script,
		script,
		"echo pod-log > /var/log/written-by-node",
		"cat /var/lib/containerd/io.containerd.metadata.v1.bolt/meta.db",
		"echo",
		"grep -c ' /var/log \\| /var/lib/containerd \\| /var/lib/cni ' /proc/self/mountinfo",
	}, "\n")
	out, err := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", node).CombinedOutput()
	if err != nil {
		t.Fatalf("node shell: %v\n%s", err, out)
	}
	lines := strings.Fields(string(out))
	if len(lines) != 2 || lines[0] != "seeded" {
		t.Fatalf("containerd root not seeded: %q", out)
	}
	// Three placeholders and three binds over them: a second run binds nothing again.
	if lines[1] != "6" {
		t.Errorf("mounts at the three directories = %s, want 6 (placeholder and bind each)", lines[1])
	}
	if b, err := os.ReadFile(filepath.Join(disk, "var-log", "written-by-node")); err != nil || string(b) != "pod-log\n" {
		t.Errorf("a write to the node's /var/log did not land on the disk: %q, %v", b, err)
	}
	for _, d := range []string{"var-lib-containerd", "var-lib-cni", "var-log"} {
		if fi, err := os.Stat(filepath.Join(disk, d)); err != nil || !fi.IsDir() {
			t.Errorf("disk directory %s: %v", d, err)
		}
	}
	if _, err := os.Stat(filepath.Join(disk, "var-lib-containerd.seeding")); err == nil {
		t.Error("the seeding directory was left behind")
	}
}
