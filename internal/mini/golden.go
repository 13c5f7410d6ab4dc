package mini

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// goldenConfig is the configuration of the short-lived containerd that fills a golden root: no CRI
// (it runs no containers), root and state under dir.
func goldenConfig(dir string) string {
	return fmt.Sprintf(`# Written by berth mini: builds a containerd root with the cluster's images.
version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), filepath.Join(dir, "c.sock"))
}

// EnsureGoldenRoot returns a containerd root directory (content store, metadata and overlayfs
// snapshots) with every image of archive imported and unpacked in namespace k8s.io. It is built once
// per archive under cacheDir, by a temporary containerd, with an exclusive flock against concurrent
// builders. Nodes start from a copy of it (SeedContainerdRoot), so a warm up imports nothing.
func EnsureGoldenRoot(ctx context.Context, run Runner, cacheDir, archive string) (string, error) {
	st, err := os.Stat(archive)
	if err != nil {
		return "", fmt.Errorf("reading image archive: %w", err)
	}
	h := sha256.Sum256([]byte(fmt.Sprintf("%s %d %d containerd-1.6", archive, st.Size(), st.ModTime().UnixNano())))
	dir := filepath.Join(cacheDir, "images", "containerd-"+hex.EncodeToString(h[:])[:12])
	root := filepath.Join(dir, "root")
	if _, err := os.Stat(filepath.Join(dir, "stamp")); err == nil {
		return root, nil
	}
	lock, err := os.OpenFile(filepath.Join(cacheDir, "images", ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", fmt.Errorf("opening image cache lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("locking image cache: %w", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "stamp")); err == nil {
		return root, nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return "", fmt.Errorf("removing partial golden root: %w", err)
	}
	if err := importImages(ctx, run, dir, []string{archive}); err != nil {
		return "", err
	}
	if err := writeFile(filepath.Join(dir, "stamp"), []byte(archive+"\n"), 0o644); err != nil {
		return "", err
	}
	return root, nil
}

// importImages imports archives into the containerd root dir/root (namespace k8s.io, unpacked for
// the overlayfs snapshotter) with a short-lived containerd whose state and socket are under dir.
func importImages(ctx context.Context, run Runner, dir string, archives []string) error {
	if err := writeFile(filepath.Join(dir, "config.toml"), []byte(goldenConfig(dir)), 0o644); err != nil {
		return err
	}
	p, err := run.Start(Cmd{Path: "containerd", Args: []string{"--config", filepath.Join(dir, "config.toml")}, Log: filepath.Join(dir, "containerd.log")})
	if err != nil {
		return fmt.Errorf("starting containerd to import images: %w", err)
	}
	stop := func() error {
		if err := run.Signal(p, syscall.SIGTERM); err != nil {
			return err
		}
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := wait.PollUntilContextCancel(sctx, 50*time.Millisecond, true, func(context.Context) (bool, error) {
			return !run.Alive(p), nil
		}); err != nil {
			_ = run.Signal(p, syscall.SIGKILL)
			return fmt.Errorf("stopping the importing containerd: %w", err)
		}
		return nil
	}
	ctr := func(args ...string) Cmd {
		return Cmd{Path: "ctr", Args: append([]string{"--address", filepath.Join(dir, "c.sock"), "--namespace", "k8s.io"}, args...)}
	}
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := wait.PollUntilContextCancel(wctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := run.Run(ctx, ctr("version"))
		return err == nil, nil
	}); err != nil {
		return errors.Join(fmt.Errorf("waiting for the importing containerd: %w", err), stop())
	}
	for _, a := range archives {
		if _, err := run.Run(ctx, ctr("images", "import", a)); err != nil {
			return errors.Join(fmt.Errorf("importing images: %w", err), stop())
		}
	}
	if err := stop(); err != nil {
		return err
	}
	return os.RemoveAll(filepath.Join(dir, "state"))
}

// SeedContainerdRoot fills dst (an empty node containerd root) from golden: immutable files (blobs,
// unpacked layers) are hard links, the bolt databases (which containerd writes in place) are copies.
func SeedContainerdRoot(golden, dst string) error {
	return filepath.WalkDir(golden, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("walking golden root: %w", err)
		}
		rel, err := filepath.Rel(golden, p)
		if err != nil {
			return fmt.Errorf("walking golden root: %w", err)
		}
		target := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return fmt.Errorf("reading %s: %w", p, err)
		}
		switch {
		case d.IsDir():
			if err := os.MkdirAll(target, info.Mode().Perm()); err != nil {
				return fmt.Errorf("creating %s: %w", target, err)
			}
			return os.Chmod(target, info.Mode().Perm()|(info.Mode()&(fs.ModeSticky|fs.ModeSetgid|fs.ModeSetuid)))
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(p)
			if err != nil {
				return fmt.Errorf("reading link %s: %w", p, err)
			}
			return os.Symlink(link, target)
		case strings.HasSuffix(d.Name(), ".db"):
			return copyFile(p, target, info.Mode().Perm())
		default:
			if err := os.Link(p, target); err != nil {
				return fmt.Errorf("linking %s: %w", target, err)
			}
			return nil
		}
	})
}

func copyFile(src, dst string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("opening %s: %w", src, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return fmt.Errorf("creating %s: %w", dst, err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copying %s: %w", src, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("closing %s: %w", dst, err)
	}
	return nil
}
