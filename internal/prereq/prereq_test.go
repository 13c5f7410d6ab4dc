package prereq

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestMissing runs a test that calls Missing in a child process, once without and once with CI=true:
// it skips, then it fails, saying what is missing.
func TestMissing(t *testing.T) {
	if os.Getenv("PREREQ_CHILD") == "1" {
		Missing(t, "needs %s", "a frobnicator")
		t.Fatal("Missing returned")
	}
	for _, tc := range []struct {
		ci     string
		failed bool
		want   string
	}{
		{ci: "", want: "--- SKIP: TestMissing"},
		{ci: "false", want: "--- SKIP: TestMissing"},
		{ci: "true", failed: true, want: "--- FAIL: TestMissing"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestMissing$", "-test.v")
		cmd.Env = append(os.Environ(), "PREREQ_CHILD=1", CIEnv+"="+tc.ci)
		out, err := cmd.CombinedOutput()
		if (err != nil) != tc.failed || !strings.Contains(string(out), tc.want) || !strings.Contains(string(out), "needs a frobnicator") {
			t.Errorf("CI=%q: %v\n%s", tc.ci, err, out)
		}
	}
}
