// Package atomicfile writes files so that a reader, or the next boot after a crash, sees either the
// old content or the new one, never a part: write a temporary file beside the target, fsync it, then
// rename it over the target.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/afero"
)

// Write writes data to path on fsys with mode, creating the parent directory (mode 0700) if needed.
func Write(fsys afero.Fs, path string, data []byte, mode os.FileMode) error {
	if err := fsys.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("creating directory of %s: %w", path, err)
	}
	tmp := path + ".tmp"
	f, err := fsys.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, mode)
	if err != nil {
		return fmt.Errorf("creating %s: %w", tmp, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("syncing %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("closing %s: %w", tmp, err)
	}
	if err := fsys.Rename(tmp, path); err != nil {
		return fmt.Errorf("renaming %s: %w", tmp, err)
	}
	return nil
}
