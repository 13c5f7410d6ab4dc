package berth

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// The docs check (TestDocReferences, run by make lint) reads every tracked Markdown file and the make
// files and reports:
//   - a Go test, benchmark or fuzz target named anywhere in them that is no func of a _test.go file;
//   - a `make TARGET` (in a Markdown code span or block, or in a make file's comment) that no make file
//     defines;
//   - clock times, commit hashes and issue numbers: a doc states facts, with the command that
//     produces its numbers, not when or in which commit someone saw them.
//
// A line that must keep such a string (a hex value in an example, a literal time in a format) carries
// the marker doccheck:allow (in Markdown as an HTML comment), which exempts it from the last three.

const docAllowMarker = "doccheck:allow"

var (
	// testNameRE matches a test, benchmark or fuzz target name; the capital after the prefix keeps out
	// words such as Testing and Fuzzing.
	testNameRE = regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z0-9_]\w*`)
	// testFuncRE finds the declarations those names must match.
	testFuncRE = regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)\w*)\(`)
	// makeCallRE matches a make invocation's first target (flags and VAR=value before it are skipped).
	makeCallRE = regexp.MustCompile(`\bmake((?:\s+(?:-\S+|[A-Z_][A-Z0-9_]*=\S*))*)\s+([a-z][a-z0-9_-]*)\b`)
	// makeRuleRE matches the targets of a rule (not a variable assignment).
	makeRuleRE = regexp.MustCompile(`(?m)^([a-zA-Z0-9_.%-]+(?:[ \t]+[a-zA-Z0-9_.%-]+)*)[ \t]*::?(?:[^=]|$)`)
	// codeSpanRE matches Markdown inline code.
	codeSpanRE = regexp.MustCompile("`[^`\n]+`")
	// clockRE matches a time of day: two-digit hours, not part of an address, port, version or ratio.
	clockRE = regexp.MustCompile(`(?:^|[^\w.:/-])((?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?:\s?UTC|Z)?)(?:[^\w:.]|$)`)
	// hashRE matches a commit hash: 7 to 12 hex digits (an abbreviation) or 40 (a full one), standing
	// alone; hashes must hold a digit and a letter (so words such as "deadbeef" or "decade" pass).
	hashRE = regexp.MustCompile(`(?:^|[^\w/.+:-])([0-9a-f]{7,12}|[0-9a-f]{40})(?:[^\w/+-]|$)`)
	// issueRE matches an issue or pull request number: "issue 12", "issues #3", "#12".
	issueRE = regexp.MustCompile(`(?i)\b(?:issues?|PR|pull request)\s+#?\d+\b|(?:^|[\s(\[])#\d+\b`)
)

// docFile is one file the check reads.
type docFile struct {
	path string
	text string
}

// markdown reports whether f is a Markdown file (else it is a make file).
func (f docFile) markdown() bool { return strings.HasSuffix(f.path, ".md") }

// docProblems returns one line per problem in f. tests and targets are what exists.
func docProblems(f docFile, tests, targets map[string]bool) []string {
	var out []string
	add := func(line int, format string, args ...any) {
		out = append(out, fmt.Sprintf("%s:%d: ", f.path, line)+fmt.Sprintf(format, args...))
	}
	inFence := false
	for i, line := range strings.Split(f.text, "\n") {
		n := i + 1
		// Where a make invocation counts: in Markdown, code spans and fenced blocks (prose says "make
		// sure"); in a make file, its comments and `## help` texts.
		var code []string
		if f.markdown() {
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				inFence = !inFence
				continue
			}
			if inFence {
				code = []string{line}
			} else {
				code = codeSpanRE.FindAllString(line, -1)
			}
		} else if c, ok := makeComment(line); ok {
			code = []string{c}
		}

		for _, loc := range testNameRE.FindAllStringIndex(line, -1) {
			name := line[loc[0]:loc[1]]
			// TestRoundTrip* in a doc, and a make file's -run pattern (go test matches it anywhere in
			// the name), stand for every test the name starts.
			prefix := strings.HasPrefix(line[loc[1]:], "*") || !f.markdown() && strings.Contains(line, "-run")
			if !tests[name] && (!prefix || !hasPrefix(tests, name)) {
				add(n, "%s is no Test, Benchmark or Fuzz func in any _test.go file", name)
			}
		}
		for _, c := range code {
			for _, m := range makeCallRE.FindAllStringSubmatch(c, -1) {
				if !targets[m[2]] {
					add(n, "make %s: no make file defines the target %s", m[2], m[2])
				}
			}
		}

		if strings.Contains(line, docAllowMarker) {
			continue
		}
		for _, m := range clockRE.FindAllStringSubmatch(line, -1) {
			add(n, "clock time %q: say what happens, not when someone saw it", m[1])
		}
		for _, m := range hashRE.FindAllStringSubmatch(line, -1) {
			if strings.ContainsAny(m[1], "0123456789") && strings.ContainsAny(m[1], "abcdef") {
				add(n, "commit hash %q: state the fact, or the command that shows it", m[1])
			}
		}
		for _, m := range issueRE.FindAllString(line, -1) {
			add(n, "issue number %q: the history is in git, the doc says what is", strings.TrimSpace(m))
		}
	}
	return out
}

