package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMiniNeedsRoot(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 1000 }
	defer func() { geteuid = orig }()
	for _, sub := range []string{"up", "down", "restart", "add", "stop"} {
		var out, errOut bytes.Buffer
		args := []string{"mini", sub, "--dir", t.TempDir()}
		if sub == "stop" {
			args = append(args, "w1") // stop needs a node name before it checks for root
		}
		code := Execute(context.Background(), args, &out, &errOut)
		if code != exitUsage || !strings.Contains(errOut.String(), "berth mini needs root") {
			t.Errorf("mini %s as non-root: code %d, stderr %q", sub, code, errOut.String())
		}
	}
}

func TestMiniHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"mini", "up", "--help"}, &out, &errOut); code != exitOK {
		t.Fatalf("help exit code %d: %s", code, errOut.String())
	}
	for _, want := range []string{"--workers", "--control-planes", "--tampered-workers", "--no-bootstrap", "--attestation", "berth mini down",
		"--kubernetes-version", "v1.37.2 (default), v1.36.3"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("mini up --help lacks %q", want)
		}
	}
}

func TestMiniUpRejectsBadFlags(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 0 }
	defer func() { geteuid = orig }()
	for _, args := range [][]string{
		{"--subnet", "not-a-prefix"},
		{"--name", "Bad-Name"},
		{"--attestation", "magic", "--no-bootstrap"},
		{"--workers", "-1"},
		// Nodes mount their own /var/lib/berth: they could not see a cluster directory inside it.
		{"--dir", "/var/lib/berth/mini", "--no-bootstrap"},
	} {
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), append([]string{"mini", "up", "--dir", t.TempDir()}, args...), &out, &errOut)
		if code != exitUsage {
			t.Errorf("mini up %v: code %d (stderr %q), want usage error", args, code, errOut.String())
		}
	}
}

// An unsupported Kubernetes version is a usage error that lists the supported ones, before anything
// is built or created; the version is quoted, so a control character in it never reaches a terminal.
func TestMiniUpRejectsUnsupportedKubernetesVersion(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 0 }
	defer func() { geteuid = orig }()
	for _, v := range []string{"v1.34.2", "v1.35", "1.37", "v1.37.2\x1b[2J"} {
		var out, errOut bytes.Buffer
		dir := filepath.Join(t.TempDir(), "cluster")
		code := Execute(context.Background(), []string{"mini", "up", "--dir", dir, "--no-bootstrap", "--build-script", "/nonexistent", "--kubernetes-version", v}, &out, &errOut)
		if code != exitUsage {
			t.Errorf("--kubernetes-version %q: code %d (stderr %q), want usage error", v, code, errOut.String())
		}
		for _, want := range []string{"unsupported Kubernetes version", "v1.37.2", "v1.36.3"} {
			if !strings.Contains(errOut.String(), want) {
				t.Errorf("--kubernetes-version %q: stderr %q lacks %q", v, errOut.String(), want)
			}
		}
		if strings.ContainsRune(errOut.String(), '\x1b') {
			t.Errorf("--kubernetes-version %q: stderr carries a control character", v)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("--kubernetes-version %q: the cluster directory was created (%v)", v, err)
		}
	}
}

func TestMiniRestartHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"mini", "restart", "--help"}, &out, &errOut); code != exitOK {
		t.Fatalf("help exit code %d: %s", code, errOut.String())
	}
	for _, want := range []string{"restart [NODE...]", "--tamper-boot", "--genuine-boot", "--clear-tpm", "--no-wait", "--ready-timeout"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("mini restart --help lacks %q", want)
		}
	}
}

// writeMiniState writes the state file of a (not running) 1+2 cluster in dir.
func writeMiniState(t *testing.T, dir string) {
	t.Helper()
	st := `{"config": {"name": "t", "dir": "` + dir + `", "subnet": "198.51.100.0/24", "podCIDR": "10.244.0.0/16",
"serviceCIDR": "10.96.0.0/12", "controlPlanes": 1, "workers": 2}}`
	if err := os.WriteFile(filepath.Join(dir, "state.json"), []byte(st), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestMiniRestartRejectsUnknownNodes(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 0 }
	defer func() { geteuid = orig }()
	dir := t.TempDir()
	writeMiniState(t, dir)
	for _, args := range [][]string{
		{"w9"},
		{"w1", "--tamper-boot", "w2"},
		{"w1", "--clear-tpm", "cp1,w1"},
		{"--genuine-boot", "nope"},
	} {
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), append([]string{"mini", "restart", "--dir", dir}, args...), &out, &errOut)
		if code != exitUsage {
			t.Errorf("mini restart %v: code %d (stderr %q), want usage error", args, code, errOut.String())
		}
	}
}

func TestMiniAdd(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"mini", "add", "--help"}, &out, &errOut); code != exitOK {
		t.Fatalf("help exit code %d: %s", code, errOut.String())
	}
	for _, want := range []string{"--workers", "--control-planes", "--dir", "--no-wait", "--ready-timeout"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("mini add --help lacks %q", want)
		}
	}
	orig := geteuid
	geteuid = func() int { return 0 }
	defer func() { geteuid = orig }()
	dir := t.TempDir()
	writeMiniState(t, dir)
	for _, args := range [][]string{{}, {"--workers", "-1"}, {"--workers", "0", "--control-planes", "0"}} {
		out.Reset()
		errOut.Reset()
		code := Execute(context.Background(), append([]string{"mini", "add", "--dir", dir}, args...), &out, &errOut)
		if code != exitUsage {
			t.Errorf("mini add %v: code %d (stderr %q), want usage error", args, code, errOut.String())
		}
	}
}

func TestMiniStopRefusesBadArgs(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 0 }
	defer func() { geteuid = orig }()
	dir := t.TempDir()
	writeMiniState(t, dir)
	for _, args := range [][]string{{}, {"w9"}} {
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), append([]string{"mini", "stop", "--dir", dir}, args...), &out, &errOut)
		if code != exitUsage {
			t.Errorf("mini stop %v: code %d (stderr %q), want usage error", args, code, errOut.String())
		}
	}
}
