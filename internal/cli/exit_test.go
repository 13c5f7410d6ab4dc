package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/version"
)

// TestCobraErrorsAreUsageErrors: whatever cobra refuses before a command runs is exit code 2, with
// a pointer to the command's help on stderr and nothing on stdout.
func TestCobraErrorsAreUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // in stderr
	}{
		{[]string{"frobnicate"}, `unknown command "frobnicate" for "berth"`},
		{[]string{"stauts"}, "Did you mean this?"},
		{[]string{"status", "--frob"}, "unknown flag: --frob"},
		{[]string{"status", "-x"}, "unknown shorthand flag: 'x'"},
		{[]string{"status", "--limit", "many"}, `invalid argument "many" for "--limit"`},
		{[]string{"status", "--timeout"}, "flag needs an argument"},
		{[]string{"status", "w1", "w2"}, "accepts at most 1 arg(s), received 2"},
		{[]string{"mini", "frobnicate"}, `unknown command "frobnicate" for "berth mini"`},
		{[]string{"policy", "frobnicate"}, `unknown command "frobnicate" for "berth policy"`},
		{[]string{"mini", "down", "extra"}, `unknown command "extra" for "berth mini down"`},
		{[]string{"init"}, "required flag(s)"},
		{[]string{"version", "-o", "xml"}, "unknown output format"},
		{[]string{"version", "--log-level", "loud"}, "unknown log level"},
	} {
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), tc.args, &out, &errOut)
		if code != exitUsage || !strings.Contains(errOut.String(), tc.want) || !strings.Contains(errOut.String(), "--help' for usage.") || out.Len() != 0 {
			t.Errorf("berth %s: exit %d, stdout %q, stderr %q; want exit %d and %q", strings.Join(tc.args, " "), code, out.String(), errOut.String(), exitUsage, tc.want)
		}
	}
}

// TestExitCodeOfFailures: an error from a command that ran is 1 unless it carries its own code.
func TestExitCodeOfFailures(t *testing.T) {
	var out, errOut bytes.Buffer
	// A directory is no policy file: the operator's input, exit 2 from the command itself.
	if code := Execute(context.Background(), []string{"policy", "check", "--policy", t.TempDir(), "--evidence", "x"}, &out, &errOut); code != exitUsage {
		t.Fatalf("policy check of a directory: exit %d; stderr %q", code, errOut.String())
	}
	// verify against a port nobody listens on: the work failed, exit 1, no usage hint.
	p, _ := writeUnattestedEvidence(t, t.TempDir())
	errOut.Reset()
	if code := Execute(context.Background(), []string{"verify", "--endpoint", "127.0.0.1:1", "--policy", p, "--timeout", "5s"}, &out, &errOut); code != exitFailure || strings.Contains(errOut.String(), "for usage") {
		t.Fatalf("verify of a closed port: exit %d, stderr %q", code, errOut.String())
	}
	// The context ending (SIGINT in cmd/berth) while a command fails is 130.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	errOut.Reset()
	if code := Execute(ctx, []string{"verify", "--endpoint", "127.0.0.1:1", "--policy", p}, &out, &errOut); code != exitInterrupted {
		t.Fatalf("verify with a cancelled context: exit %d, stderr %q", code, errOut.String())
	}
	for err, want := range map[error]int{
		usageErr("x"): exitUsage, &exitError{code: exitRejected, err: os.ErrNotExist}: exitRejected, os.ErrNotExist: exitFailure,
	} {
		if got := exitCode(err, true); got != want {
			t.Errorf("exitCode(%v, ran) = %d, want %d", err, got, want)
		}
	}
	if got := exitCode(os.ErrNotExist, false); got != exitUsage {
		t.Errorf("exitCode before the command ran = %d, want %d", got, exitUsage)
	}
}

// TestRootHelp documents the exit codes, and a group without a subcommand prints its help (exit 0).
func TestRootHelp(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {}} {
		var out, errOut bytes.Buffer
		if code := Execute(context.Background(), args, &out, &errOut); code != exitOK {
			t.Fatalf("berth %v: exit %d", args, code)
		}
		for _, want := range []string{"Exit codes:", "0    success", "1    failure", "2    usage", "3    rejected", "130  interrupted", "KUBECONFIG", "-o json|yaml", "Examples:", "version"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("berth %v lacks %q:\n%s", args, want, out.String())
			}
		}
	}
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"mini"}, &out, &errOut); code != exitOK || !strings.Contains(out.String(), "Available Commands:") {
		t.Fatalf("berth mini: exit %d\n%s%s", code, out.String(), errOut.String())
	}
}

