package image

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/berth-k8s/berth/internal/prereq"
)

func TestBuildAndArchive(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "prog")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho hi\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	spec := Spec{Tag: "berth.local/test:v1", Files: []File{{Src: bin, Dst: "/usr/local/bin/prog"}}, Entrypoint: []string{"/usr/local/bin/prog"}}
	archive := filepath.Join(dir, "images.tar")
	if err := WriteArchive(archive, []Spec{spec, {Tag: "registry.k8s.io/pause:3.10.1", Files: []File{{Src: bin, Dst: "/pause"}}}}); err != nil {
		t.Fatal(err)
	}
	tag, _ := name.NewTag("berth.local/test:v1")
	img, err := tarball.ImageFromPath(archive, &tag)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Architecture != "amd64" || cfg.OS != "linux" || cfg.Config.Entrypoint[0] != "/usr/local/bin/prog" || cfg.Config.Env[0] != defaultPath {
		t.Errorf("config = %+v", cfg.Config)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers = %d, %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
	}
	for _, want := range []string{"usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/prog", "tmp/"} {
		if got[want] == nil {
			t.Errorf("layer lacks %s (has %v)", want, got)
		}
	}
	if h := got["tmp/"]; h != nil && h.Mode != 0o1777 {
		t.Errorf("/tmp mode = %o", h.Mode)
	}
	// Equal inputs give equal digests.
	a, _ := Build(spec)
	b, _ := Build(spec)
	da, _ := a.Digest()
	db, _ := b.Digest()
	if da != db {
		t.Errorf("digests differ: %s %s", da, db)
	}
}

func TestBuildRejects(t *testing.T) {
	if _, err := Build(Spec{Tag: "UPPER:bad tag"}); err == nil {
		t.Error("bad tag accepted")
	}
	if _, err := layerBytes([]File{{Src: "/x", Dst: "rel"}}); err == nil {
		t.Error("relative destination accepted")
	}
	if _, err := layerBytes([]File{{Src: "/x", Dst: "/a"}, {Src: "/y", Dst: "/a"}}); err == nil {
		t.Error("duplicate destination accepted")
	}
}

func TestDynamicClosure(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The test binary itself is a fine ELF input: static or not, it must come first.
	files, err := DynamicClosure(self, DefaultLibDirs)
	if err != nil {
		t.Fatal(err)
	}
	if files[0].Src != self {
		t.Errorf("first file = %s", files[0].Src)
	}
	const nft = "/usr/sbin/nft"
	if _, err := os.Stat(nft); err != nil {
		prereq.Missing(t, "nft not installed (apt package nftables)")
	}
	files, err = DynamicClosure(nft, DefaultLibDirs)
	if err != nil {
		t.Fatal(err)
	}
	var names bytes.Buffer
	for _, f := range files {
		names.WriteString(filepath.Base(f.Dst) + " ")
	}
	for _, want := range []string{"libnftables.so.1", "libc.so.6", "ld-linux-x86-64.so.2", "libmnl.so.0"} {
		if !bytes.Contains(names.Bytes(), []byte(want)) {
			t.Errorf("closure of nft lacks %s: %s", want, names.String())
		}
	}
	if _, err := DynamicClosure(nft, []string{t.TempDir()}); !errors.Is(err, ErrLibraryNotFound) {
		t.Errorf("closure without libraries = %v, want ErrLibraryNotFound", err)
	}
}
