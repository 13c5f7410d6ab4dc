// Command fakekubeadm stands in for kubeadm in the bootstrapper's binary test: it records its
// arguments and writes the files kubeadm would write, as told by FAKE_* environment variables.
package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

func main() {
	args := os.Args[1:]
	if log := os.Getenv("FAKE_KUBEADM_LOG"); log != "" {
		f, err := os.OpenFile(log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
		if err == nil {
			fmt.Fprintln(f, strings.Join(args, " "))
			f.Close()
		}
	}
	k8sDir, kubeletDir := os.Getenv("FAKE_K8S_DIR"), os.Getenv("FAKE_KUBELET_DIR")
	cmd := strings.Join(args, " ")
	switch {
	case cmd == "version -o short":
		fmt.Println("v1.37.2")
	case strings.HasPrefix(cmd, "init phase certs all"):
		must(os.MkdirAll(filepath.Join(k8sDir, "pki"), 0o755))
		must(os.WriteFile(filepath.Join(k8sDir, "pki", "ca.crt"), []byte("fake CA\n"), 0o644))
		fmt.Println("[certs] Generating \"ca\" certificate and key")
	case strings.HasPrefix(cmd, "init --config"):
		if hang := os.Getenv("FAKE_KUBEADM_HANG_ONCE"); hang != "" {
			if _, err := os.Stat(hang); err == nil {
				hangOnce(hang, k8sDir, kubeletDir)
			}
		}
		if fail := os.Getenv("FAKE_KUBEADM_FAIL_ONCE"); fail != "" {
			if _, err := os.Stat(fail); err == nil {
				must(os.Remove(fail))
				fmt.Println("[wait-control-plane] the control plane did not come up")
				os.Exit(1)
			}
		}
		admin, err := os.ReadFile(os.Getenv("FAKE_ADMIN_CONF"))
		must(err)
		must(os.WriteFile(filepath.Join(k8sDir, "admin.conf"), admin, 0o600))
		must(os.MkdirAll(kubeletDir, 0o755))
		must(os.WriteFile(filepath.Join(kubeletDir, "config.yaml"), []byte("kind: KubeletConfiguration\n"), 0o644))
		must(os.WriteFile(filepath.Join(kubeletDir, "kubeadm-flags.env"), []byte("KUBELET_KUBEADM_ARGS=\"--node-ip=127.0.0.1\"\n"), 0o644))
		must(os.WriteFile(filepath.Join(k8sDir, "kubelet.conf"), admin, 0o600))
		fmt.Println("Your Kubernetes control-plane has initialized successfully!")
	case strings.HasPrefix(cmd, "reset"):
		fmt.Println("[reset] Deleted contents of the etcd data directory")
	default:
		fmt.Fprintf(os.Stderr, "fakekubeadm: unexpected command %q\n", cmd)
		os.Exit(2)
	}
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakekubeadm:", err)
		os.Exit(3)
	}
}

// hangOnce stands for a kubeadm init that is under way when its daemon dies: it writes the kubelet's
// configuration (so the daemon's supervisor starts the kubelet), starts a background child of its
// own (which the daemon's Pdeathsig does not reach), records both PIDs beside the marker file and
// never returns.
func hangOnce(marker, k8sDir, kubeletDir string) {
	must(os.Remove(marker))
	must(os.MkdirAll(kubeletDir, 0o755))
	must(os.WriteFile(filepath.Join(kubeletDir, "config.yaml"), []byte("kind: KubeletConfiguration\n"), 0o644))
	admin, err := os.ReadFile(os.Getenv("FAKE_ADMIN_CONF"))
	must(err)
	must(os.WriteFile(filepath.Join(k8sDir, "kubelet.conf"), admin, 0o600))
	bg := exec.Command("sleep", "600")
	must(bg.Start())
	dir := filepath.Dir(marker)
	must(os.WriteFile(filepath.Join(dir, "kubeadm-child.pid"), []byte(strconv.Itoa(bg.Process.Pid)), 0o600))
	must(os.WriteFile(filepath.Join(dir, "kubeadm.pid"), []byte(strconv.Itoa(os.Getpid())), 0o600))
	fmt.Println("[wait-control-plane] waiting for the kubelet to boot up the control plane")
	time.Sleep(24 * time.Hour) // until the daemon's death kills it
}
