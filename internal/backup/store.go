package backup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

// Suffix ends every sealed snapshot's name.
const Suffix = ".berth-snapshot"

// namePrefix starts every sealed snapshot's name.
const namePrefix = "etcd-"

// nameLayout is the time in a snapshot's name: names sort by it.
const nameLayout = "20060102T150405.000Z"

// ErrBadName is returned for a name that is not a snapshot's (Name's form): no path, no other file.
var ErrBadName = errors.New("not a snapshot name")

// ErrNotFound is returned by Get for a snapshot the store does not hold.
var ErrNotFound = errors.New("no such snapshot")

// Name is the name of the snapshot taken at t: "etcd-" + UTC time to the millisecond + Suffix.
func Name(t time.Time) string { return namePrefix + t.UTC().Format(nameLayout) + Suffix }

// ParseName returns the time in a snapshot's name, or ErrBadName.
func ParseName(name string) (time.Time, error) {
	stamp, ok := strings.CutPrefix(name, namePrefix)
	if ok {
		stamp, ok = strings.CutSuffix(stamp, Suffix)
	}
	if !ok {
		return time.Time{}, fmt.Errorf("%w: %q", ErrBadName, name)
	}
	t, err := time.Parse(nameLayout, stamp)
	if err != nil {
		return time.Time{}, fmt.Errorf("%w: %q", ErrBadName, name)
	}
	return t, nil
}

// Object is one stored snapshot.
type Object struct {
	Name  string
	Taken time.Time
	Size  int64
}

// Store keeps sealed snapshots by name.
type Store interface {
	// Put stores the size bytes of r under name.
	Put(ctx context.Context, name string, r io.ReadSeeker, size int64) error
	// List returns the snapshots held, oldest first; other objects are left out.
	List(ctx context.Context) ([]Object, error)
	// Get opens the snapshot name, or returns ErrNotFound.
	Get(ctx context.Context, name string) (io.ReadCloser, error)
	// Delete removes the snapshot name.
	Delete(ctx context.Context, name string) error
	// String names the store in logs and errors.
	String() string
}

// Dir is a Store in a local directory (on a control plane, its state disk).
type Dir struct {
	Path string
	fs   afero.Fs
}

// NewDir returns the store in directory path.
func NewDir(path string) *Dir { return &Dir{Path: path, fs: afero.NewOsFs()} }

func (d *Dir) String() string { return "directory " + d.Path }

// Put writes the snapshot through a temporary file, so that a crash leaves the old state.
func (d *Dir) Put(_ context.Context, name string, r io.ReadSeeker, _ int64) error {
	if _, err := ParseName(name); err != nil {
		return err
	}
	return atomicfile.WriteFrom(d.fs, filepath.Join(d.Path, name), 0o600, func(w io.Writer) error {
		_, err := io.Copy(w, r)
		return err
	})
}

// List lists the directory's snapshots.
func (d *Dir) List(context.Context) ([]Object, error) {
	entries, err := os.ReadDir(d.Path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", d, err)
	}
	var out []Object
	for _, e := range entries {
		t, err := ParseName(e.Name())
		if err != nil || !e.Type().IsRegular() {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		out = append(out, Object{Name: e.Name(), Taken: t, Size: info.Size()})
	}
	sortObjects(out)
	return out, nil
}

// Get opens the snapshot name.
func (d *Dir) Get(_ context.Context, name string) (io.ReadCloser, error) {
	if _, err := ParseName(name); err != nil {
		return nil, err
	}
	f, err := os.Open(filepath.Join(d.Path, name))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s in %s", ErrNotFound, name, d)
	}
	return f, err
}

// Delete removes the snapshot name; one already gone is no error.
func (d *Dir) Delete(_ context.Context, name string) error {
	if _, err := ParseName(name); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(d.Path, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing %s from %s: %w", name, d, err)
	}
	return nil
}

func sortObjects(objs []Object) {
	slices.SortFunc(objs, func(a, b Object) int { return strings.Compare(a.Name, b.Name) })
}

// Prune deletes the oldest snapshots of s until keep remain; it returns the names deleted.
func Prune(ctx context.Context, s Store, keep int) ([]string, error) {
	objs, err := s.List(ctx)
	if err != nil {
		return nil, err
	}
	var gone []string
	for len(objs) > max(keep, 1) {
		if err := s.Delete(ctx, objs[0].Name); err != nil {
			return gone, err
		}
		gone = append(gone, objs[0].Name)
		objs = objs[1:]
	}
	return gone, nil
}