// TestEveryCommandHasExamples walks the whole tree, hidden commands included.
func TestEveryCommandHasExamples(t *testing.T) {
	var walk func(*cobra.Command)
	n := 0
	walk = func(c *cobra.Command) {
		n++
		if strings.TrimSpace(c.Example) == "" {
			t.Errorf("%s has no Example", c.CommandPath())
		}
		for _, s := range c.Commands() {
			walk(s)
		}
	}
	walk(NewRootCmd())
	if n < 12 {
		t.Fatalf("walked only %d commands", n)
	}
}

func TestVersion(t *testing.T) {
	defer func(c, d string) { version.GitCommit, version.BuildDate = c, d }(version.GitCommit, version.BuildDate)
	version.GitCommit, version.BuildDate = "0123456789abcdef", "2026-11-21T06:00:00Z"
	want := versionReport{Version: version.Version, GitCommit: "0123456789abcdef", BuildDate: "2026-11-21T06:00:00Z",
		GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	for _, format := range []string{"json", "yaml"} {
		code, out, _ := runSplit("version", "-o", format)
		var got versionReport
		var err error
		if format == "json" {
			err = json.Unmarshal([]byte(out), &got)
		} else {
			err = yaml.UnmarshalStrict([]byte(out), &got)
		}
		if code != exitOK || err != nil || got != want {
			t.Fatalf("version -o %s: exit %d, %v: %+v, want %+v\n%s", format, code, err, got, want, out)
		}
		var raw map[string]any
		_ = yaml.Unmarshal([]byte(out), &raw)
		for _, k := range []string{"version", "gitCommit", "buildDate", "goVersion", "platform"} {
			if _, ok := raw[k]; !ok {
				t.Errorf("version -o %s lacks %q", format, k)
			}
		}
	}
	code, out, _ := runSplit("version")
	for _, want := range []string{"berth " + version.Version, "git commit: 0123456789abcdef", "build date: 2026-11-21T06:00:00Z", "go version: " + runtime.Version(), "platform:   " + runtime.GOOS} {
		if code != exitOK || !strings.Contains(out, want) {
			t.Errorf("berth version: exit %d, lacks %q:\n%s", code, want, out)
		}
	}
}

// TestUseClusterLines: the printed commands put berth and kubectl on PATH only when the shell
// would not find these ones, and quote what needs quoting.
func TestUseClusterLines(t *testing.T) {
	dir := t.TempDir()
	self := filepath.Join(dir, "bin", "berth")
	if err := os.MkdirAll(filepath.Dir(self), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(self, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	orig := lookPath
	defer func() { lookPath = orig }()
	found := map[string]string{}
	lookPath = func(name string) (string, error) {
		if p, ok := found[name]; ok {
			return p, nil
		}
		return "", os.ErrNotExist
	}
	got := strings.Join(useClusterLines(self, "/var/cache/berth/k8s-v1.34.2-abc/bin", "/var/lib/berth mini/admin.conf"), "\n")
	want := "export KUBECONFIG='/var/lib/berth mini/admin.conf'\nexport PATH=" + filepath.Dir(self) + ":/var/cache/berth/k8s-v1.34.2-abc/bin:$PATH\nberth status\nkubectl get nodes"
	if got != want {
		t.Fatalf("nothing on PATH:\n%s\nwant\n%s", got, want)
	}
	found["berth"], found["kubectl"] = self, "/usr/bin/kubectl"
	got = strings.Join(useClusterLines(self, "/k8s/bin", "/var/lib/berth-mini/admin.conf"), "\n")
	if got != "export KUBECONFIG=/var/lib/berth-mini/admin.conf\nberth status\nkubectl get nodes" {
		t.Fatalf("both on PATH:\n%s", got)
	}
	// Another berth first on PATH: this one must come first.
	found["berth"] = "/usr/local/bin/berth"
	if got := useClusterLines(self, "/k8s/bin", "/a"); len(got) != 4 || got[1] != "export PATH="+filepath.Dir(self)+":$PATH" {
		t.Fatalf("another berth on PATH: %q", got)
	}
}
