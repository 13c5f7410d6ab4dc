package mini

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/metadata"
)

// AddOptions tune Add.
type AddOptions struct {
	// Progress is called after every phase.
	Progress func(Phase)
	// ControlPlanes and Workers are how many nodes of each role to add.
	ControlPlanes, Workers int
	// BerthArchive, when set, is a fresh archive of Berth's own images for the new nodes (the one
	// up imported is a throwaway that is gone by now).
	BerthArchive string
}

// ErrNoAgent is returned by Add when the cluster's agent does not run: nothing would serve the
// new nodes their metadata.
var ErrNoAgent = errors.New("the mini cluster's agent is not running")

// agentServeTimeout bounds the wait for the agent to serve added nodes (it rereads the state file
// every 500 ms).
const agentServeTimeout = 20 * time.Second

// NextNodes returns the nodes Add would add: control planes and workers named after the highest
// existing cpN and wN, with the addresses after the highest existing one.
func (c Config) NextNodes(controlPlanes, workers int) []Node {
	existing := c.Nodes()
	maxIndex := func(prefix string) int {
		m := 0
		for _, n := range existing {
			if i, err := strconv.Atoi(strings.TrimPrefix(n.Name, prefix)); err == nil && strings.HasPrefix(n.Name, prefix) && i > m {
				m = i
			}
		}
		return m
	}
	ip := c.Subnet.Masked().Addr()
	for _, n := range existing {
		if n.IP.Compare(ip) > 0 {
			ip = n.IP
		}
	}
	var nodes []Node
	add := func(prefix string, role metadata.Role, count int) {
		next := maxIndex(prefix)
		for range count {
			next++
			ip = ip.Next()
			nodes = append(nodes, Node{Name: fmt.Sprintf("%s%d", prefix, next), Role: role, IP: ip})
		}
	}
	add("cp", metadata.RoleControlPlane, controlPlanes)
	add("w", metadata.RoleWorker, workers)
	return nodes
}

// Add adds nodes to the running cluster: it records them in the state file (so the agent serves
// them and Down removes them), then builds only the new nodes the way Up does (network,
// namespaces, cgroups, a blank state disk, TPM; the archive's images go into the seed root) and
// starts their bootstrappers once the agent serves them, then their containerd on the state disks
// the bootstrappers opened; a new node joins through a joinservice by itself.
// The other nodes keep running; their /etc/hosts learns the new names.
func (c *Cluster) Add(ctx context.Context, opts AddOptions) ([]Node, Timings, error) {
	var t Timings
	if c.state == nil {
		return nil, t, ErrNoState
	}
	if opts.ControlPlanes < 0 || opts.Workers < 0 || opts.ControlPlanes+opts.Workers == 0 {
		return nil, t, fmt.Errorf("%w: add at least one node (got %d control planes, %d workers)", ErrInvalidConfig, opts.ControlPlanes, opts.Workers)
	}
	if c.state.Agent == nil || !c.run.Alive(*c.state.Agent) {
		return nil, t, ErrNoAgent
	}
	nodes := c.cfg.NextNodes(opts.ControlPlanes, opts.Workers)
	cfg := c.cfg
	cfg.Added = append(append([]Node(nil), c.cfg.Added...), nodes...)
	if err := cfg.Validate(); err != nil {
		return nil, t, err
	}
	steps := []struct {
		name string
		f    func() error
	}{
		{"record", func() error {
			c.cfg = cfg
			if opts.BerthArchive != "" {
				c.cfg.BerthArchive = opts.BerthArchive
			}
			c.state.Config = c.cfg
			return c.state.save()
		}},
		{"network", func() error { return c.network(ctx, nodes) }},
		{"namespaces", func() error {
			if err := c.ensureHostDirsLocked(); err != nil {
				return err
			}
			if err := c.eachNode(nodes, func(n Node) error { return c.namespaces(ctx, n) }); err != nil {
				return err
			}
			return c.updateHosts()
		}},
		{"cgroups", func() error { return c.eachNode(nodes, c.cgroups) }},
		{"disks", func() error { return c.eachNode(nodes, c.createStateDisk) }},
		{"tpm", func() error { return c.eachNodeParallel(ctx, nodes, c.tpm) }},
		{"seed", func() error { return c.seed(ctx, []string{opts.BerthArchive}) }},
		{"agent", func() error { return c.waitAgentServes(ctx, nodes) }},
		{"bootstrappers", func() error { return c.eachNode(nodes, c.bootstrapper) }},
		{"containerd", func() error { return c.containerd(ctx, nodes, true) }},
	}
	for _, s := range steps {
		if err := t.run(s.name, opts.Progress, s.f); err != nil {
			return nodes, t, err
		}
	}
	return nodes, t, nil
}

// updateHosts rewrites every node's /etc/hosts with all nodes. The file is rewritten in place: a
// running node sees it through its bind mount of that very inode.
func (c *Cluster) updateHosts() error {
	b := hostsFile(c.cfg.Nodes())
	for _, n := range c.cfg.Nodes() {
		path := filepath.Join(c.fsDir(n.Name), "hosts")
		if _, err := os.Stat(path); err != nil {
			continue // the node was never set up
		}
		if err := os.WriteFile(path, b, 0o644); err != nil {
			return fmt.Errorf("updating hosts file of %s: %w", n.Name, err)
		}
	}
	return nil
}

// waitAgentServes waits until the agent lists every one of nodes among the nodes it serves.
func (c *Cluster) waitAgentServes(ctx context.Context, nodes []Node) error {
	path := filepath.Join(c.cfg.Dir, agentNodesFile)
	var missing []string
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, agentServeTimeout, true, func(context.Context) (bool, error) {
		b, _ := os.ReadFile(path) // absent until the agent wrote it
		served := map[string]bool{}
		for _, name := range strings.Fields(string(b)) {
			served[name] = true
		}
		missing = missing[:0]
		for _, n := range nodes {
			if !served[n.Name] {
				missing = append(missing, n.Name)
			}
		}
		return len(missing) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for the agent to serve %s: %w", strings.Join(missing, " "), err)
	}
	return nil
}
