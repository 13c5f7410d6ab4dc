// Package gcp is the metadata provider for Compute Engine VMs. The VM learns who it is from the
// metadata server (cloud.google.com/go/compute/metadata: name, zone, project, addresses, instance
// attributes) and its role and cluster from its labels, and lists its peers by label through the
// Compute Engine API (the REST client of google.golang.org/api/compute/v1).
//
// What the VM reads where (the keys are metadata.Key*):
//
//	role                    label berth-role (control-plane | worker), instances.get
//	cluster                 label berth-cluster; peers: instances.aggregatedList, filter labels.berth-cluster, RUNNING only
//	control-plane endpoint  instance attribute berth-control-plane-endpoint (HOST:PORT), metadata server; optional
//	init-secret hash        instance attribute berth-init-secret-hash (hex SHA-256), metadata server
//
// Label values cannot hold ':' or '.', so the endpoint and the hash are attributes. The Compute API is
// called with the VM's service account, whose access token comes from the same metadata server
// (instance/service-accounts/default/token); it needs compute.instances.get and compute.instances.list
// on the project. The local fake of both APIs is gcptest.
package gcp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path"
	"strings"
	"time"

	gcemd "cloud.google.com/go/compute/metadata"
	"golang.org/x/oauth2"
	compute "google.golang.org/api/compute/v1"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/option"
	"k8s.io/utils/clock"

	"github.com/berth-k8s/berth/internal/metadata"
)

// DefaultPeersTTL is how long a listing of the cluster's instances is reused.
const DefaultPeersTTL = 5 * time.Second

// metadataTimeout bounds one request to the metadata server.
const metadataTimeout = 5 * time.Second

// statusRunning is the only instance status whose instances count as peers.
const statusRunning = "RUNNING"

// Config configures a Provider. The zero value talks to the real metadata server and Compute API.
type Config struct {
	// MetadataURL is the metadata server's base URL (scheme and host, e.g. http://127.0.0.1:8080);
	// empty means the well-known address (or GCE_METADATA_HOST).
	MetadataURL string
	// ComputeEndpoint is the Compute Engine API's base URL including /compute/v1/; empty means Google's.
	ComputeEndpoint string
	// ClientOptions are passed to the Compute API client. Without them the client authenticates as the
	// VM's service account, with access tokens from the metadata server at MetadataURL.
	ClientOptions []option.ClientOption
	// PeersTTL is how long a listing of peers is reused; 0 means DefaultPeersTTL, negative lists every time.
	PeersTTL time.Duration
	// Clock is the peer cache's clock; nil means the real one.
	Clock clock.PassiveClock
}

// Provider answers metadata queries on Compute Engine. It is safe for concurrent use.
type Provider struct {
	md      *gcemd.Client
	compute *compute.Service
	peers   metadata.PeerCache
}

// New returns a provider. It makes no request yet.
func New(ctx context.Context, cfg Config) (*Provider, error) {
	hc := &http.Client{Timeout: metadataTimeout}
	if cfg.MetadataURL != "" {
		base, err := url.Parse(cfg.MetadataURL)
		if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
			return nil, fmt.Errorf("metadata URL %q: want http(s)://HOST[:PORT]", cfg.MetadataURL)
		}
		hc.Transport = redirect{base: base, next: http.DefaultTransport}
	}
	md := gcemd.NewWithOptions(&gcemd.Options{Client: hc})
	opts := append([]option.ClientOption(nil), cfg.ClientOptions...)
	if len(opts) == 0 {
		opts = append(opts, option.WithTokenSource(oauth2.ReuseTokenSource(nil, tokenSource{md: md})))
	}
	if cfg.ComputeEndpoint != "" {
		opts = append(opts, option.WithEndpoint(cfg.ComputeEndpoint))
	}
	svc, err := compute.NewService(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("creating Compute Engine client: %w", err)
	}
	ttl := cfg.PeersTTL
	if ttl == 0 {
		ttl = DefaultPeersTTL
	}
	return &Provider{
		md:      md,
		compute: svc,
		peers:   metadata.PeerCache{TTL: ttl, Clock: cfg.Clock},
	}, nil
}

// redirect sends the metadata client's requests, which always go to the well-known address, to base.
type redirect struct {
	base *url.URL
	next http.RoundTripper
}

