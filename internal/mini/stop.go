package mini

import (
	"context"
	"errors"
	"fmt"
)

// ErrNoNodes is returned by Stop without node names: stopping every node is berth mini down's job.
var ErrNoNodes = errors.New("name the nodes to stop")

// Stop powers the named nodes off and leaves them off, like machines that died for good: every
// process dies by SIGKILL, their network and mount namespaces, cgroups and state disk loop devices
// go, while their persistent directories, TPM and state disk stay (as a dead machine's disks do).
// The cluster records them as stopped: the agent still lists them in metadata (the instances
// exist), restart without node names leaves them off, and `berth mini restart NODE` powers one on
// again. Stopping a stopped node again is a no-op.
func (c *Cluster) Stop(ctx context.Context, names []string, progress func(Phase)) (Timings, error) {
	var t Timings
	if c.state == nil {
		return t, ErrNoState
	}
	if len(names) == 0 {
		return t, ErrNoNodes
	}
	nodes, err := c.RestartNodes(names)
	if err != nil {
		return t, err
	}
	err = t.run("power-off", progress, func() error {
		// Recorded first: a crash half-way must not let a later restart boot the node by accident.
		if err := c.markStopped(nodes, true); err != nil {
			return err
		}
		return c.powerOff(ctx, nodes)
	})
	return t, err
}

// markStopped records nodes as stopped (or as running) in the state file.
func (c *Cluster) markStopped(nodes []Node, stopped bool) error {
	changed := false
	for _, n := range nodes {
		if c.cfg.Stopped[n.Name] == stopped {
			continue
		}
		if c.cfg.Stopped == nil {
			c.cfg.Stopped = map[string]bool{}
		}
		if stopped {
			c.cfg.Stopped[n.Name] = true
		} else {
			delete(c.cfg.Stopped, n.Name)
		}
		changed = true
	}
	if !changed {
		return nil
	}
	c.state.Config = c.cfg
	if err := c.state.save(); err != nil {
		return fmt.Errorf("recording stopped nodes: %w", err)
	}
	return nil
}
