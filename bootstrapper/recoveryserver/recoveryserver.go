// Package recoveryserver serves the Recovery protocol on a node that cannot open its state disk on
// its own: the key sealed to its TPM does not unseal and no joinservice gives it a rejoin ticket.
// `berth recover` attests the node (over the node's attested TLS server credentials, as for
// `berth init`), asks which disk it waits for (Info) and sends the key derived for that disk
// (Recover). The master secret never reaches the node.
//
// Recover's outcomes:
//
//	request                          answer                                   Serve
//	disk_key not 32 bytes            INVALID_ARGUMENT, open is not called     keeps serving
//	key that does not open the disk  INVALID_ARGUMENT, one fixed message      keeps serving
//	key that opens the disk          OK                                       stops, returns nil
//	after a success                  FAILED_PRECONDITION                      stopping
//
// Recover calls run one at a time; the reason a key failed is logged on the node and never sent.
//
// Nobody authenticates to the node before a key opens its disk, so every caller is a stranger until
// then, and a wrong key costs the node an open of its disk. Calls are bounded per peer address
// (Limits): a peer has at most one Recover call waiting or running, and makes Info and Recover calls
// at a rate (DefaultLimits: one a second, with a burst of 3); a call past either is answered
// RESOURCE_EXHAUSTED at once, without waiting and without a log line of its own (the refusals are
// logged sampled). So a caller waits for at most one open per other peer address, however many calls
// those peers send: 2,000 wrong keys queued over a few connections no longer keep berth recover
// waiting for 2,000 opens.
//
// Info tells any caller the disk's UUID and cluster ID. berth recover needs the UUID to derive the
// disk key from the master secret, and the node cannot authenticate the caller before a key opens
// the disk (it holds no secret that the operator shares but the key). Neither is a secret: the UUID
// and the cluster ID are written in the disk's unencrypted header, the key is derived from the master
// secret too, and knowing them opens nothing.
package recoveryserver

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/serve"
	"github.com/berth-k8s/berth/recoverproto"
)

// KeySize is the size of a state disk key.
const KeySize = 32

// gracefulStopTimeout bounds how long Serve waits, after a successful Recover, for the response to be
// sent and the other calls to end before it closes every connection.
const gracefulStopTimeout = 5 * time.Second

// The answers a caller gets. errWrongKey is the only answer for a key that did not open the disk,
// whatever the reason: the caller learns nothing else about the node's disk.
var (
	errWrongKey    = status.Error(codes.InvalidArgument, "the key does not open this node's state disk; nothing changed")
	errKeySize     = status.Error(codes.InvalidArgument, fmt.Sprintf("disk_key must be %d bytes", KeySize))
	errAlreadyOpen = status.Error(codes.FailedPrecondition, "this node's state disk is already open")
	errStopping    = status.Error(codes.Unavailable, "the recovery server is stopping")
	errLimited     = status.Error(codes.ResourceExhausted, "too many recovery calls from this address: retry later")
)

// Limits bound the calls of one peer address: PerPeer Info and Recover calls a second with a burst of
// PerPeerBurst, and at most Waiting Recover calls waiting or running.
type Limits struct {
	PerPeer      rate.Limit
	PerPeerBurst int
	Waiting      int
}

// DefaultLimits: one call a second per peer address, with a burst of 3 (berth recover makes two),
// and one Recover call waiting or running.
var DefaultLimits = Limits{PerPeer: 1, PerPeerBurst: 3, Waiting: 1}

// maxPeers bounds the peer addresses whose limits are tracked.
const maxPeers = 4096

// Info is what the node tells `berth recover` about the disk it waits to open.
type Info struct {
	// DiskUUID is the state disk's UUID (lower-case canonical form).
	DiskUUID string
	// ClusterID is the cluster the disk is bound to, from its header.
	ClusterID []byte
	// Binding is the disk binding from its header (clusterkeys.DiskBinding).
	Binding []byte
}

// OpenFunc opens the state disk with diskKey (KeySize bytes). It returns an error when the key does
// not open the disk; it must not put the key into the error.
type OpenFunc func(ctx context.Context, diskKey []byte) error

// Server serves the Recovery protocol. Create it with New.
type Server struct {
	log    *zap.Logger
	opts   []grpc.ServerOption
	limits Limits
}

// New returns a Server; opts are the gRPC server options, among them the node's attested TLS server
// credentials.
func New(log *zap.Logger, opts ...grpc.ServerOption) *Server {
	return &Server{log: log, opts: opts, limits: DefaultLimits}
}

// WithLimits replaces DefaultLimits and returns s.
func (s *Server) WithLimits(l Limits) *Server {
	s.limits = l
	return s
}