// hasPrefix reports whether a name in names starts with prefix.
func hasPrefix(names map[string]bool, prefix string) bool {
	for n := range names {
		if strings.HasPrefix(n, prefix) {
			return true
		}
	}
	return false
}

// makeComment returns the comment of a make file line: a line that starts with #, or the help text
// after " ## " on a rule line. Recipe lines (a tab first) hold shell, not comments.
func makeComment(line string) (string, bool) {
	if strings.HasPrefix(line, "\t") {
		return "", false
	}
	if t := strings.TrimSpace(line); strings.HasPrefix(t, "#") {
		return t, true
	}
	if _, help, ok := strings.Cut(line, " ## "); ok {
		return help, true
	}
	return "", false
}

// trackedDocs returns the tracked Markdown files and make files below root.
func trackedDocs(root string) ([]docFile, error) {
	cmd := exec.Command("git", "ls-files", "-z", "--", "*.md", "Makefile", "mk/*.mk")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	raw, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("listing tracked files: %w: %s", err, stderr.String())
	}
	var out []docFile
	for _, p := range strings.Split(string(raw), "\x00") {
		if p == "" || strings.HasPrefix(p, "build/") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			return nil, err
		}
		out = append(out, docFile{path: p, text: string(b)})
	}
	return out, nil
}

// existingTests returns the names of every Test, Benchmark and Fuzz func in the module's _test.go
// files, whatever their build tags.
func existingTests(root string) (map[string]bool, error) {
	names := map[string]bool{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") || path == filepath.Join(root, "build") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range testFuncRE.FindAllSubmatch(b, -1) {
			names[string(m[1])] = true
		}
		return nil
	})
	return names, err
}

// makeTargets returns the targets the make files define.
func makeTargets(files []docFile) map[string]bool {
	targets := map[string]bool{}
	for _, f := range files {
		if f.markdown() {
			continue
		}
		for _, m := range makeRuleRE.FindAllStringSubmatch(f.text, -1) {
			for _, t := range strings.Fields(m[1]) {
				targets[t] = true
			}
		}
	}
	return targets
}

// TestDocReferences checks every tracked Markdown file and make file (see the top of this file).
func TestDocReferences(t *testing.T) {
	files, err := trackedDocs(".")
	if err != nil {
		t.Fatal(err)
	}
	tests, err := existingTests(".")
	if err != nil {
		t.Fatal(err)
	}
	targets := makeTargets(files)
	if len(files) == 0 || len(tests) == 0 || !targets["lint"] {
		t.Fatalf("read %d docs, %d test names, lint target %v: the check sees nothing", len(files), len(tests), targets["lint"])
	}
	var problems []string
	for _, f := range files {
		problems = append(problems, docProblems(f, tests, targets)...)
	}
	for _, p := range problems {
		t.Error(p)
	}
}

// mapEntries returns the paths the first column of the map's tables in CONTRIBUTING.md names: a
// path in backquotes, "x/..." for x and every package below it, "." for the module root.
func mapEntries(contributing string) []string {
	var out []string
	inMap := false
	for _, line := range strings.Split(contributing, "\n") {
		if strings.HasPrefix(line, "## ") {
			inMap = strings.HasPrefix(line, "## Map of the house")
			continue
		}
		if !inMap || !strings.HasPrefix(line, "| ") {
			continue
		}
		cells := strings.Split(line, "|")
		for _, span := range codeSpanRE.FindAllString(cells[1], -1) {
			out = append(out, strings.Trim(span, "`"))
		}
	}
	return out
}

