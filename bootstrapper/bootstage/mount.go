package bootstage

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/berth-k8s/berth/internal/statedisk"
)

// sysMounter bind-mounts with mount(2) in the daemon's mount namespace (the node's).
type sysMounter struct{}

func (sysMounter) BindMount(src, dst string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	return unix.Mount(src, dst, "", unix.MS_BIND, "")
}

func (sysMounter) Unmount(dst string) error { return unix.Unmount(dst, 0) }

// IsBound reads /proc/self/mountinfo: dst is a bind of the disk directory name when the topmost
// mount at dst has that directory as its root.
func (sysMounter) IsBound(dst, name string) (bool, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false, fmt.Errorf("reading mount table: %w", err)
	}
	bound := false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == dst {
			// Later lines are mounted on top of earlier ones.
			bound = mountRootHas(f[3], name)
		}
	}
	return bound, nil
}

// MountsOf reads /proc/self/mountinfo for the mounts whose device is the one holding root, except
// the disk's own mount (the one root lies in), and the mounts below any of them, last mounted first.
func (sysMounter) MountsOf(root string) ([]string, error) {
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		return nil, fmt.Errorf("reading the state disk's device: %w", err)
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("reading mount table: %w", err)
	}
	return mountsOf(string(b), fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev)), filepath.Clean(root)), nil
}

// mountsOf picks from a mountinfo table the mount points on device dev (major:minor) other than
// the one holding root, and the mount points below any mount of dev (the one holding root
// included), in reverse order of the table.
func mountsOf(mountinfo, dev, root string) []string {
	var holders, out []string
	for _, line := range strings.Split(mountinfo, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := statedisk.UnescapeMountinfo(f[4])
		below := slices.ContainsFunc(holders, func(h string) bool { return h == "/" || strings.HasPrefix(mp, h+"/") })
		own := mp == root || strings.HasPrefix(root, strings.TrimSuffix(mp, "/")+"/")
		switch {
		case f[2] == dev && own:
			// The disk's own mount: what lies below it (a mount propagated into the disk's
			// tree from a shared bind) holds the disk too.
			holders = append(holders, mp)
		case f[2] == dev:
			holders = append(holders, mp)
			out = append(out, mp)
		case below && !own:
			out = append(out, mp)
		}
	}
	slices.Reverse(out)
	return slices.Compact(out)
}
