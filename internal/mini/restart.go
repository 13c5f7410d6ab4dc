package mini

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
)

// RestartOptions tune Restart.
type RestartOptions struct {
	// Progress is called after every phase.
	Progress func(Phase)
	// Nodes names the nodes to power-cycle; empty means every node.
	Nodes []string
	// TamperBoot names restarted nodes whose simulated boot measures a tampered image from this
	// boot on (recorded in the state file, so later restarts keep it).
	TamperBoot []string
	// GenuineBoot names restarted nodes whose simulated boot measures the genuine image again.
	GenuineBoot []string
	// ClearTPM names restarted nodes whose TPM is cleared after swtpm starts and before the boot
	// is measured: their sealed keys die, their EK and its certificate stay.
	ClearTPM []string
	// WipeDisk names restarted nodes that come back reinstalled: their state disk is blank again
	// (a fresh node that joins anew), their TPM and its EK stay (the same machine).
	WipeDisk []string
}

// ErrUnknownNode is returned when a node name is not one of the cluster's.
var ErrUnknownNode = errors.New("no such node in the mini cluster")

// ErrNotRestarted is returned when a boot option names a node that is not being restarted.
var ErrNotRestarted = errors.New("the node is not being restarted")

// RestartNodes resolves names to the cluster's nodes; no names means every node that is not
// stopped.
func (c *Cluster) RestartNodes(names []string) ([]Node, error) {
	if len(names) == 0 {
		var running []Node
		for _, n := range c.cfg.Nodes() {
			if !n.Stopped {
				running = append(running, n)
			}
		}
		return running, nil
	}
	var nodes []Node
	seen := map[string]bool{}
	for _, name := range names {
		n, ok := c.cfg.Node(name)
		if !ok {
			return nil, fmt.Errorf("%w: %q", ErrUnknownNode, name)
		}
		if !seen[name] {
			seen[name] = true
			nodes = append(nodes, n)
		}
	}
	return nodes, nil
}

// Restart power-cycles the given nodes (every node when opts.Nodes is empty) at once: their
// processes die by SIGKILL, their network and mount namespaces (and with them /run and every
// runtime mount, the opened state disk included) and cgroups are recreated, the loop devices of
// their state disks are gone before they boot, and swtpm (PCRs reset, keys kept), containerd and
// the bootstrapper start again on the nodes' persistent directories and state disks. The switch,
// the host link, the agent and the other nodes keep running, like a rack and its metadata service
// during a power cut of some machines.
func (c *Cluster) Restart(ctx context.Context, opts RestartOptions) (Timings, error) {
	var t Timings
	if c.state == nil {
		return t, ErrNoState
	}
	nodes, err := c.RestartNodes(opts.Nodes)
	if err != nil {
		return t, err
	}
	restarted := map[string]bool{}
	for _, n := range nodes {
		restarted[n.Name] = true
	}
	for _, list := range [][]string{opts.TamperBoot, opts.GenuineBoot, opts.ClearTPM, opts.WipeDisk} {
		for _, name := range list {
			if _, ok := c.cfg.Node(name); !ok {
				return t, fmt.Errorf("%w: %q", ErrUnknownNode, name)
			}
			if !restarted[name] {
				return t, fmt.Errorf("%w: %s", ErrNotRestarted, name)
			}
		}
	}
	for _, name := range opts.TamperBoot {
		if slices.Contains(opts.GenuineBoot, name) {
			return t, fmt.Errorf("node %s: a boot cannot be both tampered and genuine", name)
		}
	}
	if len(opts.TamperBoot)+len(opts.GenuineBoot) > 0 {
		if c.cfg.BootTampered == nil {
			c.cfg.BootTampered = map[string]bool{}
		}
		for _, name := range opts.TamperBoot {
			c.cfg.BootTampered[name] = true
		}
		for _, name := range opts.GenuineBoot {
			c.cfg.BootTampered[name] = false
		}
		c.state.Config = c.cfg
		if err := c.state.save(); err != nil {
			return t, err
		}
		// Re-resolve: the nodes now carry their boot as measured from this boot on.
		if nodes, err = c.RestartNodes(namesOf(nodes)); err != nil {
			return t, err
		}
	}
	if err := c.markStopped(nodes, false); err != nil {
		return t, err
	}
	if nodes, err = c.RestartNodes(namesOf(nodes)); err != nil {
		return t, err
	}
	c.clearTPMs = map[string]bool{}
	for _, name := range opts.ClearTPM {
		c.clearTPMs[name] = true
	}
	steps := []struct {
		name string
		f    func() error
	}{
		{"power-off", func() error {
			if err := c.powerOff(ctx, nodes); err != nil {
				return err
			}
			return c.wipeStateDisks(opts.WipeDisk)
		}},
		{"network", func() error { return c.network(ctx, nodes) }},
		{"namespaces", func() error {
			if err := c.ensureHostDirsLocked(); err != nil {
				return err
			}
			return c.eachNode(nodes, func(n Node) error { return c.namespaces(ctx, n) })
		}},
		{"cgroups", func() error { return c.eachNode(nodes, c.cgroups) }},
		{"tpm", func() error { return c.eachNodeParallel(ctx, nodes, c.tpm) }},
		{"bootstrappers", func() error { return c.eachNode(nodes, c.bootstrapper) }},
		// containerd starts once the node's bootstrapper opened its state disk, which may wait
		// for a rejoin ticket or berth recover: Restart waits for it only without bootstrappers.
		{"containerd", func() error { return c.containerd(ctx, nodes, c.cfg.Bootstrapper == "") }},
	}
	for _, s := range steps {
		if err := t.run(s.name, opts.Progress, s.f); err != nil {
			return t, err
		}
	}
	return t, nil
}

