package initconfig

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func write(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestLoad: defaults fill what the file leaves out, relative paths resolve against the config's
// directory, absolute ones stay, and the init secret comes from the file it names.
func TestLoad(t *testing.T) {
	dir := t.TempDir()
	write(t, filepath.Join(dir, "secret"), " 00112233445566778899aabbccddeeff\n")
	path := filepath.Join(dir, "cluster.yaml")
	write(t, path, "clusterName: c1\ninitSecretFile: secret\nattestationPolicyFile: p/policy.yaml\njoinPolicyFile: /abs/join.yaml\ncomponents: {skipCoreDNS: true, imagePolicyFile: images.yaml}\n")
	cfg, secret, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	want.ClusterName = "c1"
	want.InitSecretFile = filepath.Join(dir, "secret")
	want.AttestationPolicyFile = filepath.Join(dir, "p/policy.yaml")
	want.JoinPolicyFile = "/abs/join.yaml"
	want.Components = Components{SkipCoreDNS: true, ImagePolicyFile: filepath.Join(dir, "images.yaml")}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("Load = %+v, want %+v", cfg, want)
	}
	if !bytes.Equal(secret, []byte{0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff}) {
		t.Errorf("secret = %x", secret)
	}
}

// TestLoadErrors: each refusal names what is wrong, as berth init prints it.
func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct{ text, want string }{
		"unknown field": {"clusterName: c\nbogus: 1\n", "parsing config"},
		"both secrets":  {"initSecret: 00112233445566778899aabbccddeeff\ninitSecretFile: s\n", "set initSecret or initSecretFile, not both"},
		"no secret":     {"clusterName: c\n", "no initSecret or initSecretFile"},
		"short secret":  {"initSecret: 0011\n", "the init secret must be at least 16 bytes, hex-encoded"},
		"not hex":       {"initSecret: zz112233445566778899aabbccddeeff\n", "the init secret must be at least 16 bytes, hex-encoded"},
		"missing file":  {"initSecretFile: nowhere\n", "reading init secret file"},
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		write(t, path, tc.text)
		if _, _, err := Load(path); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Load = %v, want an error containing %q", name, err, tc.want)
		}
	}
	if _, _, err := Load(filepath.Join(dir, "absent.yaml")); err == nil || !strings.HasPrefix(err.Error(), "reading config: ") {
		t.Errorf("absent config: Load = %v", err)
	}
}

// TestMarshalRoundTrips: what Marshal writes, Read reads back unchanged.
func TestMarshalRoundTrips(t *testing.T) {
	dir := t.TempDir()
	in := Config{ClusterName: "x", KubernetesVersion: "v1.2.3", ServiceCIDR: "10.0.0.0/16", PodCIDR: "10.1.0.0/16",
		APIServerCertSANs: []string{"192.0.2.1"}, InitSecretFile: "/s", AttestationPolicyFile: "/p", JoinPolicyFile: "/j",
		Components: Components{SkipKubeProxy: true, ImagePolicyFile: "/i"}}
	data, err := Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "c.yaml")
	write(t, path, string(data))
	out, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(out, in) {
		t.Errorf("Read(Marshal(c)) = %+v, want %+v", out, in)
	}
}

// TestReadFile: nothing for no file, the path in the error of a missing one.
func TestReadFile(t *testing.T) {
	if data, err := ReadFile(""); data != nil || err != nil {
		t.Errorf(`ReadFile("") = %q, %v`, data, err)
	}
	if _, err := ReadFile("/nonexistent/x"); err == nil || !strings.HasPrefix(err.Error(), "reading /nonexistent/x: ") {
		t.Errorf("ReadFile(missing) = %v", err)
	}
}
