// Package membership is the joinservice's side of the control planes' membership: it reads etcd's
// members and their health through this control plane's etcd, tells whether a joining control plane
// has really joined (cpslot's Observer), and removes the etcd members of control planes an operator
// removed (berth node remove), never breaking etcd's quorum unless the removal is forced.
//
// Etcd is reached at the local member (https://127.0.0.1:2379: the joinservice runs on the host
// network of every control plane) with a client certificate this package signs in memory, for one
// hour, with kubeadm's etcd CA from the PKI directory; the joinservice holds that CA already, to hand
// it to joining control planes. API servers are asked for /readyz with a client certificate from the
// cluster CA (user berth-joinservice, no groups: the readiness endpoints are open to every
// authenticated user), verified against the cluster CA.
//
// A control plane has joined when etcd has a member for it (by name, kubeadm names members after
// their node, else by its address in the peer URL) that is a started voting member, not a learner,
// whose client URL answers a status request; no other member is a learner or unstarted; and its API
// server at the node's address answers /readyz with 200 (which needs its local etcd member to serve
// linearizable reads: a learner cannot).
//
// Removing a voting member is refused (EtcdRefused) when fewer of the remaining voting members answer
// a status request than their quorum (half of them plus one), unless forced, and always when it is
// the last one; removing a learner, or a member etcd does not have (EtcdAbsent), changes no quorum.
package membership

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"

	"github.com/berth-k8s/berth/internal/machines"
)

// Defaults.
const (
	// DefaultEtcdEndpoint is the local etcd member of a kubeadm control plane.
	DefaultEtcdEndpoint = "https://127.0.0.1:2379"
	// DefaultAPIPort is the API server's port on every control plane.
	DefaultAPIPort = 6443
	// clientCertValidity is the life of the client certificates signed per operation.
	clientCertValidity = time.Hour
	// callTimeout bounds one etcd or API server request.
	callTimeout = 3 * time.Second
	// commonName names the joinservice in etcd's and the API server's logs.
	commonName = "berth-joinservice"
)

// Member is one etcd member and what a status request to it said.
type Member struct {
	ID         uint64
	Name       string
	PeerURLs   []string
	ClientURLs []string
	Learner    bool
	// Healthy is true when its first client URL answered a status request.
	Healthy bool
	// Problem says why it is not healthy.
	Problem string
}

// Started reports whether the member runs: an added member that never started has no name.
func (m Member) Started() bool { return m.Name != "" }

func (m Member) String() string {
	name := m.Name
	if name == "" {
		name = "(unstarted " + strconv.FormatUint(m.ID, 16) + ")"
	}
	switch {
	case m.Learner:
		return name + " learner"
	case !m.Healthy:
		return name + " voter, unhealthy"
	}
	return name + " voter"
}

// Etcd reaches the cluster's etcd and API servers with credentials from the PKI directory.
type Etcd struct {
	pkiDir string
	log    *zap.Logger
	// Endpoints are the etcd client URLs to dial (default DefaultEtcdEndpoint).
	Endpoints []string
	// APIPort is the API servers' port (default DefaultAPIPort).
	APIPort int
}

// New returns an Etcd using the CAs in pkiDir (kubeadm's layout: ca.*, etcd/ca.*).
func New(pkiDir string, log *zap.Logger) *Etcd {
	if log == nil {
		log = zap.NewNop()
	}
	return &Etcd{pkiDir: pkiDir, log: log, Endpoints: []string{DefaultEtcdEndpoint}, APIPort: DefaultAPIPort}
}