// powerOff cuts the nodes' power: every process dies by SIGKILL, their namespaces, cgroups and
// network namespaces go, and no loop device backs their state disks any more.
func (c *Cluster) powerOff(ctx context.Context, nodes []Node) error {
	errs := []error{c.killAll(ctx, nodes, false), c.removeNamespaces(ctx, nodes), c.removeNodeNetns(ctx, nodes)}
	// A machine boots with fresh cgroups; stale pod cgroups would stall the kubelet.
	for _, n := range nodes {
		errs = append(errs, c.removeCgroupTree(c.cfg.CgroupPath(n.Name)))
	}
	// With the node's mount namespace gone the kernel unmounts its state disk; its loop
	// device must be gone too before the node boots and opens the image again.
	errs = append(errs, c.detachStateDisks(ctx, nodes))
	return errors.Join(errs...)
}

// wipeStateDisks replaces the state disks of the named nodes with blank ones (they are off).
func (c *Cluster) wipeStateDisks(names []string) error {
	for _, name := range names {
		n, _ := c.cfg.Node(name) // validated by Restart
		if err := os.Remove(c.cfg.StateDisk(name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("wiping the state disk of %s: %w", name, err)
		}
		if err := c.createStateDisk(n); err != nil {
			return fmt.Errorf("node %s: %w", name, err)
		}
		// A reinstalled machine has no pod network configuration either: its next Node object may get
		// another pod range, and a pod started with the old conflist (before the agent writes the new
		// one from flannel's lease) would get an address no other node routes to it. (Its CNI
		// address leases, like its containerd root, were on the state disk and went with it.)
		fsDir := filepath.Join(c.cfg.NodeDir(name), "fs")
		if err := os.Remove(filepath.Join(fsDir, "etc-cni-net.d", cniConfName)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("removing the CNI configuration of %s: %w", name, err)
		}
		c.log.Info("wiped the node's state disk and pod network configuration: it boots as a fresh node", zap.String("node", name))
	}
	return nil
}

func namesOf(nodes []Node) []string {
	var names []string
	for _, n := range nodes {
		names = append(names, n.Name)
	}
	return names
}

func (c *Cluster) removeNodeNetns(ctx context.Context, nodes []Node) error {
	var errs []error
	for _, n := range nodes {
		// Deleting the switch end destroys the veth pair at once; the node end would otherwise
		// linger until the kernel's asynchronous namespace cleanup ran.
		if c.netnsExists(c.cfg.SwitchNetns()) {
			if out, err := c.run.Run(ctx, Cmd{Path: "ip", Args: []string{"-n", c.cfg.SwitchNetns(), "link", "delete", n.Name}}); err != nil &&
				!strings.Contains(string(out), "Cannot find device") {
				errs = append(errs, fmt.Errorf("deleting switch port of %s: %w", n.Name, err))
			}
		}
		if ns := c.cfg.NodeNetns(n.Name); c.netnsExists(ns) {
			if err := c.ip(ctx, "netns", "delete", ns); err != nil {
				errs = append(errs, fmt.Errorf("deleting %s: %w", ns, err))
			}
		}
	}
	return errors.Join(errs...)
}

// RestartBootstrappers kills the bootstrapper of each named node with SIGKILL, as a crash of the
// daemon would, and starts it again, while everything else of the node keeps running: swtpm (and
// its PCRs), containerd, the namespaces and mounts (the opened state disk too). What the killed
// daemon had started dies with it (its children run with Pdeathsig) or is killed by the new one.
func (c *Cluster) RestartBootstrappers(ctx context.Context, names []string) error {
	if c.state == nil {
		return ErrNoState
	}
	if c.cfg.Bootstrapper == "" {
		return errors.New("the cluster runs no bootstrappers")
	}
	nodes, err := c.RestartNodes(names)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		c.mu.Lock()
		var kept, daemons []Proc
		for _, p := range c.state.Procs[n.Name] {
			if p.Name == "bootstrapper" {
				daemons = append(daemons, p)
			} else {
				kept = append(kept, p)
			}
		}
		c.mu.Unlock()
		for _, p := range daemons {
			if err := c.run.Signal(p, syscall.SIGKILL); err != nil {
				return fmt.Errorf("killing the bootstrapper of %s: %w", n.Name, err)
			}
		}
		if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			for _, p := range daemons {
				if c.run.Alive(p) {
					return false, nil
				}
			}
			return true, nil
		}); err != nil {
			return fmt.Errorf("waiting for the bootstrapper of %s to die: %w", n.Name, err)
		}
		c.mu.Lock()
		c.state.Procs[n.Name] = kept
		err := c.state.save()
		c.mu.Unlock()
		if err != nil {
			return err
		}
		if err := c.bootstrapper(n); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	return nil
}