// mapCovers reports whether entry names the package in dir (slash-separated, "." for the root).
func mapCovers(entry, dir string) bool {
	if base, ok := strings.CutSuffix(entry, "/..."); ok {
		return dir == base || strings.HasPrefix(dir, base+"/")
	}
	return strings.TrimSuffix(entry, "/") == dir
}

// packageDirs returns the directories of the module's packages (those holding .go files), outside
// nested modules, testdata and build/.
func packageDirs(root string) ([]string, error) {
	var out []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		if path != root {
			if strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || path == filepath.Join(root, "build") {
				return filepath.SkipDir
			}
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // another module (tools/)
			}
		}
		goFiles, err := filepath.Glob(filepath.Join(path, "*.go"))
		if err != nil {
			return err
		}
		if len(goFiles) > 0 {
			rel, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			out = append(out, filepath.ToSlash(rel))
		}
		return nil
	})
	return out, err
}

// mapProblems returns one line per package the map leaves out and per entry that names nothing.
func mapProblems(entries, dirs []string, exists func(string) bool) []string {
	var out []string
	for _, d := range dirs {
		if !slices.ContainsFunc(entries, func(e string) bool { return mapCovers(e, d) }) {
			out = append(out, fmt.Sprintf("CONTRIBUTING.md: package %s is in no row of the map: add one saying what it owns", d))
		}
	}
	for _, e := range entries {
		if !exists(strings.TrimSuffix(strings.TrimSuffix(e, "/..."), "/")) {
			out = append(out, fmt.Sprintf("CONTRIBUTING.md: the map names %s, which does not exist", e))
		}
	}
	return out
}

// TestDocMap checks that the map in CONTRIBUTING.md has a row for every package of the module and
// names nothing that is gone.
func TestDocMap(t *testing.T) {
	b, err := os.ReadFile("CONTRIBUTING.md")
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := packageDirs(".")
	if err != nil {
		t.Fatal(err)
	}
	entries := mapEntries(string(b))
	if len(dirs) == 0 || len(entries) == 0 {
		t.Fatalf("%d packages, %d map entries: the check sees nothing", len(dirs), len(entries))
	}
	isDir := func(p string) bool {
		fi, err := os.Stat(p)
		return err == nil && fi.IsDir()
	}
	for _, p := range mapProblems(entries, dirs, isDir) {
		t.Error(p)
	}
}

// TestDocMapCatch shows that the map check fails on a package without a row and on a row without a
// package.
func TestDocMapCatch(t *testing.T) {
	contributing := "# x\n## Map of the house\n| package | owns |\n|---|---|\n| `a`, `b/...` | x |\n| `.` (root) | y |\n| `gone` | z |\n## How to test\n| `c` | not the map |\n"
	entries := mapEntries(contributing)
	if want := []string{"a", "b/...", ".", "gone"}; !slices.Equal(entries, want) {
		t.Fatalf("mapEntries = %q, want %q", entries, want)
	}
	exists := func(p string) bool { return p != "gone" }
	got := mapProblems(entries, []string{".", "a", "b", "b/c", "c", "ab"}, exists)
	want := []string{
		"CONTRIBUTING.md: package c is in no row of the map: add one saying what it owns",
		"CONTRIBUTING.md: package ab is in no row of the map: add one saying what it owns",
		"CONTRIBUTING.md: the map names gone, which does not exist",
	}
	if !slices.Equal(got, want) {
		t.Errorf("mapProblems = %q, want %q", got, want)
	}
}

