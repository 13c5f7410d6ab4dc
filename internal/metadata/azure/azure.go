// Package azure is the metadata provider for Azure virtual machines. The VM learns who it is from the
// Azure Instance Metadata Service (IMDS: GET /metadata/instance with the header "Metadata: true" and an
// api-version; name, subscription, resource group, tags, private addresses) and lists its peers with the
// Azure Resource Manager APIs of the Azure SDK for Go: the VMs of its resource group
// (armcompute VirtualMachines List) and their network interfaces (armnetwork Interfaces List), both
// paginated through nextLink. ARM is called with the VM's managed identity, whose access token comes
// from the same IMDS (/metadata/identity/oauth2/token); the SDK has no client for the instance metadata
// itself, so that part is plain HTTP.
//
// What the VM reads where (the keys are metadata.Key*; tags are on the VM resource):
//
//	name, addresses         IMDS compute.name (the VM's resource name), network.interface[].ipv4.ipAddress[].privateIpAddress
//	role                    tag berth-role (control-plane | worker), IMDS compute.tagsList
//	cluster                 tag berth-cluster; peers: the VMs of the resource group with the same tag value
//	control-plane endpoint  tag berth-control-plane-endpoint (HOST:PORT, e.g. a load balancer's address); optional
//	init-secret hash        tag berth-init-secret-hash (hex SHA-256)
//
// Peers are named by their resource name and addressed by the private IPv4 addresses of the network
// interfaces attached to them in the same resource group (primary interface and configuration first).
// VMs whose provisioning did not succeed are left out; a stopped VM keeps its private addresses in
// Azure, and is listed. VMs of a Uniform scale set are not VMs of the resource group's VM list and are
// not found; standalone VMs and Flexible scale sets are. The managed identity needs read access to the
// resource group's VMs and network interfaces (for example the Reader role on it).
//
// Errors: IMDS or ARM throttling (HTTP 429, after the SDK's retries) is metadata.ErrThrottled; an access
// token ARM rejects (401) again after a fresh one is metadata.ErrTokenExpired; no IMDS is
// metadata.ErrUnreachable; a missing role tag metadata.ErrMissingRole. The local fake is azuretest.
package azure

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/arm"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/cloud"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/compute/armcompute/v6"
	"github.com/Azure/azure-sdk-for-go/sdk/resourcemanager/network/armnetwork/v6"
	"k8s.io/utils/clock"

	"github.com/berth-k8s/berth/internal/metadata"
)

// DefaultIMDSURL is the instance metadata service's well-known address.
const DefaultIMDSURL = "http://169.254.169.254"

// DefaultPeersTTL is how long a listing of the cluster's instances is reused.
const DefaultPeersTTL = 5 * time.Second

// IMDS API versions: the instance metadata (with tagsList) and the managed identity token endpoint.
const (
	instanceAPIVersion = "2021-02-01"
	tokenAPIVersion    = "2018-02-01"
)

// imdsTimeout bounds one IMDS request; maxIMDSBody bounds what is read from one answer.
const (
	imdsTimeout = 5 * time.Second
	maxIMDSBody = 1 << 20
)

// provisioningSucceeded is the only VM provisioning state whose VMs count as peers.
const provisioningSucceeded = "Succeeded"

// ARM error codes of an expired access token.
var expiredTokenCodes = []string{"ExpiredAuthenticationToken", "InvalidAuthenticationTokenTokenExpired"}

// Config configures a Provider. The zero value talks to the real IMDS and Azure Resource Manager.
type Config struct {
	// IMDSURL is the instance metadata service's base URL; empty means DefaultIMDSURL.
	IMDSURL string
	// ARMEndpoint is Azure Resource Manager's base URL; empty means the public cloud's. It must be https:
	// the SDK sends access tokens over TLS only.
	ARMEndpoint string
	// Credential authenticates ARM calls; nil means the VM's managed identity through IMDSURL.
	Credential azcore.TokenCredential
	// HTTPClient carries IMDS and ARM requests; nil means http.DefaultClient's transport.
	HTTPClient *http.Client
	// MaxRetries is how often the SDK retries an ARM call (429, 5xx); 0 means its default, negative none.
	MaxRetries int
	// PeersTTL is how long a listing of peers is reused; 0 means DefaultPeersTTL, negative lists every time.
	PeersTTL time.Duration
	// Clock is the peer cache's clock; nil means the real one.
	Clock clock.PassiveClock
}

