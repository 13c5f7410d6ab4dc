// Package joinclient is the bootstrapper's join side: it waits until the cluster's joinservice
// answers, asks it for a join ticket, and hands the ticket to a joiner that takes the node lock and
// runs kubeadm join.
//
// Waiting is cheap and quick: the first attempt goes out at once, later ones after a jittered
// backoff that starts at 100 ms and is capped at 500 ms, so a node starts joining within half a second of
// the joinservice answering. A joinservice that answers with a rejection is asked again less
// often (capped at 10 s), and every rejection is logged with the reason the joinservice gave.
package joinclient

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"math"
	"net"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// Waits between attempts: from initialBackoff, doubling up to maxBackoff while no joinservice
// answers, up to maxRejectedWait while one rejects this node; each wait is jittered by ±50 %.
const (
	initialBackoff  = 100 * time.Millisecond
	maxBackoff      = 500 * time.Millisecond
	maxRejectedWait = 10 * time.Second
	callTimeout     = 10 * time.Second
)

// Client asks the joinservice for a ticket and joins with it.
type Client struct {
	log      *zap.Logger
	meta     metadataAPI
	dial     dialFunc
	joiner   clusterJoiner
	port     int
	diskUUID string
	// trace records the join's phases (trace.go); ready waits for the Node, nil: no wait.
	trace *jointrace.Recorder
	ready nodeReadiness
}

// New returns a Client. dial opens a joinservice client for HOST:PORT.
func New(log *zap.Logger, meta metadataAPI, dial dialFunc, joiner clusterJoiner, diskUUID string) *Client {
	return &Client{log: log, meta: meta, dial: dial, joiner: joiner, port: joinconfig.JoinPort, diskUUID: diskUUID,
		trace: jointrace.NewRecorder(log, nil, "")}
}

// WithPort sets the joinservice port (default joinconfig.JoinPort).
func (c *Client) WithPort(port int) *Client {
	c.port = port
	return c
}

// Run waits for a ticket and joins. It returns nil when the node joined or when ctx ended (the
// InitServer won the lock), and an error when the join failed after the lock was taken.
func (c *Client) Run(ctx context.Context) error {
	c.trace.Begin(jointrace.PhaseMetadata)
	self, err := c.waitForSelf(ctx)
	if err != nil {
		return nil //nolint:nilerr // ctx ended: the init side won or the daemon stops
	}
	c.trace.Succeed("instance " + self.Name + ", role " + string(self.Role))
	c.trace.Begin(jointrace.PhaseTicket)
	log := c.log.With(zap.String("node", self.Name), zap.String("role", string(self.Role)))
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generating kubelet key: %w", err)
	}
	csr, err := kubeletCSR(self, key)
	if err != nil {
		return err
	}
	var (
		delay    = newRetryDelay()
		attempt  int
		endpoint string
		ticket   *joinproto.IssueJoinTicketResponse
	)
	err = wait.DelayFunc(delay.next).Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		attempt++
		endpoints, err := c.endpoints(ctx, self)
		if err != nil {
			log.Debug("listing joinservice endpoints", zap.Error(err))
		}
		delay.rejected = false
		for _, ep := range endpoints {
			t, err := c.requestTicket(ctx, ep, self, csr)
			if err == nil {
				endpoint, ticket = ep, t
				return true, nil
			}
			if ctx.Err() != nil {
				return false, ctx.Err()
			}
			if r, ok := asRejection(err); ok {
				delay.rejected = true
				if r.unverified {
					// Refused on the measurements this node claimed, before the joinservice proved
					// itself: the log says so, because anything answering at the endpoint can send
					// this. It slows the retries like any rejection (an endpoint in the path can
					// delay a join anyway, by dropping it) and keeps them under the joinservice's
					// handshake rate limit, so the node keeps seeing the verdict.
					log.Warn("join refused by a joinservice that has not attested yet", zap.String("endpoint", ep),
						zap.String("reason", r.reason), zap.String("message", r.message))
					continue
				}
				log.Warn("join ticket rejected", zap.String("endpoint", ep), zap.String("code", r.code.String()),
					zap.String("reason", r.reason), zap.String("message", r.message))
				c.trace.Note(r.reason, fmt.Sprintf("attempt %d: %s refused: %s", attempt, ep, r.message))
				continue
			}
			if st, ok := status.FromError(err); ok && strings.Contains(st.Message(), "handshake failed") {
				// The joinservice answered but did not prove it runs this image on a bootstrapped
				// node (or this node's own attestation failed): never silent.
				log.Warn("attested handshake with joinservice failed", zap.String("endpoint", ep), zap.String("message", st.Message()))
				continue
			}
			log.Debug("joinservice not reachable", zap.String("endpoint", ep), zap.Error(err))
		}
		return false, nil
	})
	if err != nil {
		return nil //nolint:nilerr // ctx ended: the init side won or the daemon stops
	}
	log.Info("join ticket received", zap.String("endpoint", endpoint), zap.Int("attempt", attempt))
	c.trace.Succeed(fmt.Sprintf("attempt %d, from %s", attempt, endpoint))
	c.trace.Begin(jointrace.PhaseJoin)
	err = c.joiner.Join(ctx, self, ticket, key)
	if ctx.Err() != nil {
		// The init side took the lock, or the daemon stops: no join to report.
		return err
	}
	c.afterJoin(ctx, log, self, ticket.GetNodeName(), err)
	return err
}

