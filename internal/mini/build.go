package mini

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/berth-k8s/berth/internal/mini/image"
)

// BuildOptions say how Build makes what a mini cluster starts from.
type BuildOptions struct {
	// Script builds the upstream binaries and prints one bin dir per component (scripts/build-k8s.sh);
	// "" means DefaultBuildScript(Self).
	Script string
	// Cache is the build and image cache (the script's BERTH_CACHE).
	Cache string
	// Self is the berth binary: Berth's own binaries (joinservice, berth-webhook) lie beside it.
	Self string
	// Berth also builds the archive of Berth's own images (the cluster runs bootstrappers).
	Berth bool
	// Log receives the build script's progress (its stderr).
	Log io.Writer
	// Progress is told the time of each phase: build, image-archive.
	Progress func(Phase)
	// Note is told, one line each, what the cluster will lack (a missing joinservice or webhook).
	Note func(string)
}

// buildComponents are the components the build script builds, in the order it prints their bin dirs.
var buildComponents = []string{"k8s", "etcd", "coredns", "flannel", "podbin"}

// DefaultBuildScript is the build script of the checkout holding the berth binary self
// (self/../../scripts/build-k8s.sh, as make build lays it out), else the one under the current
// directory.
func DefaultBuildScript(self string) string {
	if s := filepath.Join(filepath.Dir(self), "..", "scripts", "build-k8s.sh"); fileExists(s) {
		return s
	}
	return filepath.Join("scripts", "build-k8s.sh")
}

// Build makes everything cfg needs before Up, cached where it can be, and records it in cfg: the
// upstream binaries at cfg's Kubernetes release (cfg.Bins), the archive of their images and the containerd root holding them
// (cfg.ImageArchive, cfg.GoldenRoot), and with o.Berth the archive of Berth's own images
// (cfg.BerthArchive, cfg.WebhookImage when a berth-webhook binary lies beside o.Self). Berth's
// archive lies in a temporary directory under o.Cache; the returned function removes it.
func Build(ctx context.Context, cfg *Config, o BuildOptions) (cleanup func(), err error) {
	t0 := time.Now()
	script := o.Script
	if script == "" {
		script = DefaultBuildScript(o.Self)
	}
	release := cfg.Release()
	bins, err := BuildBins(ctx, script, o.Cache, release.Kubernetes, o.Log)
	if err != nil {
		return nil, err
	}
	cfg.Bins = bins
	o.Progress(Phase{Name: "build", Duration: time.Since(t0)})

	t0 = time.Now()
	archive, err := EnsureImageArchive(o.Cache, bins, release)
	if err != nil {
		return nil, fmt.Errorf("building images: %w", err)
	}
	cfg.ImageArchive = archive
	golden, err := EnsureGoldenRoot(ctx, Exec{}, o.Cache, archive)
	if err != nil {
		return nil, fmt.Errorf("building images: %w", err)
	}
	cfg.GoldenRoot = golden
	cleanup = func() {}
	if o.Berth {
		dir := filepath.Dir(o.Self)
		switch {
		case !fileExists(filepath.Join(dir, "joinservice")):
			// WriteBerthArchive notes it: without the joinservice's image nothing of Berth's is imported.
		case fileExists(filepath.Join(dir, "berth-webhook")):
			cfg.WebhookImage = ImageWebhook
		default:
			o.Note("note: no berth-webhook binary next to berth; the cluster runs without the image-policy webhook")
		}
		archive, rm, err := WriteBerthArchive(*cfg, o.Self, o.Cache, o.Note)
		if err != nil {
			return nil, err
		}
		cfg.BerthArchive, cleanup = archive, rm
	}
	o.Progress(Phase{Name: "image-archive", Duration: time.Since(t0)})
	return cleanup, nil
}

// BuildBins runs the build script for Kubernetes version (exact, one k8sversion supports) with the
// cache dir and maps its output lines (one bin dir per component, in the order asked) to Bins. The
// script's progress goes to log.
func BuildBins(ctx context.Context, script, cacheDir, version string, log io.Writer) (Bins, error) {
	cmd := exec.CommandContext(ctx, script, append([]string{"--kubernetes-version", version}, buildComponents...)...)
	cmd.Env = append(os.Environ(), "BERTH_CACHE="+cacheDir)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = log
	if err := cmd.Run(); err != nil {
		return Bins{}, fmt.Errorf("building binaries with %s: %w", script, err)
	}
	var dirs []string
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); l != "" {
			dirs = append(dirs, l)
		}
	}
	if len(dirs) != len(buildComponents) {
		return Bins{}, fmt.Errorf("building binaries: %s printed %d bin dirs, want %d", script, len(dirs), len(buildComponents))
	}
	return Bins{K8s: dirs[0], Etcd: dirs[1], CoreDNS: dirs[2], Flannel: dirs[3], PodBin: dirs[4]}, nil
}

// WriteBerthArchive writes a throwaway archive of Berth's own images (the joinservice, and the
// webhook when cfg carries it) from the binaries next to the berth binary self into a temporary
// directory under parent, and returns it with the function that removes it. Berth's images change
// with every build, so each up and add makes its own. Without a joinservice binary it notes so and
// returns "".
func WriteBerthArchive(cfg Config, self, parent string, note func(string)) (string, func(), error) {
	js := filepath.Join(filepath.Dir(self), "joinservice")
	if _, err := os.Stat(js); err != nil {
		note(fmt.Sprintf("warning: no joinservice binary at %s (make build); workers will not be able to join", js))
		return "", func() {}, nil
	}
	webhook := ""
	if cfg.WebhookImage != "" {
		webhook = filepath.Join(filepath.Dir(self), "berth-webhook")
	}
	tmp, err := os.MkdirTemp(parent, "berth-images-")
	if err != nil {
		return "", nil, fmt.Errorf("creating Berth image directory: %w", err)
	}
	cleanup := func() { _ = os.RemoveAll(tmp) } // best effort: a leftover lies under parent
	archive := filepath.Join(tmp, "images-berth.tar")
	if err := image.WriteArchive(archive, cfg.BerthImageSpecs(js, webhook)); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("building Berth images: %w", err)
	}
	return archive, cleanup, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
