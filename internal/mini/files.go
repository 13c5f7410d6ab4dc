package mini

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"sort"
	"strings"
)

// containerdConfig is containerd 1.6's configuration for a node. Paths are the standard ones: the
// node's mount namespace maps them to the node's own directories. restrict_oom_score_adj is required
// on hosts without CAP_SYS_RESOURCE (runc cannot set negative OOM scores there). pauseImage is the
// sandbox image the cluster's kubeadm names.
func containerdConfig(pauseImage string) string {
	return `# Written by berth mini.
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "` + pauseImage + `"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
`
}

// cniConflist is the node's CNI configuration: a bridge with host-local addresses from the node's
// pod subnet, and routes only to the cluster's pod and service ranges and to the node network (no
// default route), so a pod can reach pods, Services and nodes but nothing outside. The node-network
// route matters for answers: a host-network process on another node (the API server calling a
// webhook, a kubelet) connects from its node address, and without the route the pod's SYN-ACK has
// nowhere to go, so the connection hangs until the caller's timeout.
func cniConflist(nodeSubnet, podCIDR, serviceCIDR, nodeNetwork netip.Prefix, mtu int) ([]byte, error) {
	gw := nodeSubnet.Masked().Addr().Next()
	conf := map[string]any{
		"cniVersion": "0.4.0",
		"name":       "berth-mini",
		"plugins": []any{
			map[string]any{
				"type":             "bridge",
				"bridge":           "cni0",
				"isGateway":        true,
				"ipMasq":           false,
				"hairpinMode":      true,
				"mtu":              mtu,
				"forceAddress":     true,
				"isDefaultGateway": false,
				"ipam": map[string]any{
					"type":   "host-local",
					"ranges": [][]map[string]string{{{"subnet": nodeSubnet.Masked().String(), "gateway": gw.String()}}},
					"routes": []map[string]string{
						{"dst": podCIDR.Masked().String(), "gw": gw.String()},
						{"dst": serviceCIDR.Masked().String(), "gw": gw.String()},
						{"dst": nodeNetwork.Masked().String(), "gw": gw.String()},
					},
					"dataDir": "/var/lib/cni/networks",
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encoding CNI config: %w", err)
	}
	return append(b, '\n'), nil
}

// parseSubnetEnv reads flannel's subnet.env (KEY=VALUE lines) and returns FLANNEL_SUBNET as the
// node's pod subnet and FLANNEL_MTU.
func parseSubnetEnv(b []byte) (netip.Prefix, int, error) {
	vals := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if ok {
			vals[k] = v
		}
	}
	p, err := netip.ParsePrefix(vals["FLANNEL_SUBNET"])
	if err != nil {
		return netip.Prefix{}, 0, fmt.Errorf("parsing FLANNEL_SUBNET: %w", err)
	}
	mtu := 1500
	if s := vals["FLANNEL_MTU"]; s != "" {
		if _, err := fmt.Sscanf(s, "%d", &mtu); err != nil {
			return netip.Prefix{}, 0, fmt.Errorf("parsing FLANNEL_MTU: %w", err)
		}
	}
	return p.Masked(), mtu, nil
}

// hostsFile maps localhost and every node name to its address, so that no node ever asks a DNS
// server for a node name.
func hostsFile(nodes []Node) []byte {
	var b strings.Builder
	b.WriteString("# Written by berth mini.\n127.0.0.1\tlocalhost\n::1\tlocalhost\n")
	sorted := append([]Node(nil), nodes...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Name < sorted[j].Name })
	for _, n := range sorted {
		fmt.Fprintf(&b, "%s\t%s\n", n.IP, n.Name)
	}
	return []byte(b.String())
}

// resolvConf points a node's resolver at the host's bridge address, where no DNS server runs:
// lookups of outside names fail at once instead of leaving the namespace.
func resolvConf(host netip.Addr) []byte {
	return []byte(fmt.Sprintf("# Written by berth mini: no outside DNS for mini nodes.\nnameserver %s\noptions timeout:1 attempts:1\n", host))
}

// diskDirs are the node's directories that the node's state-dirs script binds from its state disk
// (the bootstrapper's boot stage binds the others: /etc/kubernetes, the kubelet's, etcd's and its
// own state directory): containerd's root (images, containers and their environment, writable
// layers), the CNI plugins' state (address leases) and /var/log (pod logs). containerd's state
// (/run/containerd: task bundles, sockets) lives on the node's /run, a tmpfs like a machine's.
var diskDirs = []struct{ name, dst string }{
	{"var-lib-containerd", "/var/lib/containerd"},
	{"var-lib-cni", "/var/lib/cni"},
	{"var-log", "/var/log"},
}

// stateDirsScript is the script the containerd and kubelet wrappers of a node run first. With a
// bootstrapper (waitDisk), it waits until the bootstrapper has opened the node's state disk (its
// last bind, the node state directory, is no longer the read-only placeholder), then binds
// diskDirs from root (the disk's plaintext tree, as the node sees it) over their placeholders,
// once per boot (a lock on the node's /run serializes the two wrappers). A disk without a
// containerd root gets a copy of the cluster's seed root (seed, read-only on the host): copied
// under another name and renamed when complete, so that a power cut during the copy leaves none.
func stateDirsScript(root, seed string, waitDisk bool) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, `#!/bin/sh
# Written by berth mini: mounts the node's containerd root, CNI state and /var/log from its state
# disk once the bootstrapper opened it; run by the node's containerd and kubelet wrappers.
set -eu
exec 9>/run/berth-mini-state-dirs.lock
flock 9
root=%s
seed=%s
`, shellQuote(root), shellQuote(seed))
	if waitDisk {
		fmt.Fprintf(&b, "until [ \"$(stat -f -c %%T %s)\" != tmpfs ]; do sleep 0.2; done\n", shellQuote(NodeStateDir))
	}
	b.WriteString(`if [ ! -d "$root/var-lib-containerd" ]; then
	rm -rf "$root/var-lib-containerd.seeding"
	mkdir -p "$root/var-lib-containerd.seeding"
	if [ -d "$seed/root" ]; then
		flock -s "$seed/.lock" cp -a "$seed/root/." "$root/var-lib-containerd.seeding/"
	fi
	sync -f "$root/var-lib-containerd.seeding"
	mv "$root/var-lib-containerd.seeding" "$root/var-lib-containerd"
fi
`)
	for _, d := range diskDirs {
		fmt.Fprintf(&b, `mkdir -p "$root/%s"
if [ "$(stat -f -c %%T %s)" = tmpfs ]; then mount --bind "$root/%s" %s; fi
`, d.name, shellQuote(d.dst), d.name, shellQuote(d.dst))
	}
	return []byte(b.String())
}

