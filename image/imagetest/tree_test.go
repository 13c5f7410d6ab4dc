package imagetest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/k8sversion"
)

// imageRoot returns the root tree `make image` built, named by BERTH_IMAGE_ROOT, or skips the test.
func imageRoot(t *testing.T) string {
	t.Helper()
	root := os.Getenv("BERTH_IMAGE_ROOT")
	if root == "" {
		t.Skip("BERTH_IMAGE_ROOT is not set: run `make test-image` to build the image tree and check it")
	}
	if _, err := os.Stat(filepath.Join(root, "usr/lib/systemd")); err != nil {
		t.Fatalf("BERTH_IMAGE_ROOT=%s is not an image tree: %v", root, err)
	}
	return root
}

// buildInfo reads the berth-root.env file image/build.sh writes next to the tree.
func buildInfo(t *testing.T, root string) map[string]string {
	t.Helper()
	vars, err := ReadEnvironmentFile(filepath.Dir(root), filepath.Base(root)+".env")
	if err != nil {
		t.Fatalf("reading the build's record: %v", err)
	}
	out := map[string]string{}
	for _, kv := range vars {
		out[kv[0]] = kv[1]
	}
	return out
}

func TestTreeUnitReferences(t *testing.T) {
	root := imageRoot(t)
	// Berth's units, and Debian's containerd unit whose configuration the image replaces.
	problems, err := CheckUnits(root, append(slices.Clone(berthUnits), "containerd.service")...)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
}

func TestTreeBinaries(t *testing.T) {
	root := imageRoot(t)
	for _, b := range []string{
		"/usr/bin/bootstrapper", "/usr/bin/kubelet", "/usr/bin/kubeadm",
		"/usr/bin/containerd", "/usr/bin/containerd-shim-runc-v2", "/usr/sbin/runc",
		"/usr/libexec/berth/cmdline-env", "/usr/bin/systemctl",
		// kubeadm's preflight checks look these up in PATH (through /etc/alternatives for some).
		// the state disk (internal/statedisk's LUKS2 backend)
		"cryptsetup", "mkfs.ext4",
		"iptables", "ip6tables", "ip", "mount", "nsenter", "conntrack", "ebtables", "ethtool", "socat", "tc", "touch", "modprobe",
	} {
		if reason := checkExecutable(root, b); reason != "" {
			t.Errorf("%s: %s", b, reason)
		}
	}
}

func TestTreeKubeletUnitAsKubeadmExpects(t *testing.T) {
	root := imageRoot(t)
	u, err := LoadUnit(root, "kubelet.service")
	if err != nil {
		t.Fatal(err)
	}
	execStart := u.Values("Service", "ExecStart")
	if len(execStart) != 1 {
		t.Fatalf("kubelet.service has %d ExecStart= after its drop-ins, want 1: %q", len(execStart), execStart)
	}
	for _, want := range []string{"/usr/bin/kubelet ", "$KUBELET_KUBECONFIG_ARGS", "$KUBELET_CONFIG_ARGS", "$KUBELET_KUBEADM_ARGS", "$KUBELET_EXTRA_ARGS"} {
		if !strings.Contains(execStart[0], want) {
			t.Errorf("kubelet ExecStart %q lacks %q", execStart[0], want)
		}
	}
	if envFiles := u.Values("Service", "EnvironmentFile"); !slices.Contains(envFiles, "-/var/lib/kubelet/kubeadm-flags.env") {
		t.Errorf("kubelet EnvironmentFile= %q does not read kubeadm's flags file", envFiles)
	}
	env := strings.Join(u.Values("Service", "Environment"), " ")
	for _, want := range []string{"--config=/var/lib/kubelet/config.yaml", "--kubeconfig=/etc/kubernetes/kubelet.conf", "--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf"} {
		if !strings.Contains(env, want) {
			t.Errorf("kubelet Environment= lacks %q", want)
		}
	}
}

