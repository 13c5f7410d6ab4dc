package mini

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
)

// Down removes everything Up created: processes (the recorded daemons and whatever else runs in the
// nodes' cgroups, such as containers), namespace pins, the loop devices of the state disks, network
// namespaces and links, cgroups, the host mount points it made and the cluster directory. It is idempotent and works from whatever the
// state file recorded, also after Up crashed half-way. Every step runs; the errors are joined.
func (c *Cluster) Down(ctx context.Context) (Timings, error) {
	var t Timings
	var errs []error
	nodes := c.cfg.Nodes()
	step := func(name string, f func() error) {
		if err := t.run(name, nil, f); err != nil {
			errs = append(errs, err)
		}
	}
	step("processes", func() error { return c.killAll(ctx, nodes, true) })
	step("namespaces", func() error { return c.removeNamespaces(ctx, nodes) })
	step("disks", func() error { return c.detachStateDisks(ctx, nodes) })
	step("network", func() error { return c.removeNetwork(ctx, nodes) })
	step("cgroups", func() error { return c.removeCgroups() })
	step("files", func() error { return c.removeFiles() })
	return t, errors.Join(errs...)
}

// killAll stops the nodes' daemons and every process in their cgroups with SIGKILL (a power cut),
// and the host agent too when withAgent is set, then waits until all are gone.
func (c *Cluster) killAll(ctx context.Context, nodes []Node, withAgent bool) error {
	var procs []Proc
	if c.state != nil {
		if withAgent && c.state.Agent != nil {
			procs = append(procs, *c.state.Agent)
		}
		for _, n := range nodes {
			procs = append(procs, c.state.Procs[n.Name]...)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var errs []error
	err := wait.PollUntilContextCancel(wctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		alive := 0
		for _, p := range procs {
			if c.run.Alive(p) {
				alive++
				if err := c.run.Signal(p, syscall.SIGKILL); err != nil {
					errs = append(errs, err)
				}
			}
		}
		for _, n := range nodes {
			for _, pid := range c.cgroupPIDs(c.cfg.CgroupPath(n.Name)) {
				p := Proc{PID: pid}
				if st, err := procStartTime(pid); err == nil {
					p.StartTime = st
				}
				alive++
				if err := c.run.Signal(p, syscall.SIGKILL); err != nil {
					errs = append(errs, err)
				}
			}
		}
		return alive == 0, nil
	})
	if err != nil {
		errs = append(errs, fmt.Errorf("waiting for processes to exit: %w", err))
		return errors.Join(errs...)
	}
	if c.state != nil {
		if withAgent {
			c.state.Agent = nil
		}
		for _, n := range nodes {
			delete(c.state.Procs, n.Name)
		}
		if _, err := os.Stat(c.cfg.Dir); err == nil {
			if err := c.state.save(); err != nil {
				return err
			}
		}
	}
	return nil
}

// removeNamespaces unpins the nodes' mount and UTS namespaces; with every process gone, the
// kernel frees them and every mount inside them.
func (c *Cluster) removeNamespaces(ctx context.Context, nodes []Node) error {
	var errs []error
	for _, n := range nodes {
		for _, f := range []string{c.cfg.MountNS(n.Name), c.cfg.UTSNS(n.Name)} {
			if err := c.unmount(ctx, f); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func (c *Cluster) unmount(ctx context.Context, path string) error {
	for c.mounted(path) {
		if _, err := c.run.Run(ctx, Cmd{Path: "umount", Args: []string{path}}); err != nil {
			return fmt.Errorf("unmounting %s: %w", path, err)
		}
	}
	return nil
}

// removeNetwork deletes the nodes' and the switch's network namespaces (their veths go with them)
// and the host link if it survived.
func (c *Cluster) removeNetwork(ctx context.Context, nodes []Node) error {
	var errs []error
	names := []string{}
	for _, n := range nodes {
		names = append(names, c.cfg.NodeNetns(n.Name))
	}
	names = append(names, c.cfg.SwitchNetns())
	for _, ns := range names {
		if c.netnsExists(ns) {
			if err := c.ip(ctx, "netns", "delete", ns); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if c.linkExists(c.cfg.HostLink()) {
		if err := c.ip(ctx, "link", "delete", c.cfg.HostLink()); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeCgroups removes the cluster's cgroup subtree in every hierarchy, deepest first, and the
// shared /berth parent when no other cluster uses it.
func (c *Cluster) removeCgroups() error {
	err := c.removeCgroupTree(c.cfg.ClusterCgroup())
	if hs, herr := cgroupHierarchies(c.env.CgroupRoot); herr == nil {
		for _, h := range hs {
			_ = os.Remove(filepath.Join(h, "berth")) // fails while another cluster lives; fine
		}
	}
	return err
}

// removeCgroupTree removes the cgroup rel and everything below it in every hierarchy, deepest first.
func (c *Cluster) removeCgroupTree(rel string) error {
	hs, err := cgroupHierarchies(c.env.CgroupRoot)
	if err != nil {
		return err
	}
	var errs []error
	for _, h := range hs {
		var dirs []string
		_ = filepath.WalkDir(filepath.Join(h, rel), func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		rmdir := c.rmdir
		if rmdir == nil {
			rmdir = os.Remove
		}
		for _, d := range dirs {
			if err := rmdirRetry(rmdir, d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// rmdirRetry removes an empty cgroup; the kernel may report EBUSY for a moment after the last
// process exited, so it tries up to rmdirTries times, rmdirDelay apart.
func rmdirRetry(rmdir func(string) error, d string) error {
	var err error
	if wait.ExponentialBackoff(wait.Backoff{Duration: rmdirDelay, Steps: rmdirTries}, func() (bool, error) {
		err = rmdir(d)
		return err == nil || errors.Is(err, fs.ErrNotExist), nil
	}) == nil {
		return nil
	}
	return fmt.Errorf("removing cgroup %s: %w", d, err)
}

const (
	rmdirTries = 50
	rmdirDelay = 20 * time.Millisecond
)

// removeFiles unpins the namespace directory and removes the cluster directory (or, when Up did not
// create it, what Up put there), the registry entry and, when no other cluster is registered, the
// host mount points Up created.
func (c *Cluster) removeFiles() error {
	var errs []error
	if err := c.unmount(context.Background(), c.cfg.NSDir()); err != nil {
		errs = append(errs, err)
	}
	if c.mounted(c.cfg.NSDir()) {
		return errors.Join(append(errs, errors.New("namespace directory is still mounted; not removing files"))...)
	}
	// The name is given back first: should Down stop while it removes the directory (the state
	// file with it), nothing registered points at a cluster that no longer exists, and Up can use the
	// name again.
	if err := c.unregister(); err != nil {
		errs = append(errs, err)
	}
	createdDir := c.state == nil || c.state.CreatedDir
	if createdDir {
		if err := os.RemoveAll(c.cfg.Dir); err != nil {
			errs = append(errs, fmt.Errorf("removing %s: %w", c.cfg.Dir, err))
		}
		if c.state != nil {
			for i := len(c.state.CreatedParents) - 1; i >= 0; i-- {
				_ = os.Remove(c.state.CreatedParents[i]) // only if empty
			}
		}
	} else {
		for _, name := range []string{"nodes", "ns", "tpm-ca", "components", "admin.conf", "agent.log", "init.yaml", "init-secret", "policy.yaml",
			"init.log", "master-secret.json", "cluster-id", "state.json", "state.json.tmp", "join-policy.yaml", "image-join-policy.yaml", agentNodesFile} {
			if err := os.RemoveAll(filepath.Join(c.cfg.Dir, name)); err != nil {
				errs = append(errs, fmt.Errorf("removing %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}

// unregister removes the cluster's registry entry and, when no other cluster is registered, the host
// mount points Up created.
func (c *Cluster) unregister() error {
	var errs []error
	unlock, err := c.lockRegistry()
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.Remove(filepath.Join(c.env.Registry, c.cfg.Name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("unregistering cluster: %w", err))
	}
	entries, _ := os.ReadDir(c.env.Registry)
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".") {
			return errors.Join(errs...) // another cluster lives; it removes the shared mount points
		}
	}
	ledger := filepath.Join(c.env.Registry, hostDirsLedger)
	var dirs []string
	if b, err := os.ReadFile(ledger); err == nil {
		dirs = strings.Fields(string(b))
	}
	if c.state != nil {
		dirs = append(dirs, c.state.HostDirs...)
	}
	sort.Slice(dirs, func(i, j int) bool { return strings.Count(dirs[i], "/") > strings.Count(dirs[j], "/") })
	for _, d := range dirs {
		// Only empty directories go: whatever someone else put there stays.
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			c.log.Warn("keeping host mount point", zap.String("path", d), zap.Error(err))
		}
	}
	_ = os.Remove(ledger)
	_ = os.Remove(filepath.Join(c.env.Registry, ".lock"))
	_ = os.Remove(c.env.Registry)
	return errors.Join(errs...)
}
