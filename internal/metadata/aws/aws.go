// Package aws is the metadata provider for EC2 instances. The instance learns who it is from the
// instance metadata service with IMDSv2 only (aws-sdk-go-v2 feature/ec2/imds: a session token from
// PUT /latest/api/token, sent on every GET; no fallback to IMDSv1), and reads its tags and lists its
// peers by tag with the EC2 API (service/ec2 DescribeInstances, paginated).
//
// What the instance reads where (the keys are metadata.Key*):
//
//	identity                IMDS instance-id, placement/region
//	name, addresses         DescribeInstances: the private DNS name, the private IPv4 addresses (primary first)
//	role                    tag berth-role (control-plane | worker)
//	cluster                 tag berth-cluster; peers: DescribeInstances, filters tag:berth-cluster and instance-state-name=running
//	control-plane endpoint  tag berth-control-plane-endpoint (HOST:PORT, e.g. an NLB's DNS name); optional
//	init-secret hash        tag berth-init-secret-hash (hex SHA-256)
//
// Self and peers come from the same DescribeInstances shapes, so an instance is named and addressed
// the same way in its own view and in its peers'. The tags are read with DescribeInstances, so the
// instance metadata option "tags in metadata" is not needed. The instance profile needs
// ec2:DescribeInstances; its credentials come from IMDS as well. A joinservice pod reads IMDS from the
// host network (the DaemonSet is hostNetwork): IMDSv2's default hop limit of 1 refuses a container
// behind another network hop.
//
// Errors: an IMDS session token IMDS refuses again after a fresh one is metadata.ErrTokenExpired;
// IMDS or EC2 throttling (429, RequestLimitExceeded, ...) after the SDK's retries is
// metadata.ErrThrottled; no IMDS at all is metadata.ErrUnreachable; an instance EC2 does not know
// (yet: DescribeInstances is eventually consistent after a launch) is metadata.ErrNotFound.
package aws

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	awssdk "github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials/ec2rolecreds"
	"github.com/aws/aws-sdk-go-v2/feature/ec2/imds"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/smithy-go"
	"k8s.io/utils/clock"

	"github.com/berth-k8s/berth/internal/metadata"
)

// DefaultPeersTTL is how long a listing of the cluster's instances is reused.
const DefaultPeersTTL = 5 * time.Second

// imdsAttempts is how often one IMDS call is tried: a 401 (the token expired or was revoked) drops
// the token, so the second attempt fetches a new one; a second 401 is metadata.ErrTokenExpired.
const imdsAttempts = 2

// imdsRetryDelay is the wait before the second IMDS attempt. IMDS is a link-local service and the
// usual reason for a retry is a token to refetch: no reason for the SDK's backoff of up to a second.
const imdsRetryDelay = 50 * time.Millisecond

// IMDS client timeouts, as short as the SDK's own defaults: off EC2 nothing answers at all.
const (
	imdsDialTimeout           = 250 * time.Millisecond
	imdsResponseHeaderTimeout = 500 * time.Millisecond
)

// maxValue bounds what is read from one IMDS path.
const maxValue = 64 << 10

// errInstanceNotFound is the EC2 error code for an instance ID it does not know.
const errInstanceNotFound = "InvalidInstanceID.NotFound"

// Config configures a Provider. The zero value talks to the real IMDS and EC2 API.
type Config struct {
	// IMDSEndpoint is the instance metadata service's base URL; empty means http://169.254.169.254.
	IMDSEndpoint string
	// EC2Endpoint is the EC2 API's base URL; empty means the region's endpoint.
	EC2Endpoint string
	// Region overrides the region IMDS reports.
	Region string
	// Credentials sign EC2 API calls; nil means the instance profile's, read from IMDS.
	Credentials awssdk.CredentialsProvider
	// HTTPClient is used for IMDS and the EC2 API; nil means the SDK's (for IMDS with short timeouts).
	HTTPClient *http.Client
	// EC2Attempts is how often an EC2 call is tried (the SDK retries throttling and 5xx); 0 means the SDK's default.
	EC2Attempts int
	// PeersTTL is how long a listing of peers is reused; 0 means DefaultPeersTTL, negative lists every time.
	PeersTTL time.Duration
	// Clock is the peer cache's clock; nil means the real one.
	Clock clock.PassiveClock
}

