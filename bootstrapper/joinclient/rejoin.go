package joinclient

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// Waits between rounds of rejoin attempts (one round asks every control plane once): from
// rejoinInitialBackoff, doubling up to rejoinMaxBackoff, each wait lengthened by up to
// rejoinJitter of itself. A node whose control planes reboot with it asks again within a second of
// one of them answering.
const (
	rejoinInitialBackoff = 100 * time.Millisecond
	rejoinMaxBackoff     = time.Second
	rejoinJitter         = 0.5
)

// Bounds of what a refusal may put into an error: the joinservice's text is untrusted.
const (
	maxReasonLen  = 64
	maxMessageLen = 512
)

// ErrRejoinRefused is wrapped by every *RejoinRefusedError.
var ErrRejoinRefused = errors.New("rejoin refused")

// RejoinRefusedError is a joinservice's refusal to give this node its disk key: PermissionDenied
// (the attestation, the instance or the disk binding did not pass: MEASUREMENT_MISMATCH,
// UNKNOWN_PEER, DISK_NOT_BOUND, JOINSERVICE_NOT_BOUND, ...), Unauthenticated, InvalidArgument
// (BAD_DISK_UUID), FailedPrecondition, or a refusal of this node's claimed measurements in the
// handshake. Reason and Message come from the joinservice and are escaped: control and non-ASCII
// characters are replaced with '?', and they are cut to a bounded length.
type RejoinRefusedError struct {
	// Endpoint is HOST:PORT of the joinservice that refused.
	Endpoint string
	// Code is the gRPC code of the refusal (PermissionDenied for a refusal in the handshake).
	Code codes.Code
	// Reason is the refusal's reason code (ErrorInfo.reason), "UNSPECIFIED" when it gave none.
	Reason string
	// Message is the refusal's message.
	Message string
	// Unverified marks a refusal in the handshake, before the joinservice attested: anything
	// answering at the endpoint can send it.
	Unverified bool
}

func (e *RejoinRefusedError) Error() string {
	by := "joinservice"
	if e.Unverified {
		by = "joinservice that has not attested yet"
	}
	return fmt.Sprintf("rejoin refused by %s %s: %s (%s): %s", by, e.Endpoint, e.Reason, e.Code, e.Message)
}

// Unwrap makes errors.Is(err, ErrRejoinRefused) hold.
func (e *RejoinRefusedError) Unwrap() error { return ErrRejoinRefused }

// Rejoin asks the cluster's joinservices for the disk key of this node's state disk diskUUID,
// presenting binding, the disk binding its join ticket carried. It asks every control plane metadata
// lists (but this node) in turn, at port, over dial (mutual attested TLS: internal/joindial), and
// repeats the round after a jittered backoff (rejoinInitialBackoff to rejoinMaxBackoff) while no
// joinservice answers: unreachable, still booting, rate-limiting, or failing the attested handshake
// (a control plane that has not re-extended its lock register yet).
//
// It returns the disk key and cluster ID from the first joinservice that gives them. When a round
// got no key and at least one joinservice refused, it returns that refusal at once as a
// *RejoinRefusedError (errors.Is ErrRejoinRefused) so the caller can log the reason; when ctx ends
// first, an error wrapping ctx.Err(). A refusal is not necessarily final: the cluster's policy may be
// being updated, or a control plane's metadata be behind, so the boot stage keeps calling Rejoin
// with a long backoff while it logs each refusal's reason (and waits for `berth recover` beside it).
//
// Neither the disk key nor the binding is logged.
func Rejoin(ctx context.Context, log *zap.Logger, meta metadataAPI, dial dialFunc, port int, diskUUID string, binding []byte) (diskKey, clusterID []byte, err error) {
	backoff := wait.Backoff{Duration: rejoinInitialBackoff, Factor: 2, Jitter: rejoinJitter, Steps: math.MaxInt32, Cap: rejoinMaxBackoff}
	req := &joinproto.IssueRejoinTicketRequest{DiskUuid: diskUUID, DiskBinding: binding}
	var (
		refusal *RejoinRefusedError
		// last is what the last round got: from each endpoint, or why there was none.
		last    []string
		attempt int
	)
	waitErr := wait.DelayFunc(backoff.Step).Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		attempt++
		endpoints, err := rejoinEndpoints(ctx, meta, port)
		if err != nil {
			last = []string{err.Error()}
			log.Debug("listing joinservice endpoints", zap.Error(err))
			return false, nil
		}
		if len(endpoints) == 0 {
			last = []string{"metadata lists no other control plane"}
			log.Debug("no joinservice endpoint")
			return false, nil
		}
		last = last[:0]
		for _, ep := range endpoints {
			resp, err := askRejoin(ctx, dial, ep, req)
			if err == nil {
				diskKey, clusterID = resp.GetDiskKey(), resp.GetClusterId()
				log.Info("rejoin ticket received", zap.String("endpoint", ep), zap.Int("attempt", attempt))
				return true, nil
			}
			if ctx.Err() != nil {
				return false, ctx.Err()
			}
			last = append(last, ep+": "+err.Error())
			if r, ok := asRejoinRefusal(ep, err); ok {
				log.Warn("rejoin refused", zap.String("endpoint", ep), zap.String("code", r.Code.String()),
					zap.String("reason", r.Reason), zap.String("message", r.Message), zap.Bool("unverified", r.Unverified))
				if refusal == nil {
					refusal = r
				}
				continue
			}
			if st, ok := status.FromError(err); ok && st.Code() == codes.ResourceExhausted {
				log.Warn("rejoin rate-limited", zap.String("endpoint", ep), zap.String("message", printable(st.Message(), maxMessageLen)))
				continue
			}
			if st, ok := status.FromError(err); ok && strings.Contains(st.Message(), "handshake failed") {
				// The joinservice answered but did not prove it runs this image on a node locked to
				// the cluster (after a power cut: not unlocked yet), or this node's attestation failed.
				log.Warn("attested handshake with joinservice failed", zap.String("endpoint", ep), zap.String("message", printable(st.Message(), maxMessageLen)))
				continue
			}
			log.Debug("joinservice not reachable", zap.String("endpoint", ep), zap.Error(err))
		}
		if refusal != nil {
			return false, refusal
		}
		return false, nil
	})
	switch {
	case waitErr == nil:
		return diskKey, clusterID, nil
	case refusal != nil && errors.Is(waitErr, refusal):
		return nil, nil, refusal
	case len(last) > 0:
		return nil, nil, fmt.Errorf("waiting for a rejoin ticket (last round: %s): %w", printable(strings.Join(last, "; "), maxMessageLen), waitErr)
	default:
		return nil, nil, fmt.Errorf("waiting for a rejoin ticket: %w", waitErr)
	}
}