// signedClient returns a TLS configuration with a fresh client certificate signed by the CA in
// pkiDir/prefix{ca.crt,ca.key}, trusting that CA.
func (e *Etcd) signedClient(prefix string) (*tls.Config, error) {
	caPEM, err := os.ReadFile(filepath.Join(e.pkiDir, prefix, "ca.crt"))
	if err != nil {
		return nil, fmt.Errorf("reading CA certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(e.pkiDir, prefix, "ca.key"))
	if err != nil {
		return nil, fmt.Errorf("reading CA key: %w", err)
	}
	cas, err := certutil.ParseCertsPEM(caPEM)
	if err != nil {
		return nil, fmt.Errorf("parsing CA certificate: %w", err)
	}
	parsed, err := keyutil.ParsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("parsing CA key: %w", err)
	}
	caKey, ok := parsed.(crypto.Signer)
	if !ok {
		return nil, errors.New("parsing CA key: not a signing key")
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating client key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generating serial number: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: commonName},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     now.Add(clientCertValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, cas[0], key.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("signing client certificate: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cas[0])
	return &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		RootCAs:      pool,
		MinVersion:   tls.VersionTLS12,
	}, nil
}

// client returns an etcd client for Endpoints.
func (e *Etcd) client() (*clientv3.Client, error) {
	tlsCfg, err := e.signedClient("etcd")
	if err != nil {
		return nil, fmt.Errorf("etcd credentials: %w", err)
	}
	c, err := clientv3.New(clientv3.Config{
		Endpoints: e.Endpoints, TLS: tlsCfg, DialTimeout: callTimeout,
		Logger: e.log.Named("etcd-client").WithOptions(zap.IncreaseLevel(zap.ErrorLevel)),
	})
	if err != nil {
		return nil, fmt.Errorf("creating etcd client: %w", err)
	}
	return c, nil
}

// Client connects to this control plane's etcd with a short-lived client certificate signed by the
// etcd CA (the backup schedule's snapshots); the caller closes it.
func (e *Etcd) Client() (*clientv3.Client, error) { return e.client() }

// Members lists etcd's members with their health.
func (e *Etcd) Members(ctx context.Context) ([]Member, error) {
	c, err := e.client()
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Close() }() // a close error changes nothing of what was read
	return members(ctx, c)
}

func members(ctx context.Context, c *clientv3.Client) ([]Member, error) {
	lctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	resp, err := c.MemberList(lctx)
	if err != nil {
		return nil, fmt.Errorf("listing etcd members: %w", err)
	}
	out := make([]Member, len(resp.Members))
	done := make(chan struct{}, len(resp.Members))
	for i, m := range resp.Members {
		out[i] = Member{ID: m.ID, Name: m.Name, PeerURLs: m.PeerURLs, ClientURLs: m.ClientURLs, Learner: m.IsLearner}
		go func() {
			defer func() { done <- struct{}{} }()
			if len(m.ClientURLs) == 0 {
				out[i].Problem = "no client URL (not started)"
				return
			}
			sctx, cancel := context.WithTimeout(ctx, callTimeout)
			defer cancel()
			if _, err := c.Status(sctx, m.ClientURLs[0]); err != nil {
				out[i].Problem = err.Error()
				return
			}
			out[i].Healthy = true
		}()
	}
	for range resp.Members {
		<-done
	}
	return out, nil
}

// find returns the member of node: by name, else by an address in its peer URLs.
func find(ms []Member, node string, addresses []string) (Member, bool) {
	for _, m := range ms {
		if m.Name == node && node != "" {
			return m, true
		}
	}
	for _, m := range ms {
		for _, u := range m.PeerURLs {
			if p, err := url.Parse(u); err == nil && slices.Contains(addresses, p.Hostname()) {
				return m, true
			}
		}
	}
	return Member{}, false
}

// JoinDone implements cpslot.Observer: whether the control plane node at address has joined (see
// the package documentation), and what was seen.
func (e *Etcd) JoinDone(ctx context.Context, node, address string) (bool, string) {
	ms, err := e.Members(ctx)
	if err != nil {
		return false, err.Error()
	}
	m, ok := find(ms, node, []string{address})
	switch {
	case !ok:
		return false, "etcd has no member for " + node + " yet"
	case !m.Started():
		return false, "etcd member for " + node + " added but not started"
	case m.Learner:
		return false, "etcd member " + m.Name + " is a learner"
	case !m.Healthy:
		return false, "etcd member " + m.Name + " does not answer: " + m.Problem
	}
	for _, o := range ms {
		if o.ID != m.ID && (o.Learner || !o.Started()) {
			return false, "etcd has another member that is not a started voter: " + o.String()
		}
	}
	api := net.JoinHostPort(address, strconv.Itoa(e.APIPort))
	if err := e.apiReady(ctx, api); err != nil {
		return false, "etcd member " + m.Name + " voting and healthy; API server at " + api + " not ready: " + err.Error()
	}
	return true, fmt.Sprintf("etcd member %s (%x) voting and healthy (%s); API server at %s ready", m.Name, m.ID, summary(ms), api)
}

// summary lists the members for a log or ledger line.
func summary(ms []Member) string {
	parts := make([]string, len(ms))
	for i, m := range ms {
		parts[i] = m.String()
	}
	return "members: " + strings.Join(parts, ", ")
}

// errNotReady is an API server whose /readyz did not answer 200.
var errNotReady = errors.New("readyz failed")

// apiReady asks the API server at hostport for /readyz.
func (e *Etcd) apiReady(ctx context.Context, hostport string) error {
	tlsCfg, err := e.signedClient("")
	if err != nil {
		return fmt.Errorf("API server credentials: %w", err)
	}
	tr := &http.Transport{TLSClientConfig: tlsCfg, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+hostport+"/readyz", nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10)) // a short read only shortens the detail
	if resp.StatusCode == http.StatusOK {
		return nil
	}
	var failed []string
	for _, l := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(l, "[-]") {
			failed = append(failed, strings.TrimSpace(l))
		}
	}
	return fmt.Errorf("%w: %s %s", errNotReady, resp.Status, strings.Join(failed, "; "))
}