// retryDelay is the wait between two attempts: a wait.Backoff whose cap follows the last
// attempt's answers, so a rejection slows the retries and a round without one speeds them up
// again at once.
type retryDelay struct {
	backoff wait.Backoff
	// rejected is set when a joinservice rejected this node in the last attempt.
	rejected bool
}

func newRetryDelay() *retryDelay {
	return &retryDelay{backoff: wait.Backoff{Duration: initialBackoff, Factor: 2, Steps: math.MaxInt32, Cap: maxBackoff}}
}

// next returns the wait before the next attempt. It is a wait.DelayFunc.
func (d *retryDelay) next() time.Duration {
	limit := maxBackoff
	if d.rejected {
		limit = maxRejectedWait
	}
	// A new cap lets a backoff that reached the old one grow again.
	d.backoff.Cap, d.backoff.Steps = limit, math.MaxInt32
	d.backoff.Duration = min(d.backoff.Duration, limit)
	// wait.Jitter adds up to twice the half it is given: the wait ±50 %, within the cap.
	return min(wait.Jitter(d.backoff.Step()/2, 2), limit)
}

func (c *Client) waitForSelf(ctx context.Context) (metadata.Instance, error) {
	var self metadata.Instance
	err := wait.DelayFunc(newRetryDelay().next).Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		var err error
		if self, err = c.meta.Self(ctx); err != nil {
			c.log.Debug("reading own metadata", zap.Error(err))
			return false, nil
		}
		return true, nil
	})
	return self, err
}

// endpoints returns HOST:PORT of every control plane but this node.
func (c *Client) endpoints(ctx context.Context, self metadata.Instance) ([]string, error) {
	peers, err := c.meta.Peers(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing peers: %w", err)
	}
	var eps []string
	for _, p := range peers {
		if p.Role != metadata.RoleControlPlane || p.Name == self.Name || len(p.IPs) == 0 {
			continue
		}
		eps = append(eps, net.JoinHostPort(p.IPs[0], strconv.Itoa(c.port)))
	}
	return eps, nil
}

func (c *Client) requestTicket(ctx context.Context, endpoint string, self metadata.Instance, csr []byte) (*joinproto.IssueJoinTicketResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	client, closer, err := c.dial(ctx, endpoint)
	if err != nil {
		return nil, fmt.Errorf("dialing joinservice: %w", err)
	}
	defer closer.Close()
	role := joinproto.Role_ROLE_WORKER
	if self.Role == metadata.RoleControlPlane {
		role = joinproto.Role_ROLE_CONTROL_PLANE
	}
	return client.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr, Role: role, DiskUuid: c.diskUUID})
}

type rejection struct {
	code    codes.Code
	reason  string
	message string
	// unverified marks a refusal in the handshake, before the joinservice attested.
	unverified bool
}

// asRejection reports whether err is an answer from the joinservice (as opposed to a transport
// failure) and extracts its reason.
func asRejection(err error) (rejection, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return rejection{}, false
	}
	// A joinservice that refused this node's claimed measurements did so in the handshake, which gRPC
	// reports as an unavailable connection; the verdict is in the message.
	if r, ok := atls.ParseRejection(st.Message()); ok {
		return rejection{code: codes.PermissionDenied, reason: r.Reason, message: r.Message, unverified: true}, true
	}
	switch st.Code() {
	case codes.PermissionDenied, codes.InvalidArgument, codes.FailedPrecondition, codes.ResourceExhausted, codes.Unauthenticated:
	default:
		return rejection{}, false
	}
	r := rejection{code: st.Code(), message: st.Message(), reason: "UNSPECIFIED"}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			r.reason = info.GetReason()
		}
	}
	return r, true
}

func kubeletCSR(self metadata.Instance, key crypto.Signer) ([]byte, error) {
	tmpl := &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "system:node:" + self.Name, Organization: []string{"system:nodes"}},
	}
	for _, ip := range self.IPs {
		if parsed := net.ParseIP(ip); parsed != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, parsed)
		}
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		return nil, fmt.Errorf("creating kubelet CSR: %w", err)
	}
	return der, nil
}

// dialFunc opens a joinservice client for HOST:PORT; closing the closer releases the connection.
type dialFunc func(ctx context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error)

// metadataAPI is what joining needs to know about this node and its peers.
type metadataAPI interface {
	Self(ctx context.Context) (metadata.Instance, error)
	Peers(ctx context.Context) ([]metadata.Instance, error)
}

// clusterJoiner joins the node with a ticket.
type clusterJoiner interface {
	// Join takes the node lock and joins. It returns nil if the lock was already taken by init.
	Join(ctx context.Context, self metadata.Instance, ticket *joinproto.IssueJoinTicketResponse, kubeletKey crypto.Signer) error
}