// Serve serves Info and Recover on lis until a Recover call opened the state disk with open, then
// stops gracefully (the caller gets its answer) and returns nil. When ctx ends first it stops too,
// as gracefully (a call in flight, whose open sees ctx end, is answered), and returns ctx.Err(),
// or nil when a call opened the disk meanwhile. lis is closed either way, and every goroutine Serve started is gone when it
// returns.
func (s *Server) Serve(ctx context.Context, lis net.Listener, info Info, open OpenFunc) error {
	h := &handler{
		log:    s.log,
		info:   info,
		open:   open,
		ctx:    ctx,
		turn:   make(chan struct{}, 1),
		opened: make(chan struct{}),
		peers:  atls.NewLimiter(atls.Limits{PerPeer: s.limits.PerPeer, PerPeerBurst: s.limits.PerPeerBurst, MaxPeers: maxPeers}),
		busy:   map[string]int{},
		limits: s.limits,
		// One line a second at most about refused calls, with the number refused since the last.
		refusalLog: rate.NewLimiter(1, 1),
	}
	srv := grpc.NewServer(s.opts...)
	recoverproto.RegisterRecoveryServiceServer(srv, h)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	s.log.Info("recovery server waiting for berth recover",
		zap.String("address", lis.Addr().String()), zap.String("diskUUID", info.DiskUUID))
	select {
	case err := <-errc:
		return fmt.Errorf("serving recovery: %w", err)
	case <-ctx.Done():
	case <-h.opened:
	}
	// Either way the server stops gracefully: a call in flight gets its answer. The caller may end
	// ctx as soon as open returned (the boot stage does when the disk is open), before the handler
	// could answer; stopping at once would cut berth recover off with EOF although its key opened
	// the disk.
	serve.StopGRPC(srv, gracefulStopTimeout)
	if err := <-errc; err != nil {
		s.log.Warn("recovery server failed while stopping", zap.Error(err))
	}
	s.log.Info("recovery server stopped")
	select {
	case <-h.opened:
		return nil
	default:
		return ctx.Err()
	}
}

// handler answers the calls of one Serve.
type handler struct {
	recoverproto.UnimplementedRecoveryServiceServer

	log  *zap.Logger
	info Info
	open OpenFunc
	// ctx is Serve's context: open runs under it, so a caller that hangs up cannot abort an open
	// half-way.
	ctx context.Context
	// turn holds a token while a Recover call runs: one at a time.
	turn chan struct{}
	// opened is closed once open succeeded.
	opened     chan struct{}
	openedOnce sync.Once

	// peers limits each peer address's calls; busy counts each peer's Recover calls waiting or
	// running.
	limits     Limits
	peers      *atls.Limiter
	mu         sync.Mutex
	busy       map[string]int
	refusalLog *rate.Limiter
	refused    int
}

// admit charges a call of peer to its limits; with recover, it also claims the peer's one Recover
// call (release gives it back). A refused call is counted and logged sampled.
func (h *handler) admit(peer string, recover bool) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if (!recover || h.busy[peer] < h.limits.Waiting) && h.peers.AllowPeer(peer) {
		if recover {
			h.busy[peer]++
		}
		return true
	}
	h.refused++
	if h.refusalLog.Allow() {
		h.log.Warn("recovery calls refused: over the per-address limit", zap.String("peer", peer), zap.Int("refusedSinceLastLine", h.refused))
		h.refused = 0
	}
	return false
}

func (h *handler) release(peer string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.busy[peer]--; h.busy[peer] <= 0 {
		delete(h.busy, peer)
	}
}

// Info implements the Info RPC.
func (h *handler) Info(ctx context.Context, _ *recoverproto.InfoRequest) (*recoverproto.InfoResponse, error) {
	if !h.admit(atls.PeerHost(ctx), false) {
		return nil, errLimited
	}
	h.log.Info("recovery info requested", zap.String("peer", atls.PeerAddr(ctx)))
	return &recoverproto.InfoResponse{DiskUuid: h.info.DiskUUID, ClusterId: h.info.ClusterID, DiskBinding: h.info.Binding}, nil
}

// Recover implements the Recover RPC.
func (h *handler) Recover(ctx context.Context, req *recoverproto.RecoverRequest) (*recoverproto.RecoverResponse, error) {
	peer := atls.PeerHost(ctx)
	if !h.admit(peer, true) {
		return nil, errLimited
	}
	defer h.release(peer)
	log := h.log.With(zap.String("peer", atls.PeerAddr(ctx)))
	key := req.GetDiskKey()
	if len(key) != KeySize {
		log.Warn("recovery key refused: wrong size", zap.Int("bytes", len(key)))
		return nil, errKeySize
	}
	select {
	case h.turn <- struct{}{}:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	case <-h.ctx.Done():
		return nil, errStopping
	}
	defer func() { <-h.turn }()
	select {
	case <-h.opened:
		return nil, errAlreadyOpen
	default:
	}
	if err := h.open(h.ctx, key); err != nil {
		if h.ctx.Err() != nil {
			return nil, errStopping
		}
		log.Warn("recovery key does not open the state disk", zap.Error(err))
		return nil, errWrongKey
	}
	log.Info("state disk opened by berth recover", zap.String("diskUUID", h.info.DiskUUID))
	h.openedOnce.Do(func() { close(h.opened) })
	return &recoverproto.RecoverResponse{}, nil
}
