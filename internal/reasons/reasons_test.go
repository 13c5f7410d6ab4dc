package reasons

import (
	"bytes"
	"flag"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite REASONS.md")

// reasonConstRE finds an exported reason constant with a literal value: ReasonX = "CODE".
var reasonConstRE = regexp.MustCompile(`(?m)^\s*(?:const\s+)?(Reason[A-Z]\w*)\s*=\s*"([^"]+)"`)

// TestEveryReasonExplained: every exported Reason constant with a literal value in the repository's
// code has an entry, and every entry is a code some constant defines.
func TestEveryReasonExplained(t *testing.T) {
	defined := map[string]string{} // code -> where
	root := filepath.Join("..", "..")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", "build", "bin", ".tools", "node_modules":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range reasonConstRE.FindAllSubmatch(src, -1) {
			defined[string(m[2])] = path + ": " + string(m[1])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(defined) < 20 {
		t.Fatalf("found %d reason constants: the scan is broken", len(defined))
	}
	for code, where := range defined {
		if _, ok := Lookup(code); !ok {
			t.Errorf("%s (%s) has no entry in internal/reasons", code, where)
		}
	}
	for _, e := range catalog {
		if _, ok := defined[e.Code]; !ok {
			t.Errorf("entry %s: no reason constant defines this code", e.Code)
		}
	}
}

func TestCatalogSortedAndComplete(t *testing.T) {
	if !slices.IsSortedFunc(catalog, func(a, b Entry) int { return strings.Compare(a.Code, b.Code) }) {
		t.Error("the catalog is not sorted by code")
	}
	for i, e := range catalog {
		if i > 0 && catalog[i-1].Code == e.Code {
			t.Errorf("%s twice", e.Code)
		}
		for name, v := range map[string]string{"Where": e.Where, "Cause": e.Cause, "Check": e.Check, "Next": e.Next} {
			if strings.TrimSpace(v) == "" {
				t.Errorf("%s: %s is empty", e.Code, name)
			}
			if name != "Where" && !strings.HasSuffix(v, ".") {
				t.Errorf("%s: %s is no sentence: %q", e.Code, name, v)
			}
		}
	}
}

func TestLookup(t *testing.T) {
	e, ok := Lookup("REVOKED")
	if !ok || !strings.Contains(e.Next, "berth node readmit") {
		t.Fatalf("Lookup(REVOKED) = %+v, %v", e, ok)
	}
	if _, ok := Lookup("NO_SUCH_REASON"); ok {
		t.Error("an unknown code has an entry")
	}
	if Short("NO_SUCH_REASON") != "" {
		t.Error("an unknown code has a short form")
	}
	if s := Short("MEASUREMENT_MISMATCH"); !strings.Contains(s, "Next: ") {
		t.Errorf("Short = %q", s)
	}
}

// TestReferenceCurrent: REASONS.md is the table's reference (make reasons-docs rewrites it).
func TestReferenceCurrent(t *testing.T) {
	want := Reference()
	if *update {
		if err := os.WriteFile("REASONS.md", want, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	have, err := os.ReadFile("REASONS.md")
	if err != nil || !bytes.Equal(have, want) {
		t.Errorf("REASONS.md is stale (%v): run make reasons-docs and commit it", err)
	}
}
