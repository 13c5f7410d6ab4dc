package cli

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/workspace"
)

const configHead = "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\ninitSecretFile: secret\n"

// writeConfig writes a config and its init secret into dir and returns the config's path.
func writeConfig(t *testing.T, dir, name, text string) string {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "secret"), []byte("00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// countingListener accepts connections on loopback and counts them until the test ends.
func countingListener(t *testing.T) (string, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return ln.Addr().String(), &n
}

// TestInitRefusesBadConfigBeforeContact: berth init --config with a malformed configuration exits
// 2 naming the field, before it writes a master secret or contacts the node; the same command with
// a valid configuration does contact it (so the count could see a contact).
func TestInitRefusesBadConfigBeforeContact(t *testing.T) {
	for name, tc := range map[string]struct{ text, want string }{
		"unknown field": {configHead + "apiServer: {extraArg: [{name: v, value: '2'}]}\n", `unknown field "apiServer.extraArg"`},
		"wrong type":    {configHead + "kubelet: {maxPods: lots}\n", "kubelet.maxPods: wrong type: got string, want int32"},
		"PodSecurity":   {configHead + "apiServer: {admission: {plugins: [{name: PodSecurity, configuration: {defaults: {enforce: privileged}}}]}}\n", "apiServer.admission.plugins[0].name: Forbidden"},
		"unversioned":   {"clusterName: c\ninitSecretFile: secret\nkubelet: {maxPods: 3}\n", `unknown field "kubelet"`},
		"image policy":  {configHead + "policies: {imagePolicyFile: bad-images.yaml}\n", `invalid image policy: apiVersion "config.berth.dev/v9"`},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			path := writeConfig(t, dir, "bad.yaml", tc.text)
			if err := os.WriteFile(filepath.Join(dir, "bad-images.yaml"), []byte("apiVersion: config.berth.dev/v9\nkind: ImagePolicy\nrules: []\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			endpoint, contacts := countingListener(t)
			ws := filepath.Join(dir, "ws")
			var out, errOut bytes.Buffer
			code := Execute(context.Background(), []string{"init", "--endpoint", endpoint, "--config", path, "--workspace", ws,
				"--insecure-skip-attestation", "--connect-timeout", "2s"}, &out, &errOut)
			named := path // the file at fault: the config, or the image policy it names
			if name == "image policy" {
				named = filepath.Join(dir, "bad-images.yaml")
			}
			if code != exitUsage || !strings.Contains(errOut.String(), tc.want) || !strings.Contains(errOut.String(), named) {
				t.Errorf("exit %d, stderr %q; want exit %d naming %s and %q", code, errOut.String(), exitUsage, named, tc.want)
			}
			if _, err := os.Stat(filepath.Join(ws, workspace.MasterSecret)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a master secret was written: %v", err)
			}
			if n := contacts.Load(); n != 0 {
				t.Errorf("berth init contacted the node %d times", n)
			}
		})
	}
	t.Run("valid config contacts the node", func(t *testing.T) {
		dir := t.TempDir()
		path := writeConfig(t, dir, "good.yaml", configHead+"kubelet: {maxPods: 42}\n")
		endpoint, contacts := countingListener(t)
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), []string{"init", "--endpoint", endpoint, "--config", path, "--workspace", filepath.Join(dir, "ws"),
			"--insecure-skip-attestation", "--connect-timeout", "2s"}, &out, &errOut)
		if code == exitOK || contacts.Load() == 0 {
			t.Errorf("exit %d after %d contacts, stderr %q; want a failed init that reached the listener", code, contacts.Load(), errOut.String())
		}
	})
}

// TestConfigValidate: validate accepts a valid file, names the field of a bad one (exit 2), warns
// about an unversioned one and checks the files the configuration names.
func TestConfigValidate(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct {
		text       string
		code       int
		want, warn string
	}{
		"valid":        {configHead + "kubeProxy: {mode: nftables}\n", exitOK, "a valid config.berth.dev/v1alpha1 ClusterConfiguration", ""},
		"unversioned":  {"clusterName: c\ninitSecretFile: secret\n", exitOK, "a valid", "no apiVersion and kind"},
		"wrong type":   {configHead + "featureGates: {A: maybe}\n", exitUsage, "featureGates: wrong type: got string, want bool", ""},
		"missing file": {configHead + "policies: {imagePolicyFile: absent.yaml}\n", exitUsage, "policies.imagePolicyFile: reading", ""},
	} {
		path := writeConfig(t, dir, strings.ReplaceAll(name, " ", "-")+".yaml", tc.text)
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), []string{"config", "validate", path}, &out, &errOut)
		if code != tc.code || !strings.Contains(out.String()+errOut.String(), tc.want) || !strings.Contains(errOut.String(), tc.warn) {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit %d and %q", name, code, out.String(), errOut.String(), tc.code, tc.want)
		}
	}
}

