package joinclient

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// ErrRevoked is wrapped by a check-in's REVOKED answer: an operator removed this machine.
var ErrRevoked = errors.New("this machine was removed from the cluster")

// ErrNoCheckIn means no joinservice answered a check-in before its backoff ran out: unreachable,
// still booting, rate-limiting, failing the attested handshake, or refusing for another reason.
var ErrNoCheckIn = errors.New("no joinservice answered the check-in")

// CheckInBackoff is a worker's check-in before its kubelet starts: eight rounds over about twenty
// seconds (waits from 1 s growing by 30 %, jittered by up to 20 %). A worker restarted alone checks
// in on its first round; after a power cut of the whole cluster its kubelet waits only that long for
// a control plane's joinservice, then starts and the node checks in beside it
// (bootstage.Stage.KeepCheckingIn, owned by the daemon).
var CheckInBackoff = wait.Backoff{Duration: time.Second, Factor: 1.3, Jitter: 0.2, Steps: 8}

// ErrOnlyControlPlane means this node is a control plane and metadata lists no other: no other
// joinservice exists that could judge this machine (its own runs on it, and only after its kubelet),
// so CheckIn asks nobody. Removing a cluster's only control plane is refused anyway (its etcd member
// cannot go without losing quorum), so there is no REVOKED answer it could miss.
var ErrOnlyControlPlane = errors.New("this node is the cluster's only control plane")

// errRoundsOver ends the rounds of a check-in.
var errRoundsOver = errors.New("rounds over")

// CheckIn asks the cluster's joinservices (every control plane metadata lists but this node, at
// port, over dial: mutual attested TLS, an answer taken only from a joinservice locked to clusterID:
// internal/joindial) whether this joined node of cluster clusterID may run: backoff.Steps rounds
// separated by backoff's waits (Step; after Cap every wait is Cap, jittered). It returns nil once one admits the node; an error wrapping ErrRevoked (the
// joinservice's message, escaped, in it) once one answers REVOKED; an error wrapping ErrNoCheckIn
// with the last round's outcome when backoff ran out without either; an error wrapping
// ErrOnlyControlPlane at once, without asking, when this node is a control plane and metadata lists
// no other; ctx's error when ctx ended.
// Any other refusal is logged and asked again: only REVOKED locks a node, and a joinservice that
// cannot tell (its machine record unread) says so with another reason.
func CheckIn(ctx context.Context, log *zap.Logger, meta metadataAPI, dial dialFunc, port int, diskUUID string, clusterID []byte, backoff wait.Backoff) error {
	if onlyControlPlane(ctx, meta) {
		return fmt.Errorf("checking in: %w", ErrOnlyControlPlane)
	}
	req := &joinproto.CheckInRequest{DiskUuid: diskUUID, ClusterId: clusterID}
	var (
		revoked error
		last    []string
		rounds  int
	)
	round := func(ctx context.Context) (bool, error) {
		rounds++
		endpoints, err := rejoinEndpoints(ctx, meta, port)
		if err != nil || len(endpoints) == 0 {
			last = []string{"metadata lists no other control plane"}
			if err != nil {
				last = []string{err.Error()}
			}
			return false, nil
		}
		last = last[:0]
		for _, ep := range endpoints {
			resp, err := askCheckIn(ctx, dial, ep, req)
			if err == nil {
				log.Info("checked in with the cluster", zap.String("endpoint", ep), zap.String("nodeName", printable(resp.GetNodeName(), maxReasonLen)),
					zap.Int("round", rounds))
				return true, nil
			}
			if ctx.Err() != nil {
				return false, ctx.Err()
			}
			last = append(last, ep+": "+err.Error())
			r, ok := asRejection(err)
			if ok && !r.unverified && r.reason == joinledger.ReasonRevoked {
				msg := printable(r.message, maxMessageLen)
				log.Error("the cluster answered the check-in with REVOKED", zap.String("endpoint", ep), zap.String("message", msg))
				revoked = fmt.Errorf("check-in refused by joinservice %s: %s: %w", ep, msg, ErrRevoked)
				return false, revoked
			}
			if ok {
				log.Warn("check-in refused", zap.String("endpoint", ep), zap.String("code", r.code.String()),
					zap.String("reason", printable(r.reason, maxReasonLen)), zap.String("message", printable(r.message, maxMessageLen)),
					zap.Bool("unverified", r.unverified))
				continue
			}
			if st, ok := status.FromError(err); ok && st.Code() != codes.Unavailable {
				log.Warn("check-in failed", zap.String("endpoint", ep), zap.String("message", printable(st.Message(), maxMessageLen)))
				continue
			}
			log.Debug("joinservice not reachable for the check-in", zap.String("endpoint", ep), zap.Error(err))
		}
		return false, nil
	}
	delays := backoff
	err := wait.DelayFunc(delays.Step).Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		done, err := round(ctx)
		if !done && err == nil && rounds >= backoff.Steps {
			return false, errRoundsOver
		}
		return done, err
	})
	switch {
	case err == nil:
		return nil
	case revoked != nil:
		return revoked
	case ctx.Err() != nil:
		return fmt.Errorf("checking in: %w", ctx.Err())
	default:
		return fmt.Errorf("%w after %d rounds (last round: %s)", ErrNoCheckIn, rounds, printable(strings.Join(last, "; "), maxMessageLen))
	}
}

// askCheckIn checks in with the joinservice at endpoint once.
func askCheckIn(ctx context.Context, dial dialFunc, endpoint string, req *joinproto.CheckInRequest) (*joinproto.CheckInResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	client, closer, err := dial(ctx, endpoint)
	if err != nil {
		return nil, fmt.Errorf("dialing joinservice: %w", err)
	}
	defer func() { _ = closer.Close() }() // the call's outcome is decided; closing frees the connection
	return client.CheckIn(ctx, req)
}

// onlyControlPlane reports whether metadata says this node is a control plane and lists no other.
// When metadata cannot tell (an error), the check-in asks as usual.
func onlyControlPlane(ctx context.Context, meta metadataAPI) bool {
	self, err := meta.Self(ctx)
	if err != nil || self.Role != metadata.RoleControlPlane {
		return false
	}
	peers, err := meta.Peers(ctx)
	if err != nil {
		return false
	}
	for _, p := range peers {
		if p.Role == metadata.RoleControlPlane && p.Name != self.Name {
			return false
		}
	}
	return true
}
