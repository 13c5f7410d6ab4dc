package imagetest

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/prereq"
)

// writeFile creates root/p with the given content and mode, and its parent directories.
func writeFile(t *testing.T, root, p, content string, mode os.FileMode) {
	t.Helper()
	full := filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(full, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
}

func symlink(t *testing.T, root, target, p string) {
	t.Helper()
	full := filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, full); err != nil {
		t.Fatal(err)
	}
}

func problemStrings(ps []Problem) []string {
	out := make([]string, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.String())
	}
	return out
}

func TestResolveIn(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "usr/lib/cni/bridge", "x", 0o755)
	symlink(t, root, "usr/lib", "lib")                        // relative, like merged /usr
	symlink(t, root, "/usr/lib/cni/bridge", "opt/cni/bridge") // absolute: must stay inside root
	symlink(t, root, "../../../../../usr/lib/cni/bridge", "opt/cni/up")
	symlink(t, root, "loop2", "loop1")
	symlink(t, root, "loop1", "loop2")

	for _, p := range []string{"/lib/cni/bridge", "/opt/cni/bridge", "/opt/cni/up", "/opt/../usr/lib/cni/bridge"} {
		got, err := resolveIn(root, p)
		if err != nil {
			t.Errorf("resolveIn(%s): %v", p, err)
			continue
		}
		if want := filepath.Join(root, "usr/lib/cni/bridge"); got != want {
			t.Errorf("resolveIn(%s) = %s, want %s", p, got, want)
		}
	}
	if _, err := resolveIn(root, "/loop1"); err == nil {
		t.Error("resolveIn(/loop1) followed a symlink loop without error")
	}
	if _, err := resolveIn(root, "/usr/lib/cni/missing"); err == nil {
		t.Error("resolveIn of a missing file succeeded")
	}
}

func TestLoadUnitAppliesDropins(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "usr/lib/systemd/system/demo.service", `# comment
[Unit]
Description=demo
After=a.target \
  b.target

[Service]
ExecStart=/usr/bin/demo --flag
Environment=A=1
`, 0o644)
	writeFile(t, root, "usr/lib/systemd/system/demo.service.d/10-override.conf", `[Service]
ExecStart=
ExecStart=/usr/bin/demo2
Environment=B=2
`, 0o644)
	// Same file name in /etc hides the one in /usr/lib.
	writeFile(t, root, "usr/lib/systemd/system/demo.service.d/20-extra.conf", "[Service]\nEnvironment=C=3\n", 0o644)
	writeFile(t, root, "etc/systemd/system/demo.service.d/20-extra.conf", "[Service]\nEnvironment=D=4\n", 0o644)

	u, err := LoadUnit(root, "demo.service")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := u.Values("Service", "ExecStart"), []string{"/usr/bin/demo2"}; !reflect.DeepEqual(got, want) {
		t.Errorf("ExecStart = %q, want %q", got, want)
	}
	if got, want := u.Values("Service", "Environment"), []string{"A=1", "B=2", "D=4"}; !reflect.DeepEqual(got, want) {
		t.Errorf("Environment = %q, want %q", got, want)
	}
	if after := u.Values("Unit", "After"); len(after) != 1 || !reflect.DeepEqual(strings.Fields(after[0]), []string{"a.target", "b.target"}) {
		t.Errorf("After = %q, want one value joining a.target and b.target", after)
	}
	wantFiles := []string{
		"/usr/lib/systemd/system/demo.service",
		"/usr/lib/systemd/system/demo.service.d/10-override.conf",
		"/etc/systemd/system/demo.service.d/20-extra.conf",
	}
	if !reflect.DeepEqual(u.Files, wantFiles) {
		t.Errorf("Files = %q, want %q", u.Files, wantFiles)
	}

	if _, err := LoadUnit(root, "absent.service"); err == nil {
		t.Error("LoadUnit of an absent unit succeeded")
	}
}

