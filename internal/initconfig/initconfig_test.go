package initconfig

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/clusterconfig"
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
	write(t, path, "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\nclusterName: c1\ninitSecretFile: secret\n"+
		"policies: {attestationPolicyFile: p/policy.yaml, joinPolicyFile: /abs/join.yaml, imagePolicyFile: images.yaml}\ncomponents: {skipCoreDNS: true}\n")
	cfg, secret, warnings, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 0 {
		t.Errorf("warnings = %q", warnings)
	}
	want := clusterconfig.Default()
	want.ClusterName = "c1"
	want.InitSecretFile = filepath.Join(dir, "secret")
	want.Policies = clusterconfig.Policies{AttestationPolicyFile: filepath.Join(dir, "p/policy.yaml"), JoinPolicyFile: "/abs/join.yaml", ImagePolicyFile: filepath.Join(dir, "images.yaml")}
	want.Components = clusterconfig.Components{SkipCoreDNS: true}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("Load = %+v, want %+v", cfg, want)
	}
	if !bytes.Equal(secret, []byte{0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff}) {
		t.Errorf("secret = %x", secret)
	}
}

// TestLoadUnversioned: the unversioned file of earlier releases still loads, with a warning.
func TestLoadUnversioned(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "cluster.yaml")
	write(t, path, "clusterName: c1\ninitSecret: 00112233445566778899aabbccddeeff\nattestationPolicyFile: p.yaml\ncomponents: {imagePolicyFile: i.yaml}\n")
	cfg, secret, warnings, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 1 || len(secret) != 16 || cfg.Policies.AttestationPolicyFile != filepath.Join(dir, "p.yaml") || cfg.Policies.ImagePolicyFile != filepath.Join(dir, "i.yaml") {
		t.Errorf("Load = %+v, %x, %q", cfg, secret, warnings)
	}
}

// TestLoadErrors: each refusal names what is wrong, as berth init prints it.
func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct {
		text, want string
		is         error
	}{
		"unknown field": {"clusterName: c\nbogus: 1\n", `unknown field "bogus"`, clusterconfig.ErrInvalid},
		"invalid value": {"apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\nnetworking: {podSubnet: x}\n", "networking.podSubnet", clusterconfig.ErrInvalid},
		"both secrets":  {"initSecret: 00112233445566778899aabbccddeeff\ninitSecretFile: s\n", "set initSecret or initSecretFile, not both", ErrInitSecret},
		"no secret":     {"clusterName: c\n", "no initSecretFile", ErrInitSecret},
		"short secret":  {"initSecret: \"0011\"\n", "it must be at least 16 bytes, hex-encoded", ErrInitSecret},
		"not hex":       {"initSecret: zz112233445566778899aabbccddeeff\n", "it must be at least 16 bytes, hex-encoded", ErrInitSecret},
		"missing file":  {"initSecretFile: nowhere\n", "reading init secret file", os.ErrNotExist},
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		write(t, path, tc.text)
		if _, _, _, err := Load(path); !errors.Is(err, tc.is) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Load = %v, want an error containing %q", name, err, tc.want)
		}
	}
	if _, _, _, err := Load(filepath.Join(dir, "absent.yaml")); err == nil || !strings.HasPrefix(err.Error(), "reading config: ") {
		t.Errorf("absent config: Load = %v", err)
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