// Provider answers metadata queries on Azure. It is safe for concurrent use.
type Provider struct {
	cfg   Config
	imds  string
	http  *http.Client
	cred  azcore.TokenCredential
	peers metadata.PeerCache

	mu      sync.Mutex
	clients *armClients // built on first use for the VM's subscription; dropped when ARM rejects the token
}

type armClients struct {
	vms  *armcompute.VirtualMachinesClient
	nics *armnetwork.InterfacesClient
}

// New returns a provider. It makes no request yet.
func New(cfg Config) (*Provider, error) {
	base := cfg.IMDSURL
	if base == "" {
		base = DefaultIMDSURL
	}
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("IMDS URL %q: want http(s)://HOST[:PORT]", base)
	}
	if cfg.ARMEndpoint != "" {
		if u, err := url.Parse(cfg.ARMEndpoint); err != nil || u.Scheme != "https" || u.Host == "" {
			return nil, fmt.Errorf("ARM endpoint %q: want https://HOST[:PORT]", cfg.ARMEndpoint)
		}
	}
	hc := &http.Client{Timeout: imdsTimeout}
	if cfg.HTTPClient != nil {
		hc = &http.Client{Timeout: imdsTimeout, Transport: cfg.HTTPClient.Transport}
	}
	ttl := cfg.PeersTTL
	if ttl == 0 {
		ttl = DefaultPeersTTL
	}
	p := &Provider{cfg: cfg, imds: strings.TrimRight(base, "/"), http: hc, peers: metadata.PeerCache{TTL: ttl, Clock: cfg.Clock}}
	p.cred = cfg.Credential
	if p.cred == nil {
		p.cred = &managedIdentity{p: p}
	}
	return p, nil
}

// instanceDoc is the part of IMDS's /metadata/instance answer the provider reads.
type instanceDoc struct {
	Compute struct {
		Name              string `json:"name"`
		ResourceGroupName string `json:"resourceGroupName"`
		ResourceID        string `json:"resourceId"`
		SubscriptionID    string `json:"subscriptionId"`
		TagsList          []struct {
			Name  string `json:"name"`
			Value string `json:"value"`
		} `json:"tagsList"`
	} `json:"compute"`
	Network struct {
		Interface []struct {
			IPv4 struct {
				IPAddress []struct {
					PrivateIPAddress string `json:"privateIpAddress"`
				} `json:"ipAddress"`
			} `json:"ipv4"`
		} `json:"interface"`
	} `json:"network"`
}

func (d instanceDoc) tags() map[string]string {
	m := make(map[string]string, len(d.Compute.TagsList))
	for _, t := range d.Compute.TagsList {
		m[t.Name] = t.Value
	}
	return m
}

// imdsGet reads one IMDS path with the Metadata header and the api-version, and decodes the JSON answer.
func (p *Provider) imdsGet(ctx context.Context, path string, query url.Values, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.imds+path+"?"+query.Encode(), nil)
	if err != nil {
		return fmt.Errorf("building IMDS request: %w", err)
	}
	req.Header.Set("Metadata", "true")
	resp, err := p.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("reading %s from IMDS: %w", path, ctx.Err())
		}
		return fmt.Errorf("reading %s from IMDS: %w: %w", path, metadata.ErrUnreachable, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxIMDSBody))
	if err != nil {
		return fmt.Errorf("reading %s from IMDS: %w", path, err)
	}
	switch {
	case resp.StatusCode == http.StatusTooManyRequests:
		return fmt.Errorf("reading %s from IMDS: %w", path, metadata.ErrThrottled)
	case resp.StatusCode == http.StatusNotFound:
		return fmt.Errorf("reading %s from IMDS: %w", path, metadata.ErrNotFound)
	case resp.StatusCode != http.StatusOK:
		// IMDS's error text is JSON of its own; its fields are quoted, never printed raw.
		var e struct {
			Error       string `json:"error"`
			Description string `json:"error_description"`
		}
		_ = json.Unmarshal(body, &e)
		return fmt.Errorf("reading %s from IMDS: HTTP %d %q %q", path, resp.StatusCode, e.Error, e.Description)
	}
	if err := json.Unmarshal(body, out); err != nil {
		return fmt.Errorf("reading %s from IMDS: decoding: %w", path, err)
	}
	return nil
}