func TestCheckUnitsReportsMissingReferences(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "usr/lib/systemd/system/demo.service", `[Unit]
Wants=present.target absent.target
After=dev-tpmrm0.device -.slice

[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/bin/demo
ExecStop=/usr/bin/not-executable
ExecStopPost=missing-in-path
EnvironmentFile=/etc/demo/demo.env
EnvironmentFile=-/etc/demo/optional.env
EnvironmentFile=/etc/demo/absent.env
RuntimeDirectory=demo
ReadWritePaths=/etc/kubernetes /run/demo -/sys/kernel/config/tsm
ReadWritePaths=/run/other /run/fromtmpfiles /sys/fs/cgroup
WorkingDirectory=/var/lib/demo

[Install]
WantedBy=multi-user.target
`, 0o644)
	writeFile(t, root, "usr/lib/systemd/system/present.target", "[Unit]\n", 0o644)
	writeFile(t, root, "usr/sbin/modprobe", "x", 0o755)
	symlink(t, root, "usr/sbin", "sbin")
	writeFile(t, root, "usr/bin/demo", "x", 0o755)
	writeFile(t, root, "usr/bin/not-executable", "x", 0o644)
	writeFile(t, root, "usr/bin/kubeadm", "x", 0o755)
	writeFile(t, root, "etc/demo/demo.env", "# settings\nDEMO_KUBEADM_PATH=/usr/bin/kubeadm\nDEMO_KUBELET_PATH=\"/usr/bin/kubelet\"\nDEMO_STATE=/var/lib/demo\n", 0o644)
	writeFile(t, root, "usr/lib/tmpfiles.d/demo.conf", "d /run/fromtmpfiles 0755 root root -\n", 0o644)

	problems, err := CheckUnits(root, "demo.service", "gone.service")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"demo.service: EnvironmentFile:DEMO_KUBELET_PATH=/usr/bin/kubelet: missing from the tree",
		"demo.service: EnvironmentFile=/etc/demo/absent.env: missing from the tree",
		"demo.service: ExecStop=/usr/bin/not-executable: not executable",
		"demo.service: ExecStopPost=missing-in-path: missing from the tree",
		"demo.service: ReadWritePaths=/etc/kubernetes: missing from the tree",
		"demo.service: ReadWritePaths=/run/other: missing: /run is empty in the tree and nothing (RuntimeDirectory=, tmpfiles.d) creates it at run time",
		"demo.service: WantedBy=multi-user.target: no such unit in the tree",
		"demo.service: Wants=absent.target: no such unit in the tree",
		"demo.service: WorkingDirectory=/var/lib/demo: missing from the tree",
		"gone.service: unit=gone.service: no unit file on the search path",
	}
	if got := problemStrings(problems); !reflect.DeepEqual(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func TestPreset(t *testing.T) {
	root := t.TempDir()
	writeFile(t, root, "usr/lib/systemd/system-preset/90-systemd.preset", "enable systemd-*.service\nenable getty@.service\n", 0o644)
	writeFile(t, root, "usr/lib/systemd/system-preset/20-berth.preset", "# ours first\ndisable kubelet.service\ndisable systemd-timesyncd.service\n", 0o644)
	writeFile(t, root, "usr/lib/systemd/system-preset/30-hidden.preset", "disable containerd.service\n", 0o644)
	writeFile(t, root, "etc/systemd/system-preset/30-hidden.preset", "enable containerd.service\ndisable *\n", 0o644)
	for unit, want := range map[string]string{
		"kubelet.service":           "disable",
		"systemd-timesyncd.service": "disable", // 20-berth sorts before 90-systemd
		"systemd-networkd.service":  "disable", // "disable *" in 30-hidden (the /etc one) comes first
		"containerd.service":        "enable",  // /etc's 30-hidden hides /usr/lib's
	} {
		got, err := Preset(root, unit)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("Preset(%s) = %s, want %s", unit, got, want)
		}
	}
	empty := t.TempDir()
	if got, err := Preset(empty, "anything.service"); err != nil || got != "enable" {
		t.Errorf("Preset without preset files = %s, %v; want enable", got, err)
	}
}

// berthUnits are the units the image adds; the tree tests and the synthetic test check them all.
var berthUnits = []string{"berth-bootstrapper.service", "berth-cmdline-env.service", "kubelet.service", "berth-cert-renew.service", "berth-cert-renew.timer"}