// containerdWrapper is the script that runs a node's containerd: its directories first, then
// containerd itself (exec: the recorded process is containerd's). Its process ID goes to
// ContainerdPidFile on the node's /run, where the bootstrapper of a node locked by a REVOKED
// check-in finds it to stop containerd, whose root is on the state disk, before closing the disk.
func containerdWrapper(stateDirs string) []byte {
	return []byte(fmt.Sprintf(`#!/bin/sh
# Written by berth mini: containerd for one namespace node, on its state disk.
set -e
%s
echo $$ > %s
exec containerd --config /etc/containerd/config.toml
`, shellQuote(stateDirs), shellQuote(ContainerdPidFile)))
}

// ContainerdPidFile is where a node's containerd wrapper writes containerd's process ID (the
// node's /run, a tmpfs per boot).
const ContainerdPidFile = "/run/berth-mini-containerd.pid"

// kubeletWrapper is the script a node's bootstrapper runs as kubelet: it makes sure the node's
// directories are on its state disk and containerd answers, then adds the node's cgroup root and
// the host facts (cgroupfs, swap) to whatever kubeadm's flags say.
func kubeletWrapper(kubelet, cgroupRoot, stateDirs string) []byte {
	return []byte(fmt.Sprintf(`#!/bin/sh
# Written by berth mini: kubelet for one namespace node (own cgroup root; the host has no systemd).
set -e
%s
until ctr --address /run/containerd/containerd.sock version >/dev/null 2>&1; do sleep 0.2; done
exec %s "$@" --cgroup-root=%s --cgroup-driver=cgroupfs --fail-swap-on=false
`, shellQuote(stateDirs), shellQuote(kubelet), shellQuote(cgroupRoot)))
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// swtpmSetupConf and friends are swtpm_setup's private configuration: the mini-local CA in caDir
// signs every node's EK and platform certificates.
func swtpmSetupConf(caDir string) []byte {
	return []byte(fmt.Sprintf(`# Written by berth mini.
create_certs_tool = /usr/bin/swtpm_localca
create_certs_tool_config = %s/swtpm-localca.conf
create_certs_tool_options = %s/swtpm-localca.options
active_pcr_banks = sha256
`, caDir, caDir))
}

func swtpmLocalCAConf(caDir string) []byte {
	return []byte(fmt.Sprintf(`statedir = %[1]s
signingkey = %[1]s/signkey.pem
issuercert = %[1]s/issuercert.pem
certserial = %[1]s/certserial
`, caDir))
}

func swtpmLocalCAOptions() []byte {
	return []byte("--platform-manufacturer Berth\n--platform-version 2.1\n--platform-model berth-mini\n")
}