// Remove removes node's etcd member (found by name or by one of addresses) unless that breaks
// quorum and force is not set; it never removes the last voting member. The state says what became
// of it; an error means it could not be decided (etcd unreachable, no quorum to remove with) and the
// removal stays pending.
func (e *Etcd) Remove(ctx context.Context, node string, addresses []string, force bool) (machines.EtcdState, string, error) {
	c, err := e.client()
	if err != nil {
		return machines.EtcdPending, "", err
	}
	defer func() { _ = c.Close() }() // a close error changes nothing of what was done
	ms, err := members(ctx, c)
	if err != nil {
		return machines.EtcdPending, "", err
	}
	m, ok := find(ms, node, addresses)
	if !ok {
		return machines.EtcdAbsent, "etcd has no member for " + node + " (" + summary(ms) + ")", nil
	}
	if !m.Learner {
		var remaining, healthy int
		for _, o := range ms {
			if o.ID == m.ID || o.Learner {
				continue
			}
			remaining++
			if o.Healthy {
				healthy++
			}
		}
		quorum := remaining/2 + 1
		switch {
		case remaining == 0:
			return machines.EtcdRefused, fmt.Sprintf("etcd member %s is etcd's last voting member", m.Name), nil
		case healthy < quorum && !force:
			return machines.EtcdRefused, fmt.Sprintf("removing etcd member %s leaves %d voting members of which %d answer; they need %d for quorum (%s); --force removes it anyway",
				m.Name, remaining, healthy, quorum, summary(ms)), nil
		}
	}
	rctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if _, err := c.MemberRemove(rctx, m.ID); err != nil {
		return machines.EtcdPending, "", fmt.Errorf("removing etcd member %s: %w", m.Name, err)
	}
	e.log.Info("etcd member removed", zap.String("node", node), zap.String("member", m.Name), zap.Bool("force", force))
	return machines.EtcdRemoved, fmt.Sprintf("removed etcd member %s (%x); before: %s", m.Name, m.ID, summary(ms)), nil
}