func (r redirect) RoundTrip(req *http.Request) (*http.Response, error) {
	out := req.Clone(req.Context())
	out.URL.Scheme, out.URL.Host = r.base.Scheme, r.base.Host
	out.URL.Path = strings.TrimRight(r.base.Path, "/") + req.URL.Path
	out.Host = r.base.Host
	return r.next.RoundTrip(out)
}

// tokenSource gets the VM's service account access token from the metadata server.
type tokenSource struct{ md *gcemd.Client }

// tokenResponse is the metadata server's answer on instance/service-accounts/default/token.
type tokenResponse struct {
	AccessToken string `json:"access_token"`
	ExpiresIn   int64  `json:"expires_in"`
	TokenType   string `json:"token_type"`
}

func (s tokenSource) Token() (*oauth2.Token, error) {
	ctx, cancel := context.WithTimeout(context.Background(), metadataTimeout)
	defer cancel()
	v, err := s.md.GetWithContext(ctx, "instance/service-accounts/default/token")
	if err != nil {
		return nil, fmt.Errorf("getting the service account's access token: %w", mdError(err))
	}
	var tr tokenResponse
	if err := json.Unmarshal([]byte(v), &tr); err != nil || tr.AccessToken == "" {
		return nil, errors.New("getting the service account's access token: the metadata server's answer is not a token")
	}
	return &oauth2.Token{AccessToken: tr.AccessToken, TokenType: tr.TokenType, Expiry: time.Now().Add(time.Duration(tr.ExpiresIn) * time.Second)}, nil
}

// identity is what the metadata server says about this VM.
type identity struct {
	project, zone, name string
	ips                 []string
}

func (p *Provider) get(ctx context.Context, suffix string) (string, error) {
	v, err := p.md.GetWithContext(ctx, suffix)
	if err != nil {
		return "", fmt.Errorf("reading %s from the metadata server: %w", suffix, mdError(err))
	}
	return strings.TrimSpace(v), nil
}

func (p *Provider) identity(ctx context.Context) (identity, error) {
	var id identity
	var err error
	if id.project, err = p.get(ctx, "project/project-id"); err != nil {
		return id, err
	}
	zone, err := p.get(ctx, "instance/zone") // projects/NUMBER/zones/ZONE
	if err != nil {
		return id, err
	}
	id.zone = path.Base(zone)
	if id.name, err = p.get(ctx, "instance/name"); err != nil {
		return id, err
	}
	nics, err := p.get(ctx, "instance/network-interfaces/")
	if err != nil {
		return id, err
	}
	for _, nic := range strings.Fields(nics) { // "0/\n1/\n"
		ip, err := p.get(ctx, "instance/network-interfaces/"+strings.TrimSuffix(nic, "/")+"/ip")
		if err != nil {
			return id, err
		}
		if net.ParseIP(ip) == nil {
			return id, fmt.Errorf("metadata server: network interface %q has no valid IP (%q)", nic, ip)
		}
		id.ips = append(id.ips, ip)
	}
	return id, nil
}

// Self returns this VM: its name and addresses from the metadata server, its role from its labels.
func (p *Provider) Self(ctx context.Context) (metadata.Instance, error) {
	self, _, err := p.self(ctx)
	return self, err
}

func (p *Provider) self(ctx context.Context) (metadata.Instance, identity, error) {
	id, err := p.identity(ctx)
	if err != nil {
		return metadata.Instance{}, id, err
	}
	inst, err := p.compute.Instances.Get(id.project, id.zone, id.name).Context(ctx).Do()
	if err != nil {
		return metadata.Instance{}, id, fmt.Errorf("getting instance %s: %w", id.name, apiError(err))
	}
	v, ok := inst.Labels[metadata.KeyRole]
	role, err := metadata.ParseRole(v, ok)
	if err != nil {
		return metadata.Instance{}, id, fmt.Errorf("instance %s: %w", id.name, err)
	}
	self := metadata.Instance{Name: id.name, Role: role, IPs: id.ips}
	if err := self.Validate(); err != nil {
		return metadata.Instance{}, id, err
	}
	return self, id, nil
}

// Peers returns the running instances that carry this VM's cluster label, this one included, sorted
// by name. Instances without a valid role label or without an address are left out.
func (p *Provider) Peers(ctx context.Context) ([]metadata.Instance, error) {
	return p.peers.Get(ctx, p.listPeers)
}

