// Package atomicfile writes files so that a reader, or the next boot after a crash, sees either the
// old content or the new one, never a part: write a temporary file beside the target, fsync it, then
// rename it over the target.
package atomicfile

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/spf13/afero"
)

// Write writes data to path on fsys with mode, creating the parent directory (mode 0700) if needed.
func Write(fsys afero.Fs, path string, data []byte, mode os.FileMode) error {
	return WriteFrom(fsys, path, mode, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// WriteFrom writes what write produces to path on fsys with mode, creating the parent directory
// (mode 0700) if needed: for content too large to hold in memory. When write fails, path is left
// as it was and the temporary file is removed.
func WriteFrom(fsys afero.Fs, path string, mode os.FileMode, write func(io.Writer) error) error {
	if err := fsys.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("creating directory of %s: %w", path, err)
	}
	tmp := path + ".tmp"
	f, err := fsys.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, mode)
	if err != nil {
		return fmt.Errorf("creating %s: %w", tmp, err)
	}
	if err := write(f); err != nil {
		f.Close()
		_ = fsys.Remove(tmp)
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		_ = fsys.Remove(tmp)
		return fmt.Errorf("syncing %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		_ = fsys.Remove(tmp)
		return fmt.Errorf("closing %s: %w", tmp, err)
	}
	if err := fsys.Rename(tmp, path); err != nil {
		return fmt.Errorf("renaming %s: %w", tmp, err)
	}
	return nil
}