// Provider answers metadata queries on EC2. It is safe for concurrent use.
type Provider struct {
	imds  *imds.Client
	cfg   Config
	peers metadata.PeerCache

	mu  sync.Mutex
	ec2 *ec2.Client // built on first use, for the region IMDS reports
}

// New returns a provider. It makes no request yet.
func New(cfg Config) *Provider {
	var base imds.HTTPClient = awshttp.NewBuildableClient().
		WithDialerOptions(func(d *net.Dialer) { d.Timeout = imdsDialTimeout }).
		WithTransportOptions(func(tr *http.Transport) { tr.ResponseHeaderTimeout = imdsResponseHeaderTimeout })
	if cfg.HTTPClient != nil {
		base = cfg.HTTPClient
	}
	opts := imds.Options{
		Endpoint:          cfg.IMDSEndpoint,
		ClientEnableState: imds.ClientEnabled,
		EnableFallback:    awssdk.FalseTernary,
		Retryer: retry.NewStandard(func(o *retry.StandardOptions) {
			o.MaxAttempts = imdsAttempts
			o.Backoff = retry.BackoffDelayerFunc(func(int, error) (time.Duration, error) { return imdsRetryDelay, nil })
		}),
		// Without this the client replaces the backoff above with its own (jittered, up to 1 s).
		DisableDefaultMaxBackoff: true,
		HTTPClient:               observer{next: base},
	}
	ttl := cfg.PeersTTL
	if ttl == 0 {
		ttl = DefaultPeersTTL
	}
	return &Provider{imds: imds.New(opts), cfg: cfg, peers: metadata.PeerCache{TTL: ttl, Clock: cfg.Clock}}
}

// observer records what the last IMDS exchange of a call ended with. The SDK's IMDS client wraps a
// rejected token and a failed token request in an error type that hides its cause (no Unwrap), so
// the provider maps errors from what it saw on the wire instead.
type observer struct{ next imds.HTTPClient }

type exchangeKey struct{}

// exchange is the outcome of the last HTTP request of one IMDS call.
type exchange struct {
	mu      sync.Mutex
	status  int
	sendErr error
}

func (o observer) Do(req *http.Request) (*http.Response, error) {
	resp, err := o.next.Do(req)
	if x, ok := req.Context().Value(exchangeKey{}).(*exchange); ok {
		x.mu.Lock()
		x.status, x.sendErr = 0, err
		if resp != nil {
			x.status = resp.StatusCode
		}
		x.mu.Unlock()
	}
	return resp, err
}

// imdsCall runs one IMDS call and maps its error.
func imdsCall[T any](ctx context.Context, what string, call func(context.Context) (T, error)) (T, error) {
	x := &exchange{}
	out, err := call(context.WithValue(ctx, exchangeKey{}, x))
	if err != nil {
		x.mu.Lock()
		status, sendErr := x.status, x.sendErr
		x.mu.Unlock()
		return out, fmt.Errorf("reading %s from IMDS: %w", what, imdsError(ctx, err, status, sendErr))
	}
	return out, nil
}

