package mini

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// RestartOptions tune Restart.
type RestartOptions struct {
	// Progress is called after every phase.
	Progress func(Phase)
}

// Restart power-cycles every node at once: all node processes die by SIGKILL, the nodes' network
// and mount namespaces (and with them /run and every runtime mount) and cgroups are recreated, and swtpm
// (PCRs reset, keys kept), containerd and the bootstrapper start again on the nodes' persistent
// directories. The switch, the host link and the agent keep running, like a rack and its metadata
// service during a power cut of the machines.
func (c *Cluster) Restart(ctx context.Context, opts RestartOptions) (Timings, error) {
	var t Timings
	if c.state == nil {
		return t, ErrNoState
	}
	nodes := c.cfg.Nodes()
	steps := []struct {
		name string
		f    func() error
	}{
		{"power-off", func() error {
			errs := []error{c.killAll(ctx, nodes, false), c.removeNamespaces(ctx, nodes), c.removeNodeNetns(ctx, nodes)}
			// A machine boots with fresh cgroups; stale pod cgroups would stall the kubelet.
			for _, n := range nodes {
				errs = append(errs, c.removeCgroupTree(c.cfg.CgroupPath(n.Name)))
			}
			return errors.Join(errs...)
		}},
		{"network", func() error { return c.network(ctx, nodes) }},
		{"namespaces", func() error { return c.eachNode(nodes, func(n Node) error { return c.namespaces(ctx, n) }) }},
		{"cgroups", func() error { return c.eachNode(nodes, c.cgroups) }},
		{"tpm", func() error { return c.eachNodeParallel(ctx, nodes, c.tpm) }},
		{"containerd", func() error { return c.containerd(ctx, nodes) }},
		{"bootstrappers", func() error { return c.eachNode(nodes, c.bootstrapper) }},
	}
	for _, s := range steps {
		if err := t.run(s.name, opts.Progress, s.f); err != nil {
			return t, err
		}
	}
	return t, nil
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
