package atomicfile

import (
	"errors"
	"io"
	"testing"

	"github.com/spf13/afero"
)

func TestWrite(t *testing.T) {
	fsys := afero.NewMemMapFs()
	if err := Write(fsys, "/a/b/file", []byte("one"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Write(fsys, "/a/b/file", []byte("two"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := afero.ReadFile(fsys, "/a/b/file")
	if err != nil || string(got) != "two" {
		t.Fatalf("content = %q, %v", got, err)
	}
	if ok, _ := afero.Exists(fsys, "/a/b/file.tmp"); ok {
		t.Fatal("temporary file left behind")
	}
	if err := Write(afero.NewReadOnlyFs(fsys), "/a/b/file", []byte("x"), 0o600); err == nil {
		t.Fatal("Write() on a read-only disk = nil")
	}
}

func TestWriteFromFailureKeepsTheOldFile(t *testing.T) {
	fsys := afero.NewMemMapFs()
	if err := Write(fsys, "/a/file", []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := WriteFrom(fsys, "/a/file", 0o600, func(w io.Writer) error {
		_, _ = w.Write([]byte("half"))
		return errors.New("source failed")
	})
	if err == nil {
		t.Fatal("WriteFrom() with a failing writer = nil")
	}
	if got, err := afero.ReadFile(fsys, "/a/file"); err != nil || string(got) != "old" {
		t.Fatalf("content = %q, %v, want the old one", got, err)
	}
	if ok, _ := afero.Exists(fsys, "/a/file.tmp"); ok {
		t.Fatal("temporary file left behind")
	}
}
