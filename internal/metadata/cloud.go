package metadata

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// The labels (GCP), tags (AWS, Azure) and metadata attributes (GCP) the cloud providers read. The
// table in README.md says which cloud keeps which value where.
const (
	// KeyCluster names the cluster an instance belongs to; peers are the instances with the same value.
	KeyCluster = "berth-cluster"
	// KeyRole holds the instance's role: "control-plane" or "worker".
	KeyRole = "berth-role"
	// KeyControlPlaneEndpoint holds HOST:PORT of the Kubernetes API (a load balancer); optional.
	KeyControlPlaneEndpoint = "berth-control-plane-endpoint"
	// KeyInitSecretHash holds the hex SHA-256 of the init secret; set on the instance `berth init` initializes.
	KeyInitSecretHash = "berth-init-secret-hash"
)

// Errors of the cloud providers (gcp, aws, azure). Each wraps the cloud's own error where there is one.
var (
	// ErrThrottled is returned when the cloud refused a call for its rate limit (HTTP 429,
	// RequestLimitExceeded, Throttling) after the SDK's own retries. Callers retry later.
	ErrThrottled = errors.New("cloud API throttled the request")
	// ErrMissingRole is returned when an instance carries no role label or tag (KeyRole).
	ErrMissingRole = errors.New("instance has no " + KeyRole + " label or tag")
	// ErrInvalidRole is returned when an instance's role label or tag is neither control-plane nor worker.
	ErrInvalidRole = errors.New("instance has an unknown " + KeyRole)
	// ErrMissingCluster is returned when this instance carries no cluster label or tag (KeyCluster),
	// so its peers cannot be told apart from other machines of the account.
	ErrMissingCluster = errors.New("instance has no " + KeyCluster + " label or tag")
	// ErrUnreachable is returned when the instance metadata service cannot be reached (not on that
	// cloud, a firewall, a wrong --metadata-url).
	ErrUnreachable = errors.New("instance metadata service unreachable")
	// ErrTokenExpired is returned when the cloud refused the instance's token again after a fresh one
	// was fetched: AWS IMDS rejected its IMDSv2 session token (HTTP 401), or Azure Resource Manager an
	// expired access token. A clock far off, or a token cached past its lifetime, are the usual causes.
	ErrTokenExpired = errors.New("cloud rejected an expired token")
)

// ParseRole turns the value of a role label or tag into a Role. An empty value is ErrMissingRole,
// an unknown one ErrInvalidRole; the value, which comes from the platform, is quoted in the error.
func ParseRole(v string, present bool) (Role, error) {
	if !present || v == "" {
		return "", ErrMissingRole
	}
	r := Role(v)
	if !r.Valid() {
		return "", fmt.Errorf("%w: %q", ErrInvalidRole, v)
	}
	return r, nil
}

// ParseInitSecretHash decodes the hex SHA-256 of the init secret as a label, tag or attribute holds it.
func ParseInitSecretHash(v string) ([]byte, error) {
	h, err := hex.DecodeString(strings.TrimSpace(v))
	if err != nil || len(h) != 32 {
		return nil, fmt.Errorf("%s is not 64 hex digits", KeyInitSecretHash)
	}
	return h, nil
}

// CheckEndpoint checks that v (a label, tag or attribute value) is HOST:PORT.
func CheckEndpoint(v string) (string, error) {
	v = strings.TrimSpace(v)
	host, port, err := net.SplitHostPort(v)
	if err != nil || host == "" || port == "" {
		return "", fmt.Errorf("%s %q is not HOST:PORT", KeyControlPlaneEndpoint, v)
	}
	return v, nil
}

// SortInstances orders instances by name, so that every caller sees peers in the same order.
func SortInstances(in []Instance) {
	slices.SortFunc(in, func(a, b Instance) int { return strings.Compare(a.Name, b.Name) })
}

// PeerCache keeps the last listing of a cluster's instances for TTL, so that callers that ask on
// every attempt (the join client's retry loop, the joinservice on every join) do not turn into one
// cloud API listing each. Concurrent callers wait for one listing. A failed listing is not kept.
type PeerCache struct {
	// TTL is how long a listing is served; 0 lists on every call.
	TTL time.Duration
	// Clock tells the time; nil means the real clock.
	Clock clock.PassiveClock

	mu    sync.Mutex
	at    time.Time
	peers []Instance
}

// Get returns the cached listing, or calls list when there is none or it is older than TTL.
func (c *PeerCache) Get(ctx context.Context, list func(context.Context) ([]Instance, error)) ([]Instance, error) {
	clk := c.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.peers != nil && clk.Since(c.at) < c.TTL {
		return slices.Clone(c.peers), nil
	}
	peers, err := list(ctx)
	if err != nil {
		return nil, err
	}
	if peers == nil {
		peers = []Instance{}
	}
	SortInstances(peers)
	c.peers, c.at = peers, clk.Now()
	return slices.Clone(peers), nil
}