// syntheticImage lays out image/mkosi.extra with the rendered bootstrapper settings, stub binaries
// for what make image copies in and stub units for what Debian's packages provide, so the real unit
// files can be checked without building the image.
func syntheticImage(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	src := filepath.Join("..", "mkosi.extra")
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		writeFile(t, root, rel, string(data), info.Mode().Perm())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := os.ReadFile(filepath.Join("..", "bootstrapper.env.in"))
	if err != nil {
		t.Fatal(err)
	}
	env := strings.NewReplacer("@ATTESTATION@", "tpm", "@METADATA@", "static").Replace(string(tmpl))
	writeFile(t, root, "usr/lib/berth/bootstrapper.env", env, 0o644)
	for _, b := range []string{"bootstrapper", "kubelet", "kubeadm"} {
		writeFile(t, root, "usr/bin/"+b, "#!/bin/sh\n", 0o755)
	}
	for _, u := range []string{
		"network-online.target", "multi-user.target", "shutdown.target", "containerd.service",
		"systemd-modules-load.service", "systemd-sysctl.service", "systemd-tmpfiles-setup.service",
		"sys-kernel-config.mount", "timers.target",
	} {
		writeFile(t, root, "usr/lib/systemd/system/"+u, "[Unit]\n", 0o644)
	}
	return root
}

func TestImageUnitsInSyntheticTree(t *testing.T) {
	root := syntheticImage(t)
	problems, err := CheckUnits(root, berthUnits...)
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) != 0 {
		t.Fatalf("complete synthetic tree has problems:\n%s", strings.Join(problemStrings(problems), "\n"))
	}

	// The negative case: take away what make image and tmpfiles.d would have provided.
	for _, p := range []string{"usr/bin/bootstrapper", "usr/bin/kubeadm", "usr/lib/berth/bootstrapper.env"} {
		if err := os.RemoveAll(filepath.Join(root, p)); err != nil {
			t.Fatal(err)
		}
	}
	problems, err = CheckUnits(root, berthUnits...)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"berth-bootstrapper.service: EnvironmentFile=/usr/lib/berth/bootstrapper.env: missing from the tree",
		"berth-bootstrapper.service: ExecStart=/usr/bin/bootstrapper: missing from the tree",
		"berth-cert-renew.service: EnvironmentFile=/usr/lib/berth/bootstrapper.env: missing from the tree",
		"berth-cert-renew.service: ExecStart=/usr/bin/bootstrapper: missing from the tree",
	}
	if got := problemStrings(problems); !reflect.DeepEqual(got, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// With the settings file back, the kubeadm path it names is checked too.
	tmpl, err := os.ReadFile(filepath.Join("..", "bootstrapper.env.in"))
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, root, "usr/lib/berth/bootstrapper.env", string(tmpl), 0o644)
	problems, err = CheckUnits(root, "berth-bootstrapper.service")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range problems {
		if p.Key == "EnvironmentFile:BERTH_KUBEADM_PATH" && p.Value == "/usr/bin/kubeadm" {
			found = true
		}
	}
	if !found {
		t.Errorf("missing kubeadm named by BERTH_KUBEADM_PATH not reported; problems:\n%s", strings.Join(problemStrings(problems), "\n"))
	}
}

// TestBootstrapperSharesMountNamespace: the daemon mounts the node's state disk over
// /etc/kubernetes, /var/lib/kubelet, /var/lib/etcd and /var/lib/berth for kubelet and containerd, so
// its unit must not give it a mount namespace of its own.
func TestBootstrapperSharesMountNamespace(t *testing.T) {
	root := syntheticImage(t)
	u, err := LoadUnit(root, "berth-bootstrapper.service")
	if err != nil {
		t.Fatal(err)
	}
	if got := MountNamespaceOptions(u); len(got) != 0 {
		t.Errorf("berth-bootstrapper.service runs in a mount namespace of its own because of %q", got)
	}
	// What the check keeps: sandboxing without a mount namespace.
	for _, key := range []string{"NoNewPrivileges", "SystemCallFilter", "RestrictAddressFamilies"} {
		if len(u.Values("Service", key)) == 0 {
			t.Errorf("berth-bootstrapper.service lost %s=", key)
		}
	}

	// The negative cases: each drop-in brings a mount namespace back, and the check says which.
	dropin := "etc/systemd/system/berth-bootstrapper.service.d/50-test.conf"
	for conf, want := range map[string][]string{
		"PrivateTmp=yes":                     {"PrivateTmp=yes"},
		"ProtectSystem=full":                 {"ProtectSystem=full"},
		"ProtectHome=read-only":              {"ProtectHome=read-only"},
		"ReadWritePaths=/etc/kubernetes":     {"ReadWritePaths=/etc/kubernetes"},
		"ProtectKernelTunables=true":         {"ProtectKernelTunables=true"},
		"ProtectKernelLogs=on":               {"ProtectKernelLogs=on"},
		"ProtectControlGroups=1":             {"ProtectControlGroups=1"},
		"MountFlags=slave":                   {"MountFlags=slave"},
		"PrivateTmp=yes\nPrivateTmp=no":      nil, // the last assignment wins
		"MountFlags=shared":                  nil,
		"ReadWritePaths=/a\nReadWritePaths=": nil, // an empty assignment resets the list
	} {
		t.Run(conf, func(t *testing.T) {
			writeFile(t, root, dropin, "[Service]\n"+conf+"\n", 0o644)
			u, err := LoadUnit(root, "berth-bootstrapper.service")
			if err != nil {
				t.Fatal(err)
			}
			if got := MountNamespaceOptions(u); !reflect.DeepEqual(got, want) {
				t.Errorf("MountNamespaceOptions with %q = %q, want %q", conf, got, want)
			}
		})
	}
}

