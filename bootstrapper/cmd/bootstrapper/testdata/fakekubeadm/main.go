// Command fakekubeadm stands in for kubeadm in the bootstrapper's binary test: it records its
// arguments and writes the files kubeadm would write, as told by FAKE_* environment variables.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
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
		fmt.Println("v1.34.2")
	case strings.HasPrefix(cmd, "init phase certs all"):
		must(os.MkdirAll(filepath.Join(k8sDir, "pki"), 0o755))
		must(os.WriteFile(filepath.Join(k8sDir, "pki", "ca.crt"), []byte("fake CA\n"), 0o644))
		fmt.Println("[certs] Generating \"ca\" certificate and key")
	case strings.HasPrefix(cmd, "init --config"):
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
