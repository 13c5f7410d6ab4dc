package berth

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path"
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
	{"bootstrapper", []string{"joinservice"}, "the daemons share through internal/: the contract floor (contractFloor) and shared code such as joindial"},
	{"joinservice", []string{"bootstrapper"}, "the daemons share through internal/: the contract floor (contractFloor) and shared code such as joindial"},
	{"internal", []string{"bootstrapper", "joinservice"}, "internal/ serves the binaries and may not depend on one"},
}

// contractFloor lists the contract packages: what Berth's binaries (the two daemons, the CLI, the
// webhook) agree on, each owned by one package. Every name, key, port, annotation or environment
// variable that two of them share is defined in one of these and used from it on both sides.
//
// The floor stands on its own: a non-test file of a floor package imports no implementation package.
// An implementation package is every package of this module that is neither in contractFloor nor in
// floorLibraries: it carries out a procedure of a binary (a daemon's parts, the CLI's commands, the
// installers, the attestation variants, the KMS plugin, ...), and a contract that imported one would
// drag that procedure into every binary that reads the contract, and could change when the procedure
// does. Test files of the floor may import anything: they check a contract against its
// implementations (berthsystem's tests install its objects into a real API server).
//
// joindial and atls are shared by both daemons but are no contract: they implement the join
// protocol's client side and attested TLS.
var contractFloor = []string{
	"internal/joinconfig",    // names in berth-system, the joinservice's ports and environment, Node annotations, the join ConfigMap and cluster Secret
	"internal/webhookconfig", // the image-policy webhook's object names and its paused annotation
	"internal/berthsystem",   // the objects of berth-system, the joinservice's DaemonSet and RBAC
	"internal/joinledger",    // the join ledger's format
	"internal/machines",      // the machine record's format
	"internal/kmsstate",      // the control planes' KMS key spec and reports
	"internal/clusterkeys",   // every key derived from the master secret, with its HKDF label
	"joinproto",              // the Join protocol
	"initproto",              // the Init protocol
	"recoverproto",           // the Recovery protocol
	// The record API (records.berth.dev): its CRDs, types, generated typed client and apply configurations.
	"internal/records",
	"internal/records/v1alpha1",
	"internal/records/clientset",
	"internal/records/clientset/scheme",
	"internal/records/clientset/typed/records/v1alpha1",
	"internal/records/applyconfiguration",
	"internal/records/applyconfiguration/internal",
	"internal/records/applyconfiguration/records/v1alpha1",
}

// floorLibraries are the packages of this module the floor may import besides itself: mechanisms
// with no procedure of a binary in them, which import no package of this module but each other (the
// test checks that too, so nothing reaches the floor through them).
var floorLibraries = []string{
	"internal/configmapkey", // changing one key of a ConfigMap several writers share (joinledger, machines)
	"internal/apply",        // turning typed apply configurations into objects (berthsystem)
	"internal/kubeclient",   // loading a Kubernetes client's configuration (apply)
}

const (
	whyFloor   = "the contract floor imports only contract packages and floor libraries (imports_test.go: contractFloor, floorLibraries)"
	whyLibrary = "a floor library imports no package of the module but another floor library (imports_test.go: floorLibraries)"
)

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
		out = append(out, floorViolations(rel, f.Imports)...)
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

// floorViolations returns one line per import of the file rel (slash-separated, relative to the
// module root) that breaks the contract floor: a floor package's non-test file importing an
// implementation package, or a floor library's non-test file importing any package of the module.
func floorViolations(rel string, imports []*ast.ImportSpec) []string {
	if strings.HasSuffix(rel, "_test.go") {
		return nil
	}
	dir := path.Dir(rel)
	floor, library := slices.Contains(contractFloor, dir), slices.Contains(floorLibraries, dir)
	if !floor && !library {
		return nil
	}
	var out []string
	for _, spec := range imports {
		imp, err := strconv.Unquote(spec.Path.Value)
		if err != nil {
			continue // the parser accepted it, so it is a valid string literal
		}
		pkg, ok := strings.CutPrefix(imp, module+"/")
		switch {
		case !ok:
		case library && !slices.Contains(floorLibraries, pkg):
			out = append(out, fmt.Sprintf("%s imports %s: %s", rel, imp, whyLibrary))
		case !slices.Contains(contractFloor, pkg) && !slices.Contains(floorLibraries, pkg):
			out = append(out, fmt.Sprintf("%s imports %s: %s", rel, imp, whyFloor))
		}
	}
	return out
}

// TestImportRules fails when the bootstrapper imports the joinservice or the other way round, when
// internal/ imports either, when a contract package imports an implementation package, or when a
// floor library imports a package of the module.
func TestImportRules(t *testing.T) {
	for _, dir := range append(slices.Clone(contractFloor), floorLibraries...) {
		if files, _ := filepath.Glob(filepath.Join(filepath.FromSlash(dir), "*.go")); len(files) == 0 {
			t.Errorf("%s is listed in contractFloor or floorLibraries but holds no Go package", dir)
		}
	}
	bad, err := violations(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bad {
		t.Error(b)
	}
}

// TestImportRulesCatch shows the check can fail: a tree with one forbidden import of each kind, next to
// allowed ones.
func TestImportRulesCatch(t *testing.T) {
	root := t.TempDir()
	files := map[string]string{
		"joinservice/server/x.go":    "package server\nimport _ \"" + module + "/bootstrapper/joinclient\"\n",
		"bootstrapper/x_test.go":     "package bootstrapper\nimport _ \"" + module + "/joinservice\"\n",
		"internal/cli/x.go":          "//go:build ignore\n\npackage cli\nimport _ \"" + module + "/joinservice/ledger\"\n",
		"internal/ok/x.go":           "package ok\nimport _ \"" + module + "/internal/joinconfig\"\n",
		"joinservice/ok/x.go":        "package ok\nimport _ \"" + module + "/bootstrapperish\"\n",
		"bootstrapper/testdata/x.go": "package x\nimport _ \"" + module + "/joinservice\"\n",
		// The contract floor: an implementation package is forbidden, also behind a build tag; floor
		// packages and floor libraries are not, and neither is anything in a test file.
		"internal/berthsystem/x.go":      "//go:build ignore\n\npackage berthsystem\nimport _ \"" + module + "/internal/webhook/install\"\n",
		"internal/kmsstate/x.go":         "package kmsstate\nimport (\n_ \"" + module + "/internal/joinconfig\"\n_ \"" + module + "/internal/kmsplugin\"\n)\n",
		"internal/joinledger/x.go":       "package joinledger\nimport (\n_ \"" + module + "/internal/configmapkey\"\n_ \"" + module + "/joinproto\"\n_ \"k8s.io/client-go/kubernetes\"\n)\n",
		"internal/berthsystem/x_test.go": "package berthsystem\nimport _ \"" + module + "/internal/apiservertest\"\n",
		// A floor library imports nothing of the module, not even the floor.
		"internal/configmapkey/x.go": "package configmapkey\nimport _ \"" + module + "/internal/joinconfig\"\n",
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
		"internal/berthsystem/x.go imports " + module + "/internal/webhook/install",
		"internal/cli/x.go imports " + module + "/joinservice/ledger",
		"internal/configmapkey/x.go imports " + module + "/internal/joinconfig",
		"internal/kmsstate/x.go imports " + module + "/internal/kmsplugin",
		"joinservice/server/x.go imports " + module + "/bootstrapper/joinclient",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("violations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
