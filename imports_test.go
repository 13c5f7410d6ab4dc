package berth

import (
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/berth-k8s/berth"

// importRules says which trees of the module may not import which. Test files count too: a test that
// needs the other daemon means a contract that belongs in internal/.
var importRules = []struct {
	from      string
	forbidden []string
	why       string
}{
	{"bootstrapper", []string{"joinservice"}, "the daemons share contracts through internal/ (joinconfig, joindial, berthsystem)"},
	{"joinservice", []string{"bootstrapper"}, "the daemons share contracts through internal/ (joinconfig, joindial, berthsystem)"},
	{"internal", []string{"bootstrapper", "joinservice"}, "internal/ serves the binaries and may not depend on one"},
}

// violations parses the imports of every .go file below root (all build tags, tests included) and
// returns one line per import that breaks a rule.
func violations(root string) ([]string, error) {
	var out []string
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != root && (strings.HasPrefix(name, ".") || name == "testdata") || path == filepath.Join(root, "build") {
				return filepath.SkipDir // build/ holds other modules (the upstream builds)
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly)
		if err != nil {
			return fmt.Errorf("parsing %s: %w", rel, err)
		}
		for _, rule := range importRules {
			if !strings.HasPrefix(rel, rule.from+"/") {
				continue
			}
			for _, spec := range f.Imports {
				imp, err := strconv.Unquote(spec.Path.Value)
				if err != nil {
					return fmt.Errorf("parsing %s: %w", rel, err)
				}
				if slices.ContainsFunc(rule.forbidden, func(tree string) bool {
					return imp == module+"/"+tree || strings.HasPrefix(imp, module+"/"+tree+"/")
				}) {
					out = append(out, fmt.Sprintf("%s imports %s: %s", rel, imp, rule.why))
				}
			}
		}
		return nil
	})
	return out, err
}

// TestImportRules fails when the bootstrapper imports the joinservice or the other way round, or when
// internal/ imports either.
func TestImportRules(t *testing.T) {
	bad, err := violations(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bad {
		t.Error(b)
	}
}

// TestImportRulesCatch shows the check can fail: a tree with one forbidden import of each kind.
func TestImportRulesCatch(t *testing.T) {
	root := t.TempDir()
	files := map[string]string{
		"joinservice/server/x.go":    "package server\nimport _ \"" + module + "/bootstrapper/joinclient\"\n",
		"bootstrapper/x_test.go":     "package bootstrapper\nimport _ \"" + module + "/joinservice\"\n",
		"internal/cli/x.go":          "//go:build ignore\n\npackage cli\nimport _ \"" + module + "/joinservice/ledger\"\n",
		"internal/ok/x.go":           "package ok\nimport _ \"" + module + "/internal/joinconfig\"\n",
		"joinservice/ok/x.go":        "package ok\nimport _ \"" + module + "/bootstrapperish\"\n",
		"bootstrapper/testdata/x.go": "package x\nimport _ \"" + module + "/joinservice\"\n",
	}
	for name, src := range files {
		p := filepath.Join(root, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bad, err := violations(root)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, b := range bad {
		got = append(got, strings.SplitN(b, ":", 2)[0])
	}
	slices.Sort(got)
	want := []string{
		"bootstrapper/x_test.go imports " + module + "/joinservice",
		"internal/cli/x.go imports " + module + "/joinservice/ledger",
		"joinservice/server/x.go imports " + module + "/bootstrapper/joinclient",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("violations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
