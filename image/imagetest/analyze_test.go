package imagetest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/prereq"
)

// systemdAnalyze returns the path of systemd-analyze or skips the test.
func systemdAnalyze(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("systemd-analyze")
	if err != nil {
		prereq.Missing(t, "systemd-analyze is not installed (Debian package systemd): cannot verify units")
	}
	return p
}

// verify runs systemd-analyze verify offline against the tree. It needs no running systemd: with
// --root it loads units, drop-ins and the binaries they name from the tree. Warnings (unknown keys,
// values it ignores) do not change its exit status, so any output counts as a failure.
func verify(t *testing.T, analyze, root string, units ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(analyze, append([]string{"verify", "--root=" + root, "--man=no"}, units...)...)
	cmd.Env = append(os.Environ(), "SYSTEMD_LOG_COLOR=0", "SYSTEMD_PAGER=")
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func TestSystemdAnalyzeVerify(t *testing.T) {
	root := imageRoot(t)
	analyze := systemdAnalyze(t)
	for _, unit := range append(berthUnits, "containerd.service") {
		out, err := verify(t, analyze, root, unit)
		if err != nil || out != "" {
			t.Errorf("systemd-analyze verify %s: %v\n%s", unit, err, out)
		}
	}
}

// TestSystemdAnalyzeVerifyCatchesBrokenUnit shows the harness above fails on the faults it is meant
// to catch, with the same tree and flags.
func TestSystemdAnalyzeVerifyCatchesBrokenUnit(t *testing.T) {
	root := imageRoot(t)
	analyze := systemdAnalyze(t)
	src, err := os.ReadFile(filepath.Join("..", "mkosi.extra", "usr", "lib", "systemd", "system", "berth-bootstrapper.service"))
	if err != nil {
		t.Fatal(err)
	}
	for name, edit := range map[string][2]string{
		"missing binary": {"ExecStart=/usr/bin/bootstrapper", "ExecStart=/usr/bin/berth-not-in-image"},
		"misspelt key":   {"RestartSec=10s", "RestartSecs=10s"},
		"bad value":      {"Type=notify", "Type=notfiy"},
	} {
		t.Run(name, func(t *testing.T) {
			broken := strings.Replace(string(src), edit[0], edit[1], 1)
			if broken == string(src) {
				t.Fatalf("%q not found in the unit", edit[0])
			}
			p := filepath.Join(t.TempDir(), "berth-broken.service")
			if err := os.WriteFile(p, []byte(broken), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := verify(t, analyze, root, p)
			if err == nil && out == "" {
				t.Errorf("systemd-analyze verify accepted a unit with %s", name)
			}
		})
	}
}