func (p *Provider) listPeers(ctx context.Context) ([]metadata.Instance, error) {
	id, err := p.identity(ctx)
	if err != nil {
		return nil, err
	}
	inst, err := p.compute.Instances.Get(id.project, id.zone, id.name).Context(ctx).Do()
	if err != nil {
		return nil, fmt.Errorf("getting instance %s: %w", id.name, apiError(err))
	}
	cluster := inst.Labels[metadata.KeyCluster]
	if cluster == "" {
		return nil, fmt.Errorf("instance %s: %w", id.name, metadata.ErrMissingCluster)
	}
	// Label values are lower-case letters, digits, '-' and '_': nothing to escape in the filter.
	filter := fmt.Sprintf("labels.%s = %q", metadata.KeyCluster, cluster)
	var peers []metadata.Instance
	err = p.compute.Instances.AggregatedList(id.project).Filter(filter).Pages(ctx, func(page *compute.InstanceAggregatedList) error {
		for _, scope := range page.Items {
			for _, in := range scope.Instances {
				if in.Status != statusRunning || in.Labels[metadata.KeyCluster] != cluster {
					continue
				}
				v, ok := in.Labels[metadata.KeyRole]
				role, err := metadata.ParseRole(v, ok)
				if err != nil {
					continue
				}
				peer := metadata.Instance{Name: in.Name, Role: role}
				for _, nic := range in.NetworkInterfaces {
					if nic.NetworkIP != "" {
						peer.IPs = append(peer.IPs, nic.NetworkIP)
					}
				}
				if peer.Validate() == nil {
					peers = append(peers, peer)
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing instances of cluster %s: %w", cluster, apiError(err))
	}
	return peers, nil
}

// ControlPlaneEndpoint returns the instance attribute berth-control-plane-endpoint, or an error
// wrapping metadata.ErrNotFound when the VM has none (the init node then uses its own address).
func (p *Provider) ControlPlaneEndpoint(ctx context.Context) (string, error) {
	v, err := p.get(ctx, "instance/attributes/"+metadata.KeyControlPlaneEndpoint)
	if err != nil {
		return "", err
	}
	return metadata.CheckEndpoint(v)
}

// InitSecretHash returns the instance attribute berth-init-secret-hash, or an error wrapping
// metadata.ErrNotFound.
func (p *Provider) InitSecretHash(ctx context.Context) ([]byte, error) {
	v, err := p.get(ctx, "instance/attributes/"+metadata.KeyInitSecretHash)
	if err != nil {
		return nil, err
	}
	return metadata.ParseInitSecretHash(v)
}

// mdError maps a metadata server error to the named errors; the client has already retried
// 5xx, 429 and refused connections a few times.
func mdError(err error) error {
	var nd gcemd.NotDefinedError
	var me *gcemd.Error
	var ne net.Error
	var ue *url.Error
	switch {
	case errors.As(err, &nd):
		return fmt.Errorf("%w: %w", metadata.ErrNotFound, err)
	case errors.As(err, &me) && me.Code == http.StatusTooManyRequests:
		return fmt.Errorf("%w: %w", metadata.ErrThrottled, err)
	case errors.As(err, &me):
		return fmt.Errorf("metadata server answered HTTP %d", me.Code)
	case errors.Is(err, context.Canceled):
		return err
	case errors.As(err, &ne), errors.As(err, &ue):
		return fmt.Errorf("%w: %w", metadata.ErrUnreachable, err)
	}
	return err
}

// apiError maps a Compute API error to the named errors.
func apiError(err error) error {
	var ge *googleapi.Error
	if !errors.As(err, &ge) {
		return err
	}
	throttled := ge.Code == http.StatusTooManyRequests
	for _, item := range ge.Errors {
		if ge.Code == http.StatusForbidden && (item.Reason == "rateLimitExceeded" || item.Reason == "userRateLimitExceeded") {
			throttled = true
		}
	}
	switch {
	case throttled:
		return fmt.Errorf("%w: %w", metadata.ErrThrottled, err)
	case ge.Code == http.StatusUnauthorized:
		return fmt.Errorf("%w: %w", metadata.ErrTokenExpired, err)
	}
	return err
}