func TestTreeBootstrapperUnit(t *testing.T) {
	root := imageRoot(t)
	u, err := LoadUnit(root, "berth-bootstrapper.service")
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"Type": "notify", "Restart": "on-failure", "ExecStart": "/usr/bin/bootstrapper"} {
		if got := u.Values("Service", key); !slices.Equal(got, []string{want}) {
			t.Errorf("%s = %q, want %q", key, got, want)
		}
	}
	after := strings.Fields(strings.Join(u.Values("Unit", "After"), " "))
	for _, want := range []string{"network-online.target", "containerd.service", "berth-cmdline-env.service"} {
		if !slices.Contains(after, want) {
			t.Errorf("After= lacks %s", want)
		}
	}
	if got := MountNamespaceOptions(u); len(got) != 0 {
		t.Errorf("the bootstrapper runs in a mount namespace of its own (%q): its state disk mounts would be hidden from kubelet", got)
	}
	kubelet, err := LoadUnit(root, "kubelet.service")
	if err != nil {
		t.Fatal(err)
	}
	if !OrderedAfter(kubelet, "berth-bootstrapper.service") {
		t.Error("kubelet.service may start before berth-bootstrapper.service opened the state disk")
	}

	info := buildInfo(t, root)
	vars, err := ReadEnvironmentFile(root, "/usr/lib/berth/bootstrapper.env")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, kv := range vars {
		got[kv[0]] = kv[1]
	}
	want := map[string]string{
		"BERTH_ATTESTATION":        info["IMAGE_ATTESTATION"],
		"BERTH_METADATA":           info["IMAGE_METADATA"],
		"BERTH_KUBELET":            "systemd",
		"BERTH_KUBEADM_PATH":       "/usr/bin/kubeadm",
		"BERTH_STATE_DIR":          "/var/lib/berth",
		"BERTH_CRI_SOCKET":         "unix:///run/containerd/containerd.sock",
		"BERTH_STATE_DISK_BACKEND": "luks",
		"BERTH_STATE_DISK":         "/dev/disk/by-partlabel/berth-state",
		"BERTH_STATE_MOUNT":        "/run/berth/state-disk",
		"BERTH_ETCD_DIR":           "/var/lib/etcd",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("bootstrapper.env %s=%q, want %q", k, got[k], v)
		}
	}
}

func TestTreeEnabledUnits(t *testing.T) {
	root := imageRoot(t)
	for _, link := range []string{
		"/etc/systemd/system/multi-user.target.wants/berth-bootstrapper.service",
		"/etc/systemd/system/timers.target.wants/berth-cert-renew.timer",
		"/etc/systemd/system/multi-user.target.wants/containerd.service",
		"/etc/systemd/system/network-online.target.wants/systemd-networkd-wait-online.service",
	} {
		if _, err := statIn(root, link); err != nil {
			t.Errorf("%s: %v", link, err)
		}
	}
	// systemd applies the presets again on the node's first boot (the image has no machine ID):
	// they must agree with the links made at build time.
	for unit, want := range map[string]string{
		"berth-bootstrapper.service": "enable",
		"berth-cert-renew.timer":     "enable",
		"containerd.service":         "enable",
		"kubelet.service":            "disable",
		"cni-dhcp.socket":            "disable",
		"apt-daily.timer":            "disable",
	} {
		got, err := Preset(root, unit)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("preset for %s: %s, want %s", unit, got, want)
		}
	}
	// kubelet is started by the bootstrapper, never at boot by itself.
	wants, err := filepath.Glob(filepath.Join(root, "etc/systemd/system/*.wants/kubelet.service"))
	if err != nil {
		t.Fatal(err)
	}
	if len(wants) != 0 {
		t.Errorf("kubelet.service is enabled: %q", wants)
	}
}

func TestTreeContainerdConfig(t *testing.T) {
	root := imageRoot(t)
	real, err := resolveIn(root, "/etc/containerd/config.toml")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(real)
	if err != nil {
		t.Fatal(err)
	}
	setting := func(key string) string {
		m := regexp.MustCompile(`(?m)^\s*` + key + `\s*=\s*"?([^"\n]*)"?\s*$`).FindSubmatch(cfg)
		if m == nil {
			t.Fatalf("config.toml has no %s", key)
		}
		return string(m[1])
	}
	if got := setting("SystemdCgroup"); got != "true" {
		t.Errorf("SystemdCgroup = %s, want true (kubelet uses the systemd cgroup driver)", got)
	}
	if reason := checkExecutable(root, setting("BinaryName")); reason != "" {
		t.Errorf("runc BinaryName %s: %s", setting("BinaryName"), reason)
	}
	binDir := setting("bin_dir")
	for _, plugin := range []string{"bridge", "host-local", "loopback", "portmap", "bandwidth", "firewall"} {
		if reason := checkExecutable(root, binDir+"/"+plugin); reason != "" {
			t.Errorf("CNI plugin %s/%s: %s", binDir, plugin, reason)
		}
	}
	if fi, err := statIn(root, setting("conf_dir")); err != nil || !fi.IsDir() {
		t.Errorf("CNI conf_dir %s is not a directory in the tree: %v", setting("conf_dir"), err)
	}
}

func TestTreeTmpfiles(t *testing.T) {
	root := imageRoot(t)
	entries, err := ReadTmpfiles(root)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range entries {
		if e.File != "/usr/lib/tmpfiles.d/berth.conf" {
			continue
		}
		n++
		if underRun(e.Path) {
			continue // created at boot
		}
		// mkosi.finalize applied the persistent entries at build time.
		fi, err := statIn(root, e.Path)
		if err != nil {
			t.Errorf("tmpfiles entry %s %s: not in the tree: %v", e.Type, e.Path, err)
			continue
		}
		switch e.Type[0] {
		case 'd':
			if !fi.IsDir() {
				t.Errorf("tmpfiles entry %s %s: not a directory", e.Type, e.Path)
			}
		case 'L':
			if reason := checkExecutable(root, e.Argument); reason != "" {
				t.Errorf("tmpfiles link %s -> %s: %s", e.Path, e.Argument, reason)
			}
		}
	}
	if n == 0 {
		t.Error("no entries from /usr/lib/tmpfiles.d/berth.conf")
	}
}

