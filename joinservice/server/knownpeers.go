package server

import (
	"context"
	"net"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
)

// How often KnownPeers lists the cluster's instances, and how long one listing may take.
const (
	knownPeersInterval = 10 * time.Second
	knownPeersTimeout  = 5 * time.Second
)

// KnownPeers is the set of addresses metadata lists as the cluster's instances, for the attested
// handshakes' budget of known peers (atls.WithKnownPeers): a flood from any other address cannot use
// up what the cluster's own machines need to join. It is listed every knownPeersInterval by Run,
// never on a handshake's path, so that no handshake waits for metadata and no flood reaches it.
type KnownPeers struct {
	meta peerLister
	log  *zap.Logger
	ips  atomic.Pointer[map[string]bool]
}

// NewKnownPeers returns the set, empty until Refresh or Run listed the instances.
func NewKnownPeers(meta peerLister, log *zap.Logger) *KnownPeers {
	k := &KnownPeers{meta: meta, log: log}
	k.ips.Store(&map[string]bool{})
	return k
}

// Known reports whether peer (an IP address) belongs to one of the cluster's instances.
func (k *KnownPeers) Known(peer string) bool {
	ip := net.ParseIP(peer)
	return ip != nil && (*k.ips.Load())[ip.String()]
}

// Refresh lists the instances now.
func (k *KnownPeers) Refresh(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, knownPeersTimeout)
	defer cancel()
	peers, err := k.meta.Peers(ctx)
	if err != nil {
		return err
	}
	ips := map[string]bool{}
	for _, p := range peers {
		for _, a := range p.IPs {
			if ip := net.ParseIP(a); ip != nil {
				ips[ip.String()] = true
			}
		}
	}
	k.ips.Store(&ips)
	return nil
}

// Run refreshes the set every knownPeersInterval until ctx ends; a failed listing keeps the last set.
func (k *KnownPeers) Run(ctx context.Context) error {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		if err := k.Refresh(ctx); err != nil && ctx.Err() == nil {
			k.log.Warn("listing the cluster's instances for the known peers' budget", zap.Error(err))
		}
	}, knownPeersInterval)
	return nil
}
