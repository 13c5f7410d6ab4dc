package cli

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// berth init refuses a config whose Kubernetes version Berth does not build, or names only a minor,
// before it dials the node, and lists the supported versions; a supported exact version loads.
func TestInitChecksKubernetesVersion(t *testing.T) {
	dir := t.TempDir()
	config := func(version string) string {
		p := filepath.Join(dir, "init-"+strings.ReplaceAll(version, "/", "_")+".yaml")
		body := "kubernetesVersion: " + version + "\ninitSecret: 00112233445566778899aabbccddeeff\n"
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for version, want := range map[string][]string{
		"v1.34.2": {"kubernetesVersion: Unsupported value", "v1.37.2", "v1.36.3"},
		"v1.35.0": {"kubernetesVersion: Unsupported value", "v1.37.2", "v1.36.3"},
		"v1.36":   {"kubernetesVersion", "must be of the form v1.MINOR.PATCH"},
	} {
		var out, errOut bytes.Buffer
		// Port 1 on loopback: were the version let through, init would fail dialing, with another message.
		code := Execute(context.Background(), []string{"init", "--endpoint", "127.0.0.1:1", "--connect-timeout", "1s",
			"--insecure-skip-attestation", "--workspace", filepath.Join(dir, "ws"), "--config", config(version)}, &out, &errOut)
		if code != exitUsage {
			t.Errorf("init with kubernetesVersion %s: exit %d (stderr %q), want %d", version, code, errOut.String(), exitUsage)
		}
		for _, w := range want {
			if !strings.Contains(errOut.String(), w) {
				t.Errorf("init with kubernetesVersion %s: stderr %q lacks %q", version, errOut.String(), w)
			}
		}
	}
	for _, version := range []string{"v1.37.2", "v1.36.3"} {
		if _, _, err := loadInitConfig(config(version), io.Discard); err != nil {
			t.Errorf("loadInitConfig at %s: %v", version, err)
		}
	}
}