// TestTreeStateDiskModules: the image's kernel has the device-mapper targets of the LUKS2 state
// disk (the CI machines' kernel does not, so this is the only place they are checked before a boot).
func TestTreeStateDiskModules(t *testing.T) {
	root := imageRoot(t)
	for _, mod := range []string{"dm-crypt", "dm-integrity"} {
		found, err := filepath.Glob(filepath.Join(root, "usr/lib/modules/*/kernel/drivers/md", mod+".ko*"))
		if err != nil {
			t.Fatal(err)
		}
		if len(found) == 0 {
			t.Errorf("no %s module under /usr/lib/modules/*/kernel/drivers/md", mod)
		}
	}
}

func TestTreeKernelSettings(t *testing.T) {
	root := imageRoot(t)
	for file, wants := range map[string][]string{
		"/usr/lib/sysctl.d/90-berth-kubernetes.conf":        {"net.ipv4.ip_forward = 1", "net.bridge.bridge-nf-call-iptables = 1"},
		"/usr/lib/modules-load.d/berth-kubernetes.conf":     {"overlay", "br_netfilter"},
		"/usr/lib/modules-load.d/berth-state-disk.conf":     {"dm_crypt", "dm_integrity"},
		"/etc/systemd/network/80-berth-dhcp.network":        {"DHCP=yes"},
		"/etc/dpkg/dpkg.cfg.d/01-berth-nodoc":               {"path-include /usr/share/doc/*/copyright"},
		"/usr/lib/systemd/system/berth-cmdline-env.service": {"ExecStart=/usr/libexec/berth/cmdline-env"},
	} {
		real, err := resolveIn(root, file)
		if err != nil {
			t.Errorf("%s: %v", file, err)
			continue
		}
		data, err := os.ReadFile(real)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range wants {
			if !bytes.Contains(data, []byte(w)) {
				t.Errorf("%s lacks %q", file, w)
			}
		}
	}
}

func TestTreeBinariesRun(t *testing.T) {
	root := imageRoot(t)
	// The project's binaries are static; they run on the build host as they will on the node.
	info := buildInfo(t, root)
	real, err := resolveIn(root, "/usr/bin/kubeadm")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(real, "version", "-o", "short").CombinedOutput()
	if err != nil {
		t.Fatalf("kubeadm version: %v\n%s", err, out)
	}
	version := strings.TrimSpace(string(out))
	if want := k8sversion.Default().Kubernetes; version != want {
		t.Fatalf("kubeadm version = %q, want the default release %s (from %s)", version, want, info["IMAGE_K8S_BIN"])
	}

	// containerd must use the pod sandbox image this kubeadm expects (a node imports it, never pulls).
	out, err = exec.Command(real, "config", "images", "list", "--kubernetes-version", version).Output()
	if err != nil {
		t.Fatalf("kubeadm config images list: %v", err)
	}
	var pause string
	for _, img := range strings.Fields(string(out)) {
		if strings.Contains(img, "/pause:") {
			pause = img
		}
	}
	cfgPath, err := resolveIn(root, "/etc/containerd/config.toml")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*sandbox_image\s*=\s*"([^"]+)"`).FindSubmatch(cfg)
	if m == nil || pause == "" || string(m[1]) != pause {
		t.Errorf("containerd sandbox_image = %q, kubeadm %s expects %q", m, version, pause)
	}
}

// The image's measured boot: systemd-pcrphase is masked so that PCR 11 stays what systemd-stub
// measured, and the build wrote the UKI and the measurements it computed for it.
func TestTreeMeasuredBoot(t *testing.T) {
	root := imageRoot(t)
	for _, u := range []string{"systemd-pcrphase.service", "systemd-pcrphase-sysinit.service", "systemd-pcrphase-initrd.service"} {
		target, err := os.Readlink(filepath.Join(root, "etc/systemd/system", u))
		if err != nil || target != "/dev/null" {
			t.Errorf("%s is not masked (link to %q, %v): it would extend PCR 11 after the stub", u, target, err)
		}
	}
	info := buildInfo(t, root)
	for _, key := range []string{"IMAGE_UKI", "IMAGE_MEASUREMENTS"} {
		path := info[key]
		if st, err := os.Stat(path); path == "" || err != nil || st.Size() == 0 {
			t.Errorf("%s=%q: %v", key, path, err)
		}
	}
	m, err := os.ReadFile(info["IMAGE_MEASUREMENTS"])
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"variant: tpm", "\n  4:\n", "\n  11:\n"} {
		if !strings.Contains(string(m), want) {
			t.Errorf("measurements file has no %q:\n%s", want, m)
		}
	}
}