func (p *Provider) instance(ctx context.Context) (instanceDoc, error) {
	var doc instanceDoc
	err := p.imdsGet(ctx, "/metadata/instance", url.Values{"api-version": {instanceAPIVersion}}, &doc)
	if err == nil && (doc.Compute.Name == "" || doc.Compute.SubscriptionID == "" || doc.Compute.ResourceGroupName == "") {
		err = errors.New("IMDS answered without the VM's name, subscription or resource group")
	}
	return doc, err
}

// Self returns this VM: its resource name and private addresses from IMDS, its role from its tag.
func (p *Provider) Self(ctx context.Context) (metadata.Instance, error) {
	doc, err := p.instance(ctx)
	if err != nil {
		return metadata.Instance{}, err
	}
	self := metadata.Instance{Name: doc.Compute.Name}
	for _, nic := range doc.Network.Interface {
		for _, a := range nic.IPv4.IPAddress {
			if a.PrivateIPAddress != "" && !slices.Contains(self.IPs, a.PrivateIPAddress) {
				self.IPs = append(self.IPs, a.PrivateIPAddress)
			}
		}
	}
	v, ok := doc.tags()[metadata.KeyRole]
	if self.Role, err = metadata.ParseRole(v, ok); err != nil {
		return metadata.Instance{}, fmt.Errorf("VM %s: %w", self.Name, err)
	}
	if err := self.Validate(); err != nil {
		return metadata.Instance{}, err
	}
	return self, nil
}

// ControlPlaneEndpoint returns the tag berth-control-plane-endpoint, or an error wrapping
// metadata.ErrNotFound when the VM has none (the init node then uses its own address).
func (p *Provider) ControlPlaneEndpoint(ctx context.Context) (string, error) {
	doc, err := p.instance(ctx)
	if err != nil {
		return "", err
	}
	v, ok := doc.tags()[metadata.KeyControlPlaneEndpoint]
	if !ok {
		return "", fmt.Errorf("tag %s: %w", metadata.KeyControlPlaneEndpoint, metadata.ErrNotFound)
	}
	return metadata.CheckEndpoint(v)
}

// InitSecretHash returns the tag berth-init-secret-hash, or an error wrapping metadata.ErrNotFound.
func (p *Provider) InitSecretHash(ctx context.Context) ([]byte, error) {
	doc, err := p.instance(ctx)
	if err != nil {
		return nil, err
	}
	v, ok := doc.tags()[metadata.KeyInitSecretHash]
	if !ok {
		return nil, fmt.Errorf("tag %s: %w", metadata.KeyInitSecretHash, metadata.ErrNotFound)
	}
	return metadata.ParseInitSecretHash(v)
}

// Peers returns the VMs of this VM's resource group that carry its cluster tag, this one included,
// sorted by name. VMs without a valid role tag or without a private address are left out.
func (p *Provider) Peers(ctx context.Context) ([]metadata.Instance, error) {
	return p.peers.Get(ctx, p.listPeers)
}

func (p *Provider) listPeers(ctx context.Context) ([]metadata.Instance, error) {
	doc, err := p.instance(ctx)
	if err != nil {
		return nil, err
	}
	cluster := doc.tags()[metadata.KeyCluster]
	if cluster == "" {
		return nil, fmt.Errorf("VM %s: %w", doc.Compute.Name, metadata.ErrMissingCluster)
	}
	// An access token ARM rejects may be one the SDK cached past its revocation: try once more with
	// fresh clients, which fetch a fresh token.
	peers, err := p.listWith(ctx, doc, cluster)
	if isExpiredToken(err) {
		p.dropClients()
		peers, err = p.listWith(ctx, doc, cluster)
	}
	if err != nil {
		return nil, fmt.Errorf("listing the VMs of cluster %s: %w", cluster, apiError(err))
	}
	return peers, nil
}

