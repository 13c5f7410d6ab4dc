package mini

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/metadata"
	metamini "github.com/berth-k8s/berth/internal/metadata/mini"
	"github.com/berth-k8s/berth/internal/serve"
)

// cniConfName is the file the agent writes into each node's /etc/cni/net.d.
const cniConfName = "10-berth-mini.conflist"

// RunAgent is the host daemon of the cluster in dir (`berth mini agent`): it serves the mini
// metadata API on the host's bridge address, telling callers apart by source address, balances the
// control-plane endpoint over the control planes' API servers (apiBalancer), and writes each node's
// CNI configuration once flannel has leased the node a pod subnet (flannel's subnet.env, as its own
// CNI plugin would read it). It runs until ctx ends.
func RunAgent(ctx context.Context, dir string, log *zap.Logger) error {
	st, err := LoadState(dir)
	if err != nil {
		return err
	}
	addr := netip.AddrPortFrom(st.Config.HostAddr(), MetadataPort).String()
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", addr, err)
	}
	api := st.Config.ControlPlaneEndpoint().String()
	apiLis, err := lc.Listen(ctx, "tcp", api)
	if err != nil {
		_ = lis.Close()
		return fmt.Errorf("listening on %s: %w", api, err)
	}
	return serveAgent(ctx, dir, st, lis, apiLis, 500*time.Millisecond, log)
}

// agentNodesFile (in the cluster directory) lists, one name a line, the nodes the agent serves;
// the agent rewrites it whenever that set changes, so `berth mini add` knows when new nodes are served.
const agentNodesFile = "agent-nodes"

// serveAgent runs the agent on lis (metadata) and apiLis (the control-plane endpoint; nil serves
// none) until ctx ends, re-reading the state file every interval, so that nodes added to the state
// file are served, and control planes balanced, without a restart.
func serveAgent(ctx context.Context, dir string, st *State, lis, apiLis net.Listener, interval time.Duration, log *zap.Logger) error {
	srv := metamini.NewServer()
	balancer := newAPIBalancer(log.Named("api-endpoint"))
	served := ""
	publish := func(st *State) {
		var instances []metadata.Instance
		var names, apiServers []string
		for _, n := range st.Config.Nodes() {
			instances = append(instances, metadata.Instance{Name: n.Name, Role: n.Role, IPs: []string{n.IP.String()}})
			names = append(names, n.Name)
			if n.Role == metadata.RoleControlPlane {
				apiServers = append(apiServers, netip.AddrPortFrom(n.IP, APIPort).String())
			}
		}
		srv.SetInstances(instances)
		balancer.setBackends(apiServers)
		if st.ControlPlaneEndpoint != "" {
			srv.SetControlPlaneEndpoint(st.ControlPlaneEndpoint)
		}
		if h, err := hex.DecodeString(st.InitSecretHash); err == nil && len(h) > 0 {
			srv.SetInitSecretHash(h)
		}
		if cur := strings.Join(names, "\n") + "\n"; cur != served {
			if err := atomicfile.Write(afero.NewOsFs(), filepath.Join(dir, agentNodesFile), []byte(cur), 0o644); err != nil {
				log.Warn("agent cannot record the nodes it serves", zap.Error(err))
				return
			}
			served = cur
			log.Info("agent serving nodes", zap.Strings("nodes", names))
		}
	}
	publish(st)

	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 5 * time.Second}
	log.Info("agent serving metadata", zap.String("endpoint", lis.Addr().String()))

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := serve.HTTP(gctx, hs, lis, 5*time.Second); err != nil {
			return fmt.Errorf("serving metadata: %w", err)
		}
		return nil
	})
	if apiLis != nil {
		log.Info("agent serving the control-plane endpoint", zap.String("endpoint", apiLis.Addr().String()))
		g.Go(func() error { return balancer.serve(gctx, apiLis) })
		g.Go(func() error {
			balancer.checkHealth(gctx)
			return nil
		})
	}
	g.Go(func() error {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-gctx.Done():
				return nil
			case <-t.C:
			}
			cur, err := LoadState(dir)
			if err != nil {
				log.Warn("agent cannot read state", zap.Error(err))
				continue
			}
			publish(cur)
			for _, n := range cur.Config.Nodes() {
				if err := syncCNI(cur.Config, cur, n.Name); err != nil {
					log.Warn("agent cannot write CNI config", zap.String("node", n.Name), zap.Error(err))
				}
			}
		}
	})
	return g.Wait()
}

// syncCNI writes node's conflist from the subnet flannel leased it, read through the root of the
// node's containerd (which lives in the node's mount namespace, where /run is the node's own).
func syncCNI(cfg Config, st *State, node string) error {
	var pid int
	for _, p := range st.Procs[node] {
		if p.Name == "containerd" {
			pid = p.PID
		}
	}
	if pid == 0 {
		return nil
	}
	env, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "root", "run", "flannel", "subnet.env"))
	if err != nil {
		return nil // flannel has not leased a subnet yet
	}
	return writeCNI(cfg, node, env)
}

// writeCNI writes node's conflist for flannel's subnet.env contents unless it is already current.
func writeCNI(cfg Config, node string, subnetEnv []byte) error {
	subnet, mtu, err := parseSubnetEnv(subnetEnv)
	if err != nil {
		return err
	}
	conf, err := cniConflist(subnet, cfg.PodCIDR, cfg.ServiceCIDR, cfg.Subnet, mtu)
	if err != nil {
		return err
	}
	path := filepath.Join(cfg.NodeDir(node), "fs", "etc-cni-net.d", cniConfName)
	if cur, err := os.ReadFile(path); err == nil && bytes.Equal(cur, conf) {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("creating CNI config directory: %w", err)
	}
	return atomicfile.Write(afero.NewOsFs(), path, conf, 0o644)
}