func (p *Provider) get(ctx context.Context, path string) (string, error) {
	out, err := imdsCall(ctx, path, func(ctx context.Context) (*imds.GetMetadataOutput, error) {
		return p.imds.GetMetadata(ctx, &imds.GetMetadataInput{Path: path})
	})
	if err != nil {
		return "", err
	}
	defer out.Content.Close()
	b, err := io.ReadAll(io.LimitReader(out.Content, maxValue))
	if err != nil {
		return "", fmt.Errorf("reading %s from IMDS: %w", path, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// ec2Client returns the EC2 client for this instance's region, built on first use; its credentials
// cache lives as long as the provider.
func (p *Provider) ec2Client(ctx context.Context) (*ec2.Client, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ec2 != nil {
		return p.ec2, nil
	}
	region := p.cfg.Region
	if region == "" {
		var err error
		if region, err = p.get(ctx, "placement/region"); err != nil {
			return nil, err
		}
	}
	creds := p.cfg.Credentials
	if creds == nil {
		creds = awssdk.NewCredentialsCache(ec2rolecreds.New(func(o *ec2rolecreds.Options) { o.Client = p.imds }))
	}
	// The role's credentials come from IMDS too: a failure there is mapped like any IMDS call.
	creds = observedCredentials{next: creds}
	opts := ec2.Options{Region: region, Credentials: creds, RetryMaxAttempts: p.cfg.EC2Attempts}
	if p.cfg.EC2Endpoint != "" {
		opts.BaseEndpoint = awssdk.String(p.cfg.EC2Endpoint)
	}
	if p.cfg.HTTPClient != nil {
		opts.HTTPClient = p.cfg.HTTPClient
	}
	p.ec2 = ec2.New(opts)
	return p.ec2, nil
}

// describeSelf returns this instance's EC2 description and tags.
func (p *Provider) describeSelf(ctx context.Context) (*ec2.Client, ec2types.Instance, map[string]string, error) {
	id, err := p.get(ctx, "instance-id")
	if err != nil {
		return nil, ec2types.Instance{}, nil, err
	}
	client, err := p.ec2Client(ctx)
	if err != nil {
		return nil, ec2types.Instance{}, nil, err
	}
	out, err := client.DescribeInstances(ctx, &ec2.DescribeInstancesInput{InstanceIds: []string{id}})
	if err != nil {
		return nil, ec2types.Instance{}, nil, fmt.Errorf("describing instance %s: %w", id, apiError(err))
	}
	for _, r := range out.Reservations {
		for _, in := range r.Instances {
			if awssdk.ToString(in.InstanceId) == id {
				return client, in, tags(in.Tags), nil
			}
		}
	}
	return nil, ec2types.Instance{}, nil, fmt.Errorf("describing instance %s: %w", id, metadata.ErrNotFound)
}

func tags(ts []ec2types.Tag) map[string]string {
	m := make(map[string]string, len(ts))
	for _, t := range ts {
		m[awssdk.ToString(t.Key)] = awssdk.ToString(t.Value)
	}
	return m
}

// instance names and addresses a described instance: its private DNS name, its primary private IPv4
// address first, then the other private addresses of its network interfaces.
func instance(in ec2types.Instance) metadata.Instance {
	out := metadata.Instance{Name: awssdk.ToString(in.PrivateDnsName)}
	add := func(ip string) {
		if ip != "" && !slices.Contains(out.IPs, ip) {
			out.IPs = append(out.IPs, ip)
		}
	}
	add(awssdk.ToString(in.PrivateIpAddress))
	for _, nic := range in.NetworkInterfaces {
		for _, a := range nic.PrivateIpAddresses {
			add(awssdk.ToString(a.PrivateIpAddress))
		}
	}
	return out
}

// Self returns this instance as EC2 describes it: its private DNS name and addresses, its role from its tag.
func (p *Provider) Self(ctx context.Context) (metadata.Instance, error) {
	_, in, tags, err := p.describeSelf(ctx)
	if err != nil {
		return metadata.Instance{}, err
	}
	self := instance(in)
	v, ok := tags[metadata.KeyRole]
	if self.Role, err = metadata.ParseRole(v, ok); err != nil {
		return metadata.Instance{}, fmt.Errorf("instance %s: %w", self.Name, err)
	}
	if err := self.Validate(); err != nil {
		return metadata.Instance{}, err
	}
	return self, nil
}

// Peers returns the running instances tagged with this instance's cluster, this one included,
// sorted by name. Instances without a valid role tag or without a private address are left out.
func (p *Provider) Peers(ctx context.Context) ([]metadata.Instance, error) {
	return p.peers.Get(ctx, p.listPeers)
}

func (p *Provider) listPeers(ctx context.Context) ([]metadata.Instance, error) {
	client, self, tags, err := p.describeSelf(ctx)
	if err != nil {
		return nil, err
	}
	cluster := tags[metadata.KeyCluster]
	if cluster == "" {
		return nil, fmt.Errorf("instance %s: %w", awssdk.ToString(self.InstanceId), metadata.ErrMissingCluster)
	}
	pages := ec2.NewDescribeInstancesPaginator(client, &ec2.DescribeInstancesInput{Filters: []ec2types.Filter{
		{Name: awssdk.String("tag:" + metadata.KeyCluster), Values: []string{cluster}},
		{Name: awssdk.String("instance-state-name"), Values: []string{string(ec2types.InstanceStateNameRunning)}},
	}})
	var peers []metadata.Instance
	for pages.HasMorePages() {
		out, err := pages.NextPage(ctx)
		if err != nil {
			return nil, fmt.Errorf("listing instances of cluster %q: %w", cluster, apiError(err))
		}
		for _, r := range out.Reservations {
			for _, in := range r.Instances {
				if peer, ok := peerOf(in, cluster); ok {
					peers = append(peers, peer)
				}
			}
		}
	}
	return peers, nil
}

// peerOf turns a described instance into a peer, if it is a running member of cluster with a role.
func peerOf(in ec2types.Instance, cluster string) (metadata.Instance, bool) {
	t := tags(in.Tags)
	if t[metadata.KeyCluster] != cluster || in.State == nil || in.State.Name != ec2types.InstanceStateNameRunning {
		return metadata.Instance{}, false
	}
	v, ok := t[metadata.KeyRole]
	role, err := metadata.ParseRole(v, ok)
	if err != nil {
		return metadata.Instance{}, false
	}
	peer := instance(in)
	peer.Role = role
	return peer, peer.Validate() == nil
}

// ControlPlaneEndpoint returns the tag berth-control-plane-endpoint, or an error wrapping
// metadata.ErrNotFound when the instance has none (the init node then uses its own address).
func (p *Provider) ControlPlaneEndpoint(ctx context.Context) (string, error) {
	_, _, tags, err := p.describeSelf(ctx)
	if err != nil {
		return "", err
	}
	v, ok := tags[metadata.KeyControlPlaneEndpoint]
	if !ok {
		return "", fmt.Errorf("tag %s: %w", metadata.KeyControlPlaneEndpoint, metadata.ErrNotFound)
	}
	return metadata.CheckEndpoint(v)
}

// InitSecretHash returns the tag berth-init-secret-hash, or an error wrapping metadata.ErrNotFound.
func (p *Provider) InitSecretHash(ctx context.Context) ([]byte, error) {
	_, _, tags, err := p.describeSelf(ctx)
	if err != nil {
		return nil, err
	}
	v, ok := tags[metadata.KeyInitSecretHash]
	if !ok {
		return nil, fmt.Errorf("tag %s: %w", metadata.KeyInitSecretHash, metadata.ErrNotFound)
	}
	return metadata.ParseInitSecretHash(v)
}

// httpStatus returns the HTTP status of a failed SDK call, or 0.
func httpStatus(err error) int {
	var se interface{ HTTPStatusCode() int }
	if errors.As(err, &se) {
		return se.HTTPStatusCode()
	}
	return 0
}

// imdsError maps an IMDS call's error to the named errors, from the last exchange on the wire (status,
// or the transport error when no response came).
func imdsError(ctx context.Context, err error, status int, sendErr error) error {
	switch {
	case ctx.Err() != nil:
		return err
	case sendErr != nil:
		return fmt.Errorf("%w: %w", metadata.ErrUnreachable, sendErr)
	case status == http.StatusUnauthorized:
		return fmt.Errorf("%w: IMDS answered 401 to a fresh IMDSv2 session token: %w", metadata.ErrTokenExpired, err)
	case status == http.StatusNotFound:
		return fmt.Errorf("%w: %w", metadata.ErrNotFound, err)
	case status == http.StatusTooManyRequests:
		return fmt.Errorf("%w: %w", metadata.ErrThrottled, err)
	case status == http.StatusForbidden:
		return fmt.Errorf("IMDS refused the request (HTTP 403: the instance metadata service is disabled for this instance?): %w", err)
	}
	return err
}

// observedCredentials maps the errors of credentials read from IMDS (the instance profile's role).
type observedCredentials struct{ next awssdk.CredentialsProvider }

func (o observedCredentials) Retrieve(ctx context.Context) (awssdk.Credentials, error) {
	return imdsCall(ctx, "the instance profile's credentials", o.next.Retrieve)
}

// apiError maps an EC2 API error to the named errors: the SDK's throttle codes (RequestLimitExceeded,
// Throttling, ...) and HTTP 429.
func apiError(err error) error {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		if _, ok := retry.DefaultThrottleErrorCodes[ae.ErrorCode()]; ok {
			return fmt.Errorf("%w: %w", metadata.ErrThrottled, err)
		}
		if ae.ErrorCode() == errInstanceNotFound {
			return fmt.Errorf("%w: %w", metadata.ErrNotFound, err)
		}
	}
	if httpStatus(err) == http.StatusTooManyRequests {
		return fmt.Errorf("%w: %w", metadata.ErrThrottled, err)
	}
	return err
}