func (p *Provider) armClients(subscription string) (*armClients, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.clients != nil {
		return p.clients, nil
	}
	opts := &arm.ClientOptions{}
	opts.Retry.MaxRetries = int32(p.cfg.MaxRetries)
	if p.cfg.HTTPClient != nil {
		opts.Transport = p.cfg.HTTPClient
	}
	if p.cfg.ARMEndpoint != "" {
		opts.Cloud = cloud.Configuration{
			ActiveDirectoryAuthorityHost: cloud.AzurePublic.ActiveDirectoryAuthorityHost,
			Services: map[cloud.ServiceName]cloud.ServiceConfiguration{
				cloud.ResourceManager: {Endpoint: p.cfg.ARMEndpoint, Audience: cloud.AzurePublic.Services[cloud.ResourceManager].Audience},
			},
		}
	}
	vms, err := armcompute.NewVirtualMachinesClient(subscription, p.cred, opts)
	if err != nil {
		return nil, fmt.Errorf("creating the compute client: %w", err)
	}
	nics, err := armnetwork.NewInterfacesClient(subscription, p.cred, opts)
	if err != nil {
		return nil, fmt.Errorf("creating the network client: %w", err)
	}
	p.clients = &armClients{vms: vms, nics: nics}
	return p.clients, nil
}

func (p *Provider) dropClients() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.clients = nil
	if mi, ok := p.cred.(*managedIdentity); ok {
		mi.drop()
	}
}

func (p *Provider) listWith(ctx context.Context, doc instanceDoc, cluster string) ([]metadata.Instance, error) {
	c, err := p.armClients(doc.Compute.SubscriptionID)
	if err != nil {
		return nil, err
	}
	rg := doc.Compute.ResourceGroupName
	type member struct {
		name string
		role metadata.Role
	}
	members := map[string]member{} // by lower-case VM resource ID: ARM IDs are case-insensitive
	vms := c.vms.NewListPager(rg, nil)
	for vms.More() {
		page, err := vms.NextPage(ctx)
		if err != nil {
			return nil, err
		}
		for _, vm := range page.Value {
			if vm == nil || vm.ID == nil || vm.Name == nil || str(vm.Tags[metadata.KeyCluster]) != cluster {
				continue
			}
			if vm.Properties == nil || str(vm.Properties.ProvisioningState) != provisioningSucceeded {
				continue
			}
			v, ok := vm.Tags[metadata.KeyRole]
			role, err := metadata.ParseRole(str(v), ok)
			if err != nil {
				continue
			}
			members[strings.ToLower(*vm.ID)] = member{name: *vm.Name, role: role}
		}
	}
	type addr struct {
		ip              string
		nicPrimary, cfg bool
	}
	addrs := map[string][]addr{}
	nics := c.nics.NewListPager(rg, nil)
	for nics.More() {
		page, err := nics.NextPage(ctx)
		if err != nil {
			return nil, err
		}
		for _, nic := range page.Value {
			if nic == nil || nic.Properties == nil || nic.Properties.VirtualMachine == nil || nic.Properties.VirtualMachine.ID == nil {
				continue
			}
			id := strings.ToLower(*nic.Properties.VirtualMachine.ID)
			if _, ok := members[id]; !ok {
				continue
			}
			for _, ipc := range nic.Properties.IPConfigurations {
				if ipc == nil || ipc.Properties == nil || ipc.Properties.PrivateIPAddress == nil {
					continue
				}
				if v := ipc.Properties.PrivateIPAddressVersion; v != nil && *v != armnetwork.IPVersionIPv4 {
					continue
				}
				addrs[id] = append(addrs[id], addr{*ipc.Properties.PrivateIPAddress, flag(nic.Properties.Primary), flag(ipc.Properties.Primary)})
			}
		}
	}
	var peers []metadata.Instance
	for id, m := range members {
		list := addrs[id]
		slices.SortStableFunc(list, func(a, b addr) int {
			return rank(b.nicPrimary, b.cfg) - rank(a.nicPrimary, a.cfg)
		})
		peer := metadata.Instance{Name: m.name, Role: m.role}
		for _, a := range list {
			if !slices.Contains(peer.IPs, a.ip) {
				peer.IPs = append(peer.IPs, a.ip)
			}
		}
		if peer.Validate() == nil {
			peers = append(peers, peer)
		}
	}
	return peers, nil
}

