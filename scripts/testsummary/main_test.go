package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestRealGoTest runs `go test -json -v` on a package made here (one passing, one skipped, one
// failing test, and one skipped in plain -v output) through the summary: the failure's output and
// the package lines are shown, passing tests' logs are not, and both skips are recorded with their
// reasons.
func TestRealGoTest(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module example.com/sample\n\ngo 1.22\n")
	write("sample_test.go", `package sample

import "testing"

func TestPass(t *testing.T) { t.Log("passing chatter") }
func TestSkip(t *testing.T) { t.Skip("needs a frobnicator") }
func TestFail(t *testing.T) { t.Log("the evidence"); t.Fatal("broken") }
`)
	cmd := exec.Command("go", "test", "-json", "-count=1", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=", "GOWORK=off")
	jsonOut, _ := cmd.Output() // exits 1: TestFail
	plain := "=== RUN   TestE2E\n    e2e_test.go:9: needs root\n--- SKIP: TestE2E (0.00s)\nPASS\n"
	in := "go test -json ./...\n" + string(jsonOut) + plain

	skips := filepath.Join(dir, "skips.tsv")
	var out bytes.Buffer
	if err := run(strings.NewReader(in), &out, "test-unit", skips); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	t.Logf("summary:\n%s", got)
	for _, want := range []string{"go test -json ./...", "the evidence", "broken", "FAIL\texample.com/sample", "--- SKIP: TestSkip (example.com/sample)",
		"--- SKIP: TestE2E (0.00s)"} {
		if !strings.Contains(got, want) {
			t.Errorf("summary lacks %q", want)
		}
	}
	if strings.Contains(got, "passing chatter") {
		t.Error("a passing test's log is shown")
	}
	recorded, err := os.ReadFile(skips)
	if err != nil {
		t.Fatal(err)
	}
	want := "test-unit\texample.com/sample\tTestSkip\tsample_test.go:6: needs a frobnicator\n" +
		"test-unit\t-\tTestE2E\te2e_test.go:9: needs root\n"
	if string(recorded) != want {
		t.Errorf("skips file\n%q\nwant\n%q", recorded, want)
	}
}

func TestPassingPackage(t *testing.T) {
	in := `{"Action":"start","Package":"p"}
{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"=== RUN   TestA\n"}
{"Action":"output","Package":"p","Test":"TestA","Output":"    a_test.go:3: chatter\n"}
{"Action":"pass","Package":"p","Test":"TestA","Elapsed":0.1}
{"Action":"output","Package":"p","Output":"ok  \tp\t0.1s\n"}
{"Action":"pass","Package":"p","Elapsed":0.2}
{"Action":"skip","Package":"q"}
`
	var out bytes.Buffer
	if err := run(strings.NewReader(in), &out, "s", ""); err != nil {
		t.Fatal(err)
	}
	if got := out.String(); got != "ok  \tp\t0.200s\n?   \tq\t[no test files]\n" {
		t.Fatalf("summary %q", got)
	}
}