// TestConfigShow: show prints the effective configuration with its defaults, in the versioned
// form, also for an unversioned file.
func TestConfigShow(t *testing.T) {
	dir := t.TempDir()
	path := writeConfig(t, dir, "old.yaml", "clusterName: c\nserviceCIDR: 10.100.0.0/16\ninitSecretFile: secret\n")
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"config", "show", path}, &out, &errOut); code != exitOK {
		t.Fatalf("exit %d, stderr %q", code, errOut.String())
	}
	for _, want := range []string{"apiVersion: config.berth.dev/v1alpha1\n", "kind: ClusterConfiguration\n", "serviceSubnet: 10.100.0.0/16\n",
		"podSubnet: 10.244.0.0/16\n", "kubernetesVersion: " + clusterconfig.DefaultKubernetesVersion + "\n", "initSecretFile: secret\n"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("show lacks %q:\n%s", want, out.String())
		}
	}
}

// TestConfigDiff: diff is empty against the configuration the cluster keeps, shows a changed
// field and exits 1 otherwise, and says so when the cluster keeps none.
func TestConfigDiff(t *testing.T) {
	dir := t.TempDir()
	path := writeConfig(t, dir, "c.yaml", configHead+"kubelet: {maxPods: 42}\npolicies: {imagePolicyFile: secret}\n")
	stored, err := readConfigAsWritten(path, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	cm, err := clusterconfig.ConfigMap(stored)
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(cm)
	ctx := context.Background()
	fromCluster, err := storedConfig(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := diffConfigs(&out, fromCluster, stored, path); err != nil || out.Len() != 0 {
		t.Errorf("diff of the same configuration = %v:\n%s", err, out.String())
	}
	changed := stored
	k := *stored.Kubelet
	k.MaxPods = 43
	changed.Kubelet = &k
	out.Reset()
	err = diffConfigs(&out, fromCluster, changed, path)
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != exitFailure || !strings.Contains(out.String(), "-  maxPods: 42\n") || !strings.Contains(out.String(), "+  maxPods: 43\n") {
		t.Errorf("diff of a changed configuration = %v:\n%s", err, out.String())
	}
	if _, err := storedConfig(ctx, fake.NewClientset()); !errors.Is(err, ErrNoStoredConfig) {
		t.Errorf("storedConfig without the ConfigMap = %v", err)
	}
	bad := &corev1.ConfigMap{}
	cm.DeepCopyInto(bad)
	bad.Data[clusterconfig.ConfigMapKey] += "bogus: 1\n"
	if _, err := storedConfig(ctx, fake.NewClientset(bad)); !errors.Is(err, clusterconfig.ErrInvalid) {
		t.Errorf("storedConfig of a bad ConfigMap = %v", err)
	}
}

// TestStatusShowsClusterConfigVersion: berth status names the kept configuration's apiVersion,
// escaping what the cluster holds.
func TestStatusShowsClusterConfigVersion(t *testing.T) {
	cm, err := clusterconfig.ConfigMap(clusterconfig.Default())
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, fake.NewClientset(cm), "berth-system", 0, outputText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Cluster configuration: config.berth.dev/v1alpha1 ClusterConfiguration, Kubernetes "+clusterconfig.DefaultKubernetesVersion) {
		t.Errorf("status:\n%s", out.String())
	}
	cm.Data[clusterconfig.ConfigMapKey] = "apiVersion: \"config.berth.dev/v9\\e[2J\"\nkind: ClusterConfiguration\n"
	out.Reset()
	if err := runStatus(context.Background(), &out, fake.NewClientset(cm), "berth-system", 0, outputText); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "\x1b") || !strings.Contains(out.String(), "config.berth.dev/v9") {
		t.Errorf("status of a later version:\n%q", out.String())
	}
	out.Reset()
	if err := runStatus(context.Background(), &out, fake.NewClientset(), "berth-system", 0, outputJSON); err != nil || strings.Contains(out.String(), "clusterConfig") {
		t.Errorf("status -o json without the ConfigMap = %v:\n%s", err, out.String())
	}
}