func rank(nicPrimary, cfgPrimary bool) int {
	r := 0
	if nicPrimary {
		r += 2
	}
	if cfgPrimary {
		r++
	}
	return r
}

func str(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func flag(b *bool) bool { return b != nil && *b }

// isExpiredToken reports whether ARM rejected the access token.
func isExpiredToken(err error) bool {
	var re *azcore.ResponseError
	return errors.As(err, &re) && re.StatusCode == http.StatusUnauthorized
}

// apiError maps an ARM error to the named errors.
func apiError(err error) error {
	var re *azcore.ResponseError
	if !errors.As(err, &re) {
		return err
	}
	switch {
	case re.StatusCode == http.StatusTooManyRequests:
		return fmt.Errorf("%w: %w", metadata.ErrThrottled, err)
	case re.StatusCode == http.StatusUnauthorized || slices.Contains(expiredTokenCodes, re.ErrorCode):
		return fmt.Errorf("%w: %w", metadata.ErrTokenExpired, err)
	}
	return err
}

// managedIdentity gets the VM's managed identity's access tokens from IMDS. azidentity's
// ManagedIdentityCredential does the same against the fixed address; this one reads the provider's
// IMDS URL, so the whole provider talks to one endpoint.
type managedIdentity struct {
	p *Provider

	mu     sync.Mutex
	tokens map[string]azcore.AccessToken // by resource
}

// tokenResponse is IMDS's answer on /metadata/identity/oauth2/token; the numbers are strings.
type tokenResponse struct {
	AccessToken string `json:"access_token"`
	ExpiresOn   string `json:"expires_on"`
	Resource    string `json:"resource"`
	TokenType   string `json:"token_type"`
}

// tokenEarly is how long before its expiry a cached token is replaced.
const tokenEarly = 5 * time.Minute

func (m *managedIdentity) GetToken(ctx context.Context, opts policy.TokenRequestOptions) (azcore.AccessToken, error) {
	if len(opts.Scopes) != 1 {
		return azcore.AccessToken{}, fmt.Errorf("managed identity: want one scope, got %d", len(opts.Scopes))
	}
	resource := strings.TrimSuffix(opts.Scopes[0], "/.default")
	m.mu.Lock()
	defer m.mu.Unlock()
	if t, ok := m.tokens[resource]; ok && time.Until(t.ExpiresOn) > tokenEarly {
		return t, nil
	}
	var tr tokenResponse
	q := url.Values{"api-version": {tokenAPIVersion}, "resource": {resource}}
	if err := m.p.imdsGet(ctx, "/metadata/identity/oauth2/token", q, &tr); err != nil {
		return azcore.AccessToken{}, fmt.Errorf("getting the managed identity's token: %w", err)
	}
	secs, err := strconv.ParseInt(tr.ExpiresOn, 10, 64)
	if err != nil || tr.AccessToken == "" {
		return azcore.AccessToken{}, errors.New("getting the managed identity's token: IMDS answered without a token or expiry")
	}
	t := azcore.AccessToken{Token: tr.AccessToken, ExpiresOn: time.Unix(secs, 0)}
	if m.tokens == nil {
		m.tokens = map[string]azcore.AccessToken{}
	}
	m.tokens[resource] = t
	return t, nil
}

func (m *managedIdentity) drop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.tokens = nil
}
