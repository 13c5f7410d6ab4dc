package bootstage

import (
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
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