// askRejoin asks the joinservice at endpoint once and checks the answer's shape.
func askRejoin(ctx context.Context, dial dialFunc, endpoint string, req *joinproto.IssueRejoinTicketRequest) (*joinproto.IssueRejoinTicketResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	client, closer, err := dial(ctx, endpoint)
	if err != nil {
		return nil, fmt.Errorf("dialing joinservice: %w", err)
	}
	defer func() { _ = closer.Close() }() // the call's outcome is decided; closing frees the connection
	resp, err := client.IssueRejoinTicket(ctx, req)
	if err != nil {
		return nil, err
	}
	if len(resp.GetDiskKey()) != clusterkeys.KeySize || len(resp.GetClusterId()) != clusterkeys.KeySize {
		return nil, fmt.Errorf("reading rejoin ticket: disk key of %d bytes and cluster ID of %d bytes, want %d each",
			len(resp.GetDiskKey()), len(resp.GetClusterId()), clusterkeys.KeySize)
	}
	return resp, nil
}

// rejoinEndpoints returns HOST:PORT of every control plane but this node. When metadata cannot say
// which instance this node is, every control plane is asked (this node's own joinservice does not
// run before its disk is open: asking it costs a refused connection).
func rejoinEndpoints(ctx context.Context, meta metadataAPI, port int) ([]string, error) {
	self, err := meta.Self(ctx)
	if err != nil {
		self = metadata.Instance{}
	}
	peers, err := meta.Peers(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing peers: %w", err)
	}
	var eps []string
	for _, p := range peers {
		if p.Role != metadata.RoleControlPlane || (self.Name != "" && p.Name == self.Name) || len(p.IPs) == 0 {
			continue
		}
		eps = append(eps, net.JoinHostPort(p.IPs[0], strconv.Itoa(port)))
	}
	return eps, nil
}

// asRejoinRefusal reports whether err is a joinservice's refusal to give the disk key.
func asRejoinRefusal(endpoint string, err error) (*RejoinRefusedError, bool) {
	r, ok := asRejection(err)
	if !ok || r.code == codes.ResourceExhausted {
		return nil, false
	}
	return &RejoinRefusedError{
		Endpoint:   endpoint,
		Code:       r.code,
		Reason:     printable(r.reason, maxReasonLen),
		Message:    printable(r.message, maxMessageLen),
		Unverified: r.unverified,
	}, true
}

// printable replaces control and non-ASCII characters of untrusted text with '?' and cuts it to at
// most n bytes.
func printable(s string, n int) string {
	if len(s) > n {
		s = s[:n]
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e {
			return '?'
		}
		return r
	}, s)
}
