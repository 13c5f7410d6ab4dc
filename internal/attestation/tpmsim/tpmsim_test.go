package tpmsim

import (
	"os/exec"
	"strings"
	"testing"
)

// TestReleaseCannotReachSimulator checks the build-tag fence: no non-test package imports tpmsim,
// and with -tags berthrelease nothing in the module links the simulator.
func TestReleaseCannotReachSimulator(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list over the module")
	}
	out, err := exec.Command("go", "list", "-e", "-f", "{{.ImportPath}}: {{join .Imports \" \"}}", "github.com/berth-k8s/berth/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		pkg, imports, _ := strings.Cut(line, ": ")
		if strings.Contains(" "+imports+" ", " github.com/berth-k8s/berth/internal/attestation/tpmsim ") {
			t.Errorf("%s imports the TPM simulator outside tests", pkg)
		}
	}
	out, err = exec.Command("go", "list", "-e", "-tags", "berthrelease", "-deps", "github.com/berth-k8s/berth/...").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	if strings.Contains(string(out), "github.com/google/go-tpm-tools/simulator\n") {
		t.Error("a berthrelease build links the TPM simulator")
	}
}
