// Package image assembles the container images of Berth's mini cluster from binaries built on this
// machine, with go-containerregistry, and writes them into one docker-archive tar that `ctr images
// import` loads into a node's containerd. Nothing here talks to a registry.
package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

// File is one file copied from the host into an image.
type File struct {
	// Src is the host path; symlinks are followed, the image gets a regular file.
	Src string
	// Dst is the absolute path inside the image.
	Dst string
	// Mode is the file mode in the image; 0 means 0o755.
	Mode int64
}

// Spec describes one image.
type Spec struct {
	// Tag is the full image reference the image is stored under, e.g. registry.k8s.io/pause:3.10.1.
	Tag        string
	Files      []File
	Entrypoint []string
	Env        []string
}

// defaultPath is the PATH every image gets unless its Env sets one.
const defaultPath = "PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin"

// epoch is the fixed timestamp of every file and image, so that equal inputs give equal digests.
var epoch = time.Unix(0, 0).UTC()

// Build assembles the image spec describes: one layer holding its files (with their parent
// directories and a world-writable /tmp), linux/amd64, entrypoint and environment set.
func Build(spec Spec) (v1.Image, error) { return build(spec, "") }

// build is Build with the uncompressed layer kept in a file under scratch (when set) instead of
// memory, so that an archive of many large images needs little memory.
func build(spec Spec, scratch string) (v1.Image, error) {
	if _, err := name.NewTag(spec.Tag, name.StrictValidation); err != nil {
		return nil, fmt.Errorf("parsing tag %q: %w", spec.Tag, err)
	}
	layerTar, err := layerBytes(spec.Files)
	if err != nil {
		return nil, fmt.Errorf("building layer of %s: %w", spec.Tag, err)
	}
	opener := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil }
	if scratch != "" {
		f, err := os.CreateTemp(scratch, "layer-*.tar")
		if err != nil {
			return nil, fmt.Errorf("creating layer file of %s: %w", spec.Tag, err)
		}
		_, werr := f.Write(layerTar)
		if err := errors.Join(werr, f.Close()); err != nil {
			return nil, fmt.Errorf("writing layer file of %s: %w", spec.Tag, err)
		}
		path := f.Name()
		layerTar = nil
		opener = func() (io.ReadCloser, error) { return os.Open(path) }
	}
	layer, err := tarball.LayerFromOpener(opener, tarball.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		return nil, fmt.Errorf("creating layer of %s: %w", spec.Tag, err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, fmt.Errorf("appending layer of %s: %w", spec.Tag, err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("reading config of %s: %w", spec.Tag, err)
	}
	cfg = cfg.DeepCopy()
	cfg.Architecture = "amd64"
	cfg.OS = "linux"
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint = spec.Entrypoint
	cfg.Config.Env = spec.Env
	if !hasPath(spec.Env) {
		cfg.Config.Env = append([]string{defaultPath}, spec.Env...)
	}
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return nil, fmt.Errorf("setting config of %s: %w", spec.Tag, err)
	}
	return img, nil
}

func hasPath(env []string) bool {
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			return true
		}
	}
	return false
}

// layerBytes returns an uncompressed tar with files, every parent directory and /tmp.
func layerBytes(files []File) ([]byte, error) {
	dirs := map[string]bool{"tmp": true}
	byDst := map[string]File{}
	for _, f := range files {
		if !path.IsAbs(f.Dst) {
			return nil, fmt.Errorf("image path %q is not absolute", f.Dst)
		}
		dst := strings.TrimPrefix(path.Clean(f.Dst), "/")
		if _, dup := byDst[dst]; dup {
			return nil, fmt.Errorf("image path %q given twice", f.Dst)
		}
		byDst[dst] = f
		for d := path.Dir(dst); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range sortedKeys(dirs) {
		mode := int64(0o755)
		if d == "tmp" {
			mode = 0o1777
		}
		hdr := &tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: mode, ModTime: epoch, Format: tar.FormatPAX}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("writing directory %s: %w", d, err)
		}
	}
	for _, dst := range sortedKeys(byDst) {
		f := byDst[dst]
		data, err := os.ReadFile(f.Src)
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", f.Src, err)
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o755
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: dst, Mode: mode, Size: int64(len(data)), ModTime: epoch, Format: tar.FormatPAX}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("writing header of %s: %w", dst, err)
		}
		if _, err := tw.Write(data); err != nil {
			return nil, fmt.Errorf("writing %s: %w", dst, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("closing tar: %w", err)
	}
	return buf.Bytes(), nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// WriteArchive builds every spec and writes all images into one docker-archive tar at path,
// through a temporary file renamed into place, so a reader never sees a partial archive.
func WriteArchive(path string, specs []Spec) error {
	scratch, err := os.MkdirTemp(filepath.Dir(path), ".layers-")
	if err != nil {
		return fmt.Errorf("creating scratch directory: %w", err)
	}
	defer func() { _ = os.RemoveAll(scratch) }() // best effort: a leftover is a hidden directory next to path
	refs := make(map[name.Reference]v1.Image, len(specs))
	for _, s := range specs {
		img, err := build(s, scratch)
		if err != nil {
			return err
		}
		tag, err := name.NewTag(s.Tag, name.StrictValidation)
		if err != nil {
			return fmt.Errorf("parsing tag %q: %w", s.Tag, err)
		}
		refs[tag] = img
	}
	err = atomicfile.WriteFrom(afero.NewOsFs(), path, 0o644, func(w io.Writer) error {
		return tarball.MultiRefWrite(refs, w)
	})
	if err != nil {
		return fmt.Errorf("writing image archive: %w", err)
	}
	return nil
}
