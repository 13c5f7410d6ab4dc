package image

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// DefaultLibDirs are the directories Debian's amd64 dynamic loader searches without an ld.so.cache.
var DefaultLibDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib"}

// ErrLibraryNotFound is returned when a needed shared library is in none of the search directories.
var ErrLibraryNotFound = errors.New("shared library not found")

// DynamicClosure returns bin plus everything the dynamic loader needs to run it: its ELF
// interpreter and, recursively, every DT_NEEDED library found in libDirs. Each file lands in the
// image at the path it has on the host. A static binary yields only itself.
func DynamicClosure(bin string, libDirs []string) ([]File, error) {
	files := []File{{Src: bin, Dst: bin}}
	seen := map[string]bool{bin: true}
	queue := []string{bin}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		interp, needed, err := elfDeps(cur)
		if err != nil {
			return nil, err
		}
		var next []string
		if interp != "" {
			next = append(next, interp)
		}
		for _, lib := range needed {
			p, err := findLib(lib, libDirs)
			if err != nil {
				return nil, fmt.Errorf("resolving %s needed by %s: %w", lib, cur, err)
			}
			next = append(next, p)
		}
		for _, p := range next {
			if seen[p] {
				continue
			}
			seen[p] = true
			files = append(files, File{Src: p, Dst: p, Mode: 0o755})
			queue = append(queue, p)
		}
	}
	return files, nil
}

func elfDeps(p string) (interp string, needed []string, err error) {
	f, err := elf.Open(p)
	if err != nil {
		return "", nil, fmt.Errorf("opening ELF %s: %w", p, err)
	}
	defer func() { _ = f.Close() }() // read only
	for _, prog := range f.Progs {
		if prog.Type != elf.PT_INTERP {
			continue
		}
		b := make([]byte, prog.Filesz)
		if _, err := prog.ReadAt(b, 0); err != nil {
			return "", nil, fmt.Errorf("reading interpreter of %s: %w", p, err)
		}
		for len(b) > 0 && b[len(b)-1] == 0 {
			b = b[:len(b)-1]
		}
		interp = string(b)
	}
	needed, err = f.ImportedLibraries()
	if err != nil {
		return "", nil, fmt.Errorf("reading needed libraries of %s: %w", p, err)
	}
	return interp, needed, nil
}

func findLib(lib string, dirs []string) (string, error) {
	for _, d := range dirs {
		p := filepath.Join(d, lib)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", ErrLibraryNotFound
}
