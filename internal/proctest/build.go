package proctest

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// Runner is what TestMain runs: *testing.M, or a wrapper of it such as goleak's or Main's.
type Runner interface{ Run() int }

// builds are the binaries Build made for this test binary, in dir.
var builds struct {
	mu     sync.Mutex
	inMain bool // TestMain runs the tests through Main
	dir    string
	bins   map[string]*build
}

type build struct {
	once sync.Once
	path string
	err  error
}

type mainRunner struct{ m Runner }

// Main wraps m so that the binaries Build made are removed after the tests ran. A test binary whose
// tests call Build runs them through it.
func Main(m Runner) Runner { return mainRunner{m} }

func (r mainRunner) Run() int {
	builds.mu.Lock()
	builds.inMain = true
	builds.mu.Unlock()
	code := r.m.Run()
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if builds.dir != "" {
		_ = os.RemoveAll(builds.dir)
	}
	builds.dir, builds.bins = "", nil
	return code
}

// Build builds the main package pkg (an import path, or a directory relative to the test's package)
// with env added to the go command's environment, once per test binary, and returns the binary.
func Build(t testing.TB, pkg string, env ...string) string {
	t.Helper()
	b, err := buildFor(pkg, env)
	if err != nil {
		t.Fatal(err)
	}
	b.once.Do(func() { b.err = goBuild(b.path, pkg, env) })
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// buildFor returns the build of pkg with env, creating the directory and the entry on first use.
func buildFor(pkg string, env []string) (*build, error) {
	builds.mu.Lock()
	defer builds.mu.Unlock()
	if !builds.inMain {
		return nil, fmt.Errorf("building %s: TestMain must run the tests through proctest.Main, which removes the binaries", pkg)
	}
	if builds.dir == "" {
		dir, err := os.MkdirTemp("", "berth-proctest-")
		if err != nil {
			return nil, fmt.Errorf("building %s: %w", pkg, err)
		}
		builds.dir, builds.bins = dir, map[string]*build{}
	}
	key := pkg + "\x00" + strings.Join(env, "\x00")
	b, ok := builds.bins[key]
	if !ok {
		name := path.Base(filepath.ToSlash(pkg))
		if name == "." || name == "/" {
			wd, err := os.Getwd()
			if err != nil {
				return nil, fmt.Errorf("building %s: %w", pkg, err)
			}
			name = filepath.Base(wd)
		}
		// One directory per build: the binary keeps the package's name.
		dir := filepath.Join(builds.dir, fmt.Sprint(len(builds.bins)))
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, fmt.Errorf("building %s: %w", pkg, err)
		}
		b = &build{path: filepath.Join(dir, name)}
		builds.bins[key] = b
	}
	return b, nil
}

func goBuild(out, pkg string, env []string) error {
	cmd := exec.Command("go", "build", "-o", out, pkg) //nolint:noctx // a build runs to completion; the test's timeout bounds it
	cmd.Env = append(os.Environ(), env...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building %s: %w\n%s", pkg, err, b)
	}
	return nil
}
