package atls

import (
	"context"
	"net"

	"google.golang.org/grpc/peer"
)

// PeerAddr returns the address of the gRPC caller in ctx, with its port, for logs; "unknown" when
// ctx carries no peer address.
func PeerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return "unknown"
}

// PeerHost returns the gRPC caller's address without its port: the key under which a server counts
// the caller's attempts (Limiter.AllowPeer). It is PeerAddr where that has no port.
func PeerHost(ctx context.Context) string {
	addr := PeerAddr(ctx)
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}
