// Command testsummary turns the output of `go test -json` into what plain `go test` prints (a line
// per package; the output of failed tests, in full) and records every skipped test with its reason,
// so that scripts/test.sh can list the skips at the end of a run: under CI nothing may skip silently.
// Lines that are not test2json events (make's command lines, `go test -v` output such as the e2e
// step's) pass through unchanged; a `--- SKIP:` line among them is recorded too.
//
//	go test -json ./... 2>&1 | go run ./scripts/testsummary -step test-unit -skips skips.tsv
//
// Each record is one line of the skips file: step, package, test and reason, separated by tabs.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
)

// event is a test2json event (go doc test2json).
type event struct {
	Action     string  `json:"Action"`
	Package    string  `json:"Package"`
	ImportPath string  `json:"ImportPath"`
	Test       string  `json:"Test"`
	Output     string  `json:"Output"`
	Elapsed    float64 `json:"Elapsed"`
}

// Skip is one skipped test.
type Skip struct {
	Step, Package, Test, Reason string
}

// summary consumes test output and writes the compact view.
type summary struct {
	out   io.Writer
	step  string
	skips []Skip
	// output buffers each running test's output (and each package's, under Test ""), by package
	// and test.
	output map[string]map[string][]string
	// plainReason is the last indented line of plain `go test -v` output: the reason of a skip
	// that follows it.
	plainReason string
}

func newSummary(out io.Writer, step string) *summary {
	return &summary{out: out, step: step, output: map[string]map[string][]string{}}
}

var plainSkip = regexp.MustCompile(`^\s*--- SKIP: (\S+)`)

// line handles one line of input.
func (s *summary) line(text string) {
	var ev event
	if !strings.HasPrefix(text, "{") || json.Unmarshal([]byte(text), &ev) != nil || ev.Action == "" {
		s.plain(text)
		return
	}
	s.event(ev)
}

// plain passes a line that is not an event through, recording a plain `--- SKIP:`.
func (s *summary) plain(text string) {
	_, _ = fmt.Fprintln(s.out, text)
	if m := plainSkip.FindStringSubmatch(text); m != nil {
		s.skips = append(s.skips, Skip{Step: s.step, Package: "-", Test: m[1], Reason: s.plainReason})
		s.plainReason = ""
		return
	}
	if strings.HasPrefix(text, "    ") {
		s.plainReason = strings.TrimSpace(text)
	}
}

func (s *summary) event(ev event) {
	switch ev.Action {
	case "build-output":
		_, _ = fmt.Fprint(s.out, ev.Output)
		return
	case "build-fail":
		return
	}
	tests := s.output[ev.Package]
	if tests == nil {
		tests = map[string][]string{}
		s.output[ev.Package] = tests
	}
	switch ev.Action {
	case "output":
		tests[ev.Test] = append(tests[ev.Test], ev.Output)
	case "pass":
		if ev.Test == "" {
			_, _ = fmt.Fprintf(s.out, "ok  \t%s\t%.3fs\n", ev.Package, ev.Elapsed)
			delete(s.output, ev.Package)
			return
		}
		delete(tests, ev.Test)
	case "skip":
		if ev.Test == "" {
			_, _ = fmt.Fprintf(s.out, "?   \t%s\t[no test files]\n", ev.Package)
			delete(s.output, ev.Package)
			return
		}
		reason := skipReason(tests[ev.Test])
		s.skips = append(s.skips, Skip{Step: s.step, Package: ev.Package, Test: ev.Test, Reason: reason})
		_, _ = fmt.Fprintf(s.out, "--- SKIP: %s (%s): %s\n", ev.Test, ev.Package, reason)
		delete(tests, ev.Test)
	case "fail":
		if ev.Test == "" {
			// What no test claimed (TestMain, a panic, a timeout) and tests that never ended.
			for test, lines := range tests {
				if test != "" {
					_, _ = fmt.Fprint(s.out, strings.Join(lines, ""))
				}
			}
			_, _ = fmt.Fprint(s.out, strings.Join(tests[""], ""))
			_, _ = fmt.Fprintf(s.out, "FAIL\t%s\t%.3fs\n", ev.Package, ev.Elapsed)
			delete(s.output, ev.Package)
			return
		}
		_, _ = fmt.Fprint(s.out, strings.Join(tests[ev.Test], ""))
		delete(tests, ev.Test)
	}
}

// skipReason is what a skipped test said: its output less the framework's lines.
func skipReason(lines []string) string {
	var reason []string
	for _, l := range lines {
		t := strings.TrimSpace(l)
		if t == "" || strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- SKIP") {
			continue
		}
		reason = append(reason, t)
	}
	if len(reason) == 0 {
		return "(no reason given)"
	}
	return strings.Join(reason, " | ")
}

// writeSkips appends the skips to path, one tab-separated line each.
func writeSkips(path string, skips []Skip) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("opening the skips file: %w", err)
	}
	for _, sk := range skips {
		clean := func(s string) string { return strings.NewReplacer("\t", " ", "\n", " ").Replace(s) }
		if _, err := fmt.Fprintf(f, "%s\t%s\t%s\t%s\n", clean(sk.Step), clean(sk.Package), clean(sk.Test), clean(sk.Reason)); err != nil {
			_ = f.Close()
			return fmt.Errorf("writing the skips file: %w", err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing the skips file: %w", err)
	}
	return nil
}

func run(in io.Reader, out io.Writer, step, skipsPath string) error {
	s := newSummary(out, step)
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		s.line(sc.Text())
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading test output: %w", err)
	}
	if skipsPath == "" {
		return nil
	}
	return writeSkips(skipsPath, s.skips)
}

func main() {
	step := flag.String("step", "-", "name of the step the output comes from, recorded with each skip")
	skips := flag.String("skips", "", "file to append the skipped tests to (step, package, test, reason; tab-separated)")
	flag.Parse()
	if err := run(os.Stdin, os.Stdout, *step, *skips); err != nil {
		_, _ = fmt.Fprintln(os.Stderr, "testsummary:", err)
		os.Exit(1)
	}
}