// TestDocReferencesCatch shows that the check fails on each kind of problem, and passes what only
// looks like one.
func TestDocReferencesCatch(t *testing.T) {
	tests := map[string]bool{"TestImportRules": true, "FuzzParse": true}
	targets := map[string]bool{"lint": true, "fuzz": true, "test-e2e": true}
	for _, tc := range []struct {
		name string
		file docFile
		want []string // each must appear in one problem, in this order; none means no problem
	}{
		{"unknown test", docFile{"README.md", "Run `go test -run TestCloudProviders ./...`."}, []string{"README.md:1: TestCloudProviders is no"}},
		{"unknown benchmark in prose", docFile{"a/README.md", "x\nBenchmarkJoin prints it"}, []string{"a/README.md:2: BenchmarkJoin"}},
		{"unknown fuzz target in a make file", docFile{"mk/fuzz.mk", "FUZZ := ./x:FuzzQuote"}, []string{"FuzzQuote"}},
		{"known names", docFile{"README.md", "`TestImportRules` and FuzzParse; Testing, Fuzzing, Benchmarks"}, nil},
		{"prefixes", docFile{"README.md", "`TestImport*` covers TestImport"}, []string{"README.md:1: TestImport is no"}},
		{"run pattern in a make file", docFile{"mk/x.mk", "\t$(GO) test -run 'TestImport|FuzzPar' .\n# TestImport"}, []string{"mk/x.mk:2: TestImport is no"}},
		{"unknown make target in a code span", docFile{"README.md", "run `make test-cloud` first"}, []string{"make test-cloud: no make file"}},
		{"unknown make target after variables", docFile{"README.md", "```\nsudo make -j2 FUZZ_TIME=10m fuzzall\n```"}, []string{"README.md:2: make fuzzall"}},
		{"unknown make target in a make comment", docFile{"mk/x.mk", "# run make bench-all for numbers"}, []string{"make bench-all"}},
		{"unknown make target in a help text", docFile{"Makefile", "x: ## like `make y`"}, []string{"make y"}},
		{"known make targets, prose, recipes", docFile{"Makefile", "# `make lint`, make fuzz FUZZ_TIME=1m\n\t$(MAKE) nothing; make sure\n"}, nil},
		{"make in Markdown prose", docFile{"README.md", "make sure to make tea"}, nil},
		{"clock time", docFile{"joinservice/README.md", "measured at 02:14 UTC on one core"}, []string{`clock time "02:14 UTC"`}},
		{"clock time with seconds", docFile{"README.md", "the run (14:03:59) took 9 s"}, []string{`clock time "14:03:59"`}},
		{"ports, addresses, versions, ratios", docFile{"README.md", "127.0.0.1:6443, [fd00::10]:9002, :8080, v1.34.2, 3:1, host:22, 1:30"}, nil},
		{"short commit hash", docFile{"README.md", "on main (9d8e8ec) with wc -l"}, []string{`commit hash "9d8e8ec"`}},
		{"full commit hash", docFile{"mk/x.mk", "# as of aba5bfde74d3ebf7ce4310591792acd4a156ecee"}, []string{"aba5bfde74d3ebf7ce4310591792acd4a156ecee"}},
		{"digests and words", docFile{"README.md", "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08, deadbeef, 1234567, facade, 0x1234abcd, e2e"}, nil},
		{"issue number in a make header", docFile{"mk/x.mk", "# Fuzzing (issue 20): every target"}, []string{`issue number "issue 20"`}},
		{"issue reference", docFile{"README.md", "fixed in #26"}, []string{`issue number "#26"`}},
		{"heading and anchor", docFile{"README.md", "## Metadata\nsee [x](#metadata-providers), ![b](https://example.com/badge#1)"}, nil},
		{"allowed line", docFile{"README.md", "`date -u +%H:%M` prints 02:14 <!-- doccheck:allow -->"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := docProblems(tc.file, tests, targets)
			if len(got) != len(tc.want) {
				t.Fatalf("docProblems(%q) = %q, want %d problems like %q", tc.file.text, got, len(tc.want), tc.want)
			}
			for i, w := range tc.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
				}
			}
		})
	}
	// The make targets of a make file are read from its rules, not from its variables.
	got := makeTargets([]docFile{{"mk/x.mk", ".PHONY: a\na b: c ## help\nX := y\nY ?= z\n%.o: %.c\n\tcd x && make q\n"}})
	var names []string
	for n := range got {
		names = append(names, n)
	}
	slices.Sort(names)
	if want := []string{"%.o", ".PHONY", "a", "b"}; !slices.Equal(names, want) {
		t.Errorf("makeTargets = %v, want %v", names, want)
	}
}