// TestKubeletAfterBootstrapper: kubelet starts only once the bootstrapper is ready, that is once the
// state disk is open and mounted over kubelet's directories.
func TestKubeletAfterBootstrapper(t *testing.T) {
	root := syntheticImage(t)
	u, err := LoadUnit(root, "kubelet.service")
	if err != nil {
		t.Fatal(err)
	}
	if !OrderedAfter(u, "berth-bootstrapper.service") {
		t.Errorf("kubelet.service is not ordered after berth-bootstrapper.service with Requires= or BindsTo=: After=%q Requires=%q",
			u.Values("Unit", "After"), u.Values("Unit", "Requires"))
	}

	// The negative cases: a copy in /etc (which hides the image's) without the ordering, or without
	// the requirement.
	src, err := os.ReadFile(filepath.Join("..", "mkosi.extra", "usr", "lib", "systemd", "system", "kubelet.service"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{"After=berth-bootstrapper.service\n", "Requires=berth-bootstrapper.service\n"} {
		t.Run("without "+strings.TrimSpace(line), func(t *testing.T) {
			broken := strings.Replace(string(src), line, "", 1)
			if broken == string(src) {
				t.Fatalf("%q not found in kubelet.service", line)
			}
			writeFile(t, root, "etc/systemd/system/kubelet.service", broken, 0o644)
			u, err := LoadUnit(root, "kubelet.service")
			if err != nil {
				t.Fatal(err)
			}
			if OrderedAfter(u, "berth-bootstrapper.service") {
				t.Error("OrderedAfter accepted kubelet.service")
			}
		})
	}
}

func TestCmdlineEnv(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		prereq.Missing(t, "no sh in PATH: cannot run the kernel command line parser")
	}
	script := filepath.Join("..", "mkosi.extra", "usr", "libexec", "berth", "cmdline-env")
	tests := []struct {
		name    string
		cmdline string
		wantErr bool
		want    []string // the assignments written, in order
	}{
		{
			name:    "no berth options",
			cmdline: "BOOT_IMAGE=/vmlinuz root=/dev/vda2 ro quiet",
			want:    nil,
		},
		{
			name: "all options",
			cmdline: "quiet berth.metadata=static berth.metadata_file=/etc/berth/node.json " +
				"berth.metadata_url=http://198.51.100.1:8080/v1 berth.attestation=tdx berth.tpm=tcp:127.0.0.1:2321",
			want: []string{
				"BERTH_METADATA=static",
				"BERTH_METADATA_FILE=/etc/berth/node.json",
				"BERTH_METADATA_URL=http://198.51.100.1:8080/v1",
				"BERTH_ATTESTATION=tdx",
				"BERTH_TPM=tcp:127.0.0.1:2321",
			},
		},
		{
			name:    "a cloud provider with its compute API",
			cmdline: "berth.metadata=azure berth.metadata_api_url=https://management.azure.com",
			want:    []string{"BERTH_METADATA=azure", "BERTH_METADATA_API_URL=https://management.azure.com"},
		},
		{
			name:    "qemu provider",
			cmdline: "berth.metadata=qemu berth.metadata_url=http://198.51.100.1:8080",
			want:    []string{"BERTH_METADATA=qemu", "BERTH_METADATA_URL=http://198.51.100.1:8080"},
		},
		{name: "compute API without scheme", cmdline: "berth.metadata_api_url=management.azure.com", wantErr: true},
		{
			name:    "later option wins, unknown ones are ignored",
			cmdline: "berth.attestation=tpm berth.colour=blue berth.attestation=tdx berth.tpm=/dev/tpm0",
			want:    []string{"BERTH_ATTESTATION=tdx", "BERTH_TPM=/dev/tpm0"},
		},
		{
			name:    "swtpm on a unix socket",
			cmdline: "berth.tpm=unix:/run/swtpm/data.sock",
			want:    []string{"BERTH_TPM=unix:/run/swtpm/data.sock"},
		},
		{name: "unknown attestation", cmdline: "berth.attestation=insecure-none", wantErr: true},
		{name: "unknown metadata", cmdline: "berth.metadata=cloud", wantErr: true},
		{name: "relative metadata file", cmdline: "berth.metadata_file=node.json", wantErr: true},
		{name: "metadata url without scheme", cmdline: "berth.metadata_url=198.51.100.1:8080", wantErr: true},
		{name: "tpm not a device or tcp", cmdline: "berth.tpm=tpm0", wantErr: true},
		{name: "quote in value", cmdline: `berth.metadata_file=/etc/"x"`, wantErr: true},
		{name: "dollar in value", cmdline: "berth.metadata_file=/etc/$HOME", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			cmdlineFile := filepath.Join(dir, "cmdline")
			envFile := filepath.Join(dir, "cmdline.env")
			if err := os.WriteFile(cmdlineFile, []byte(tt.cmdline+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(sh, script, cmdlineFile, envFile).CombinedOutput()
			if tt.wantErr {
				if err == nil {
					t.Fatalf("accepted %q; output:\n%s", tt.cmdline, out)
				}
				if _, statErr := os.Stat(envFile); statErr == nil {
					t.Errorf("wrote %s despite the error", envFile)
				}
				return
			}
			if err != nil {
				t.Fatalf("rejected %q: %v\n%s", tt.cmdline, err, out)
			}
			vars, err := ReadEnvironmentFile(dir, "cmdline.env")
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, kv := range vars {
				got = append(got, kv[0]+"="+kv[1])
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("assignments = %q, want %q", got, tt.want)
			}
		})
	}
}

// TestCertRenewUnits: the timer starts berth-cert-renew.service (its own name) every hour, which
// runs one check of the bootstrapper's renewer with the bootstrapper's settings, only on a control
// plane, after the bootstrapper opened the state disk; the preset enables the timer.
func TestCertRenewUnits(t *testing.T) {
	root := syntheticImage(t)
	timer, err := LoadUnit(root, "berth-cert-renew.timer")
	if err != nil {
		t.Fatal(err)
	}
	if got := timer.Values("Timer", "Unit"); len(got) != 0 {
		t.Errorf("timer Unit=%q: it should start the service of its own name", got)
	}
	if got := timer.Values("Timer", "OnUnitActiveSec"); !slices.Equal(got, []string{"1h"}) {
		t.Errorf("OnUnitActiveSec=%q, want 1h", got)
	}
	svc, err := LoadUnit(root, "berth-cert-renew.service")
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string][]string{
		"ExecStart":       {"/usr/bin/bootstrapper renew-certs"},
		"Type":            {"oneshot"},
		"EnvironmentFile": {"/usr/lib/berth/bootstrapper.env", "-/etc/berth/bootstrapper.env"},
	} {
		if got := svc.Values("Service", key); !slices.Equal(got, want) {
			t.Errorf("berth-cert-renew.service %s=%q, want %q", key, got, want)
		}
	}
	if got := svc.Values("Unit", "ConditionPathExists"); !slices.Equal(got, []string{"/etc/kubernetes/manifests/kube-apiserver.yaml"}) {
		t.Errorf("ConditionPathExists=%q: the service must run only on a control plane", got)
	}
	if !OrderedAfter(svc, "berth-bootstrapper.service") {
		t.Error("berth-cert-renew.service may run before the bootstrapper opened the state disk")
	}
	if got, err := Preset(root, "berth-cert-renew.timer"); err != nil || got != "enable" {
		t.Errorf("preset for berth-cert-renew.timer: %s, %v", got, err)
	}
}
