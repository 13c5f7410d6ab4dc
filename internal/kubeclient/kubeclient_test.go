package kubeclient

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// writeKubeconfig writes a kubeconfig with one context per server (context name = key) and
// current-context current.
func writeKubeconfig(t *testing.T, path, current string, servers map[string]string) {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	for name, server := range servers {
		cfg.Clusters[name] = &clientcmdapi.Cluster{Server: server}
		cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: "token-" + name}
		cfg.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: name}
	}
	cfg.CurrentContext = current
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
}

// homeFile points ~/.kube/config at path for the test.
func homeFile(t *testing.T, path string) {
	orig := clientcmd.RecommendedHomeFile
	t.Cleanup(func() { clientcmd.RecommendedHomeFile = orig })
	clientcmd.RecommendedHomeFile = path
}

func host(t *testing.T, cfg *rest.Config, err error) string {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Host
}

// TestLoad: kubectl's rules. KUBECONFIG is a list merged first-wins, a context of any listed file
// can be picked, an explicit file wins over KUBECONFIG, ~/.kube/config is the last resort, and
// without any kubeconfig the error is ErrNoConfig.
func TestLoad(t *testing.T) {
	dir := t.TempDir()
	a, b, home := filepath.Join(dir, "a.conf"), filepath.Join(dir, "b.conf"), filepath.Join(dir, "home.conf")
	writeKubeconfig(t, a, "ctx-a", map[string]string{"ctx-a": "https://198.51.100.1"})
	writeKubeconfig(t, b, "ctx-b", map[string]string{"ctx-b": "https://198.51.100.2", "ctx-a": "https://198.51.100.3"})
	writeKubeconfig(t, home, "ctx-h", map[string]string{"ctx-h": "https://198.51.100.4"})
	homeFile(t, home)
	list := func(files ...string) string {
		s := files[0]
		for _, f := range files[1:] {
			s += string(filepath.ListSeparator) + f
		}
		return s
	}
	for _, tc := range []struct {
		name, env, path, context, want string
	}{
		{"first file's current-context", list(a, b), "", "", "https://198.51.100.1"},
		{"first file wins a clash", list(a, b), "", "ctx-a", "https://198.51.100.1"},
		{"context from the second file", list(a, b), "", "ctx-b", "https://198.51.100.2"},
		{"explicit file wins over KUBECONFIG", a, b, "", "https://198.51.100.2"},
		{"home file without KUBECONFIG", "", "", "", "https://198.51.100.4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("KUBECONFIG", tc.env)
			cfg, err := Load(tc.path, tc.context)
			if got := host(t, cfg, err); got != tc.want {
				t.Fatalf("host %s, want %s", got, tc.want)
			}
		})
	}
	t.Run("unknown context", func(t *testing.T) {
		t.Setenv("KUBECONFIG", a)
		if _, err := Load("", "nope"); err == nil || errors.Is(err, ErrNoConfig) {
			t.Fatalf("Load with an unknown context = %v", err)
		}
	})
	t.Run("no kubeconfig at all", func(t *testing.T) {
		t.Setenv("KUBECONFIG", "")
		homeFile(t, filepath.Join(dir, "nothing-here"))
		if _, err := Load("", ""); !errors.Is(err, ErrNoConfig) {
			t.Fatalf("Load without a kubeconfig = %v, want ErrNoConfig", err)
		}
	})
}

// TestFromFile: one file and nothing else; KUBECONFIG and ~/.kube/config are not read.
func TestFromFile(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.conf"), filepath.Join(dir, "b.conf")
	writeKubeconfig(t, a, "ctx-a", map[string]string{"ctx-a": "https://198.51.100.1"})
	writeKubeconfig(t, b, "ctx-b", map[string]string{"ctx-b": "https://198.51.100.2"})
	t.Setenv("KUBECONFIG", b)
	homeFile(t, b)
	cfg, err := FromFile(a)
	if got := host(t, cfg, err); got != "https://198.51.100.1" {
		t.Fatalf("host %s, want a's", got)
	}
	if _, err := FromFile(filepath.Join(dir, "missing.conf")); err == nil {
		t.Fatal("FromFile of a missing file succeeded")
	}
	if _, err := FromFile(""); !errors.Is(err, ErrNoPath) {
		t.Fatalf("FromFile(\"\") = %v, want ErrNoPath", err)
	}
}

// TestInClusterOrFile: a named file is read; without one, outside a pod, the in-cluster
// configuration is missing.
func TestInClusterOrFile(t *testing.T) {
	a := filepath.Join(t.TempDir(), "a.conf")
	writeKubeconfig(t, a, "ctx-a", map[string]string{"ctx-a": "https://198.51.100.1"})
	cfg, err := InClusterOrFile(a)
	if got := host(t, cfg, err); got != "https://198.51.100.1" {
		t.Fatalf("host %s", got)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")
	if _, err := InClusterOrFile(""); !errors.Is(err, rest.ErrNotInCluster) {
		t.Fatalf("InClusterOrFile(\"\") outside a pod = %v, want rest.ErrNotInCluster", err)
	}
}

// TestClientset: a valid configuration gives a client; an invalid one (a QPS without a Burst) an
// error that says what failed.
func TestClientset(t *testing.T) {
	if _, err := Clientset(&rest.Config{Host: "https://198.51.100.1"}); err != nil {
		t.Fatal(err)
	}
	_, err := Clientset(&rest.Config{Host: "https://198.51.100.1", QPS: 5})
	if err == nil || !strings.HasPrefix(err.Error(), "creating Kubernetes client: ") {
		t.Fatalf("Clientset with a QPS and no Burst = %v", err)
	}
}
