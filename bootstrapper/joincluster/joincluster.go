// Package joincluster joins a node to a cluster with a ticket from the joinservice: it takes the
// node lock, writes the ticket's files, starts the kubelet and runs kubeadm join, retrying failures
// that look transient a bounded number of times.
//
// The kubelet's client certificate comes from the ticket, issued by the joinservice for the name
// metadata reports for this attested node; it is placed where the kubelet looks for its current
// client certificate, so the kubelet uses it instead of requesting one for a name of its choosing.
//
// A ticket without a bootstrap token (every ticket the joinservice issues, for workers and control
// planes) is joined with a discovery file: a kubeconfig, owner-only in the state directory and
// removed when the join ends, that pins the cluster CA from the ticket (received over mutually
// attested TLS, and checked against the ticket's CA pin) and authenticates with the ticket's kubelet
// certificate and this node's own key. kubeadm uses those credentials for everything it reads before
// the kubelet takes over (the Node authorizer and kubeadm's RBAC for group system:nodes allow it; a
// control plane then uses the admin.conf it makes with the ticket's CA key), so no bearer token that
// could request any node's certificate exists for the join, and the joinservice writes nothing to
// the API for it. A ticket that does carry a bootstrap token is joined with token discovery.
package joincluster

import (
	"bytes"
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/cpfiles"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/pemcerts"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// LockOwner is the owner name the joiner takes the node lock with.
const LockOwner = "join"

// DiscoveryFileName is the tokenless join's discovery kubeconfig in the state directory; it exists
// only while kubeadm join runs.
const DiscoveryFileName = "kubeadm-discovery.conf"

// Named join failures.
var (
	// ErrInvalidTicket: the ticket lacks something kubeadm join needs, or names another node.
	ErrInvalidTicket = errors.New("invalid join ticket")
	// ErrJoinFailed: kubeadm join failed in a way retrying will not fix.
	ErrJoinFailed = errors.New("kubeadm join failed")
	// ErrJoinRetriesExhausted: kubeadm join kept failing transiently.
	ErrJoinRetriesExhausted = errors.New("kubeadm join kept failing")
)

// Config configures a Joiner.
type Config struct {
	StateDir         string
	KubernetesDir    string // default /etc/kubernetes
	KubeletDir       string // default /var/lib/kubelet
	CRISocket        string
	KubeletExtraArgs [][2]string
	NeverPull        bool
	// Attempts bounds kubeadm join runs (default 3); RetryDelay separates them (default 5 s).
	Attempts   int
	RetryDelay time.Duration
}

// Joiner joins the node.
type Joiner struct {
	cfg     Config
	log     *zap.Logger
	fs      afero.Fs
	lock    locker
	kubeadm kubeadmRunner
	kubelet kubeletStarter
	state   stateStore
	// disk is the state disk to bind; nil when the node has none.
	disk diskBinder
	// kms installs a control plane's KMS keys; nil joins control planes without encryption at rest.
	kms kmsInstaller
}

// New returns a Joiner.
func New(cfg Config, log *zap.Logger, fsys afero.Fs, lock locker, kubeadm kubeadmRunner, kubelet kubeletStarter, state stateStore) *Joiner {
	if cfg.KubernetesDir == "" {
		cfg.KubernetesDir = "/etc/kubernetes"
	}
	if cfg.KubeletDir == "" {
		cfg.KubeletDir = "/var/lib/kubelet"
	}
	if cfg.Attempts == 0 {
		cfg.Attempts = 3
	}
	if cfg.RetryDelay == 0 {
		cfg.RetryDelay = 5 * time.Second
	}
	return &Joiner{cfg: cfg, log: log, fs: fsys, lock: lock, kubeadm: kubeadm, kubelet: kubelet, state: state}
}

// Join joins with ticket. It returns nil without doing anything if the node lock is already taken
// (the InitServer won), and a named error if joining failed after the lock was taken.
func (j *Joiner) Join(ctx context.Context, self metadata.Instance, ticket *joinproto.IssueJoinTicketResponse, kubeletKey crypto.Signer) error {
	if err := validateTicket(self, ticket, j.dirs()); err != nil {
		return err
	}
	if j.kms != nil && len(ticket.GetControlPlaneFiles()) > 0 {
		// A control plane's API server encrypts through the KMS plugin from its first start: without
		// the keys it could read no Secret.
		if err := ticketKMSKeys(ticket).Validate(); err != nil {
			return fmt.Errorf("%w: control-plane ticket: %w", ErrInvalidTicket, err)
		}
	}
	var discovery []byte
	if ticket.GetBootstrapToken() == "" {
		var err error
		if discovery, err = discoveryKubeconfig(ticket, kubeletKey); err != nil {
			return err
		}
	}
	if err := j.lock.TryLockOnce(ctx, LockOwner, ticket.GetClusterId()); err != nil {
		if errors.Is(err, nodelock.ErrLocked) {
			j.log.Info("node lock already taken, not joining")
			return nil
		}
		return fmt.Errorf("taking node lock: %w", err)
	}
	if j.disk != nil {
		if err := j.disk.Bind(ctx, ticket.GetDiskKey(), ticket.GetClusterId(), ticket.GetDiskBinding()); err != nil {
			return fmt.Errorf("binding the state disk to the cluster: %w", err)
		}
	}
	st := &nodestate.State{Role: nodestate.RoleJoin, ClusterID: hex.EncodeToString(ticket.GetClusterId()), NodeName: ticket.GetNodeName()}
	if err := j.state.Save(st); err != nil {
		return err
	}
	controlPlane := len(ticket.GetControlPlaneFiles()) > 0
	if err := j.fs.MkdirAll(j.cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	if controlPlane && j.kms != nil {
		// After the disk is bound: the keys go to the encrypted state disk.
		if err := j.kms.Install(ctx, ticketKMSKeys(ticket)); err != nil {
			return fmt.Errorf("installing the KMS keys: %w", err)
		}
	}
	params := kubeadm.JoinParams{
		Node: kubeadm.NodeParams{
			Name: ticket.GetNodeName(), IP: self.IPs[0], CRISocket: j.cfg.CRISocket, Untainted: !controlPlane,
			KubeletExtraArgs: j.cfg.KubeletExtraArgs, NeverPull: j.cfg.NeverPull,
		},
		APIServerEndpoint: ticket.GetApiServerEndpoint(),
		Token:             ticket.GetBootstrapToken(),
		CACertHashes:      ticket.GetDiscoveryTokenCaCertHashes(),
		ControlPlane:      controlPlane,
	}
	if _, _, patches := j.dirs().Written(ticket.GetControlPlaneFiles()); controlPlane && patches != "" {
		params.PatchesDir = patches
	}
	if discovery != nil {
		// Tokenless: the discovery file holds the node's key; owner-only, and removed once the join
		// is over (kubeadm removes its own copy, bootstrap-kubelet.conf, after the TLS bootstrap).
		params.DiscoveryFile = filepath.Join(j.cfg.StateDir, DiscoveryFileName)
		if err := afero.WriteFile(j.fs, params.DiscoveryFile, discovery, 0o600); err != nil {
			return fmt.Errorf("writing kubeadm discovery file: %w", err)
		}
		defer func() { _ = j.fs.Remove(params.DiscoveryFile) }()
	}
	cfg, err := kubeadm.JoinConfig(params)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidTicket, err)
	}
	// The config may hold the bootstrap token: owner-only, and removed once the join is over.
	configPath := filepath.Join(j.cfg.StateDir, "kubeadm-join.yaml")
	if err := afero.WriteFile(j.fs, configPath, cfg, 0o600); err != nil {
		return fmt.Errorf("writing kubeadm join config: %w", err)
	}
	defer func() { _ = j.fs.Remove(configPath) }()

	if err := j.kubelet.Start(ctx); err != nil {
		return fmt.Errorf("starting kubelet: %w", err)
	}
	// Attempts runs of kubeadm join, RetryDelay apart; the last failure ends the loop with its error.
	attempt := 0
	retries := wait.Backoff{Duration: j.cfg.RetryDelay, Steps: j.cfg.Attempts}
	err = wait.ExponentialBackoffWithContext(ctx, retries, func(ctx context.Context) (bool, error) {
		attempt++
		if err := j.writeFiles(ticket, kubeletKey); err != nil {
			return false, err
		}
		out := &tail{max: 64 << 10}
		start := time.Now()
		err := j.kubeadm.Join(ctx, io.MultiWriter(out, &zapWriter{log: j.log}), configPath)
		if err == nil {
			j.log.Info("kubeadm join succeeded", zap.Int("attempt", attempt), zap.Duration("took", time.Since(start)))
			return true, nil
		}
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if !Transient(out.String()) {
			j.log.Error("kubeadm join failed", zap.Int("attempt", attempt), zap.Error(err))
			return false, fmt.Errorf("%w: %w", ErrJoinFailed, err)
		}
		if attempt >= j.cfg.Attempts {
			return false, fmt.Errorf("%w: %d attempts: %w", ErrJoinRetriesExhausted, attempt, err)
		}
		j.log.Warn("kubeadm join failed transiently, retrying", zap.Int("attempt", attempt), zap.Error(err))
		// The kubelet must not run across the reset (it would keep what the reset removes), and
		// must be enabled again for the next attempt.
		if err := j.kubelet.Stop(ctx); err != nil {
			return false, fmt.Errorf("stopping kubelet before the retry: %w", err)
		}
		if err := j.kubeadm.Reset(ctx, io.Discard, j.cfg.CRISocket); err != nil {
			j.log.Warn("kubeadm reset before retry failed", zap.Error(err))
		}
		if err := j.kubelet.Start(ctx); err != nil {
			return false, fmt.Errorf("starting kubelet: %w", err)
		}
		return false, nil
	})
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return fmt.Errorf("joining: %w", err)
	}
	if err != nil {
		return err
	}
	st.Done = true
	return j.state.Save(st)
}

// transientPatterns match kubeadm output of failures that a retry can fix.
var transientPatterns = regexp.MustCompile(`(?i)connection refused|connection reset|i/o timeout|TLS handshake timeout|` +
	`context deadline exceeded|timed out waiting|EOF|too many requests|etcdserver: (request timed out|leader changed)|` +
	`the server is currently unable to handle the request|no route to host|service unavailable`)

// Transient reports whether kubeadm output describes a failure worth retrying.
func Transient(output string) bool { return transientPatterns.MatchString(output) }

func validateTicket(self metadata.Instance, t *joinproto.IssueJoinTicketResponse, dirs cpfiles.Dirs) error {
	switch {
	case t.GetNodeName() == "":
		return fmt.Errorf("%w: no node name", ErrInvalidTicket)
	case t.GetNodeName() != self.Name:
		return fmt.Errorf("%w: issued for node %q, metadata says this node is %q", ErrInvalidTicket, t.GetNodeName(), self.Name)
	case len(t.GetClusterId()) == 0:
		return fmt.Errorf("%w: no cluster ID", ErrInvalidTicket)
	case len(t.GetKubeletCert()) == 0:
		return fmt.Errorf("%w: no kubelet certificate", ErrInvalidTicket)
	case len(self.IPs) == 0:
		return fmt.Errorf("%w: this node has no IP in metadata", ErrInvalidTicket)
	}
	// Every file's path is checked against its directory before anything is written.
	if err := dirs.Check(t.GetControlPlaneFiles()); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidTicket, err)
	}
	if len(t.GetControlPlaneFiles()) == 0 && len(t.GetKmsKeys()) > 0 {
		return fmt.Errorf("%w: a worker's ticket carries KMS keys", ErrInvalidTicket)
	}
	return nil
}

// ticketKMSKeys is the ticket's KMS key set.
func ticketKMSKeys(t *joinproto.IssueJoinTicketResponse) kmsplugin.KeySet {
	set := kmsplugin.KeySet{Active: t.GetKmsActiveGeneration()}
	for _, k := range t.GetKmsKeys() {
		set.Keys = append(set.Keys, kmsplugin.Key{Generation: k.GetGeneration(), KEK: k.GetKey()})
	}
	return set
}

// discoveryKubeconfig renders the kubeconfig of a tokenless join: the ticket's cluster CA (which must
// match the ticket's CA pin), the API server, and the ticket's kubelet certificate with this node's
// key as client credentials. The certificate must be for this node's name, for this key and signed by
// that CA: a ticket that fails any of these is refused before anything runs.
func discoveryKubeconfig(t *joinproto.IssueJoinTicketResponse, key crypto.Signer) ([]byte, error) {
	cas, err := pemcerts.Parse(t.GetClusterCaCert())
	if err != nil {
		return nil, fmt.Errorf("%w: cluster CA certificate: %w", ErrInvalidTicket, err)
	}
	caCert := cas[0]
	sum := sha256.Sum256(caCert.RawSubjectPublicKeyInfo)
	pin := "sha256:" + hex.EncodeToString(sum[:])
	pinned := false
	for _, h := range t.GetDiscoveryTokenCaCertHashes() {
		pinned = pinned || strings.EqualFold(h, pin)
	}
	if !pinned {
		return nil, fmt.Errorf("%w: the cluster CA certificate does not match the ticket's CA pin", ErrInvalidTicket)
	}
	certs, err := pemcerts.Parse(t.GetKubeletCert())
	if err != nil {
		return nil, fmt.Errorf("%w: kubelet certificate: %w", ErrInvalidTicket, err)
	}
	cert := certs[0]
	switch {
	case cert.Subject.CommonName != "system:node:"+t.GetNodeName():
		return nil, fmt.Errorf("%w: kubelet certificate is for %q, not for node %q", ErrInvalidTicket, cert.Subject.CommonName, t.GetNodeName())
	case !publicKeyEqual(cert.PublicKey, key.Public()):
		return nil, fmt.Errorf("%w: kubelet certificate is not for this node's key", ErrInvalidTicket)
	}
	if err := cert.CheckSignatureFrom(caCert); err != nil {
		return nil, fmt.Errorf("%w: kubelet certificate is not signed by the cluster CA: %w", ErrInvalidTicket, err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encoding kubelet key: %w", err)
	}
	const name = "berth-join"
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[name] = &clientcmdapi.Cluster{Server: "https://" + t.GetApiServerEndpoint(), CertificateAuthorityData: t.GetClusterCaCert()}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{
		ClientCertificateData: t.GetKubeletCert(),
		ClientKeyData:         pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}
	cfg.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: name}
	cfg.CurrentContext = name
	out, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("encoding discovery kubeconfig: %w", err)
	}
	return out, nil
}

func publicKeyEqual(a, b crypto.PublicKey) bool {
	k, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && k.Equal(b)
}

func (j *Joiner) dirs() cpfiles.Dirs {
	return cpfiles.Dirs{Kubernetes: j.cfg.KubernetesDir, State: j.cfg.StateDir}
}

// writeFiles writes the control-plane files (the PKI's shared keys, the cluster configuration's
// admission configuration, audit policy and kubeadm patches, at the paths init wrote them) and the
// kubelet's client certificate. It runs before every attempt because kubeadm reset removes them.
func (j *Joiner) writeFiles(t *joinproto.IssueJoinTicketResponse, kubeletKey crypto.Signer) error {
	if files := t.GetControlPlaneFiles(); len(files) > 0 {
		if admission, _, _ := j.dirs().Written(files); admission == "" {
			// A joinservice that sends no admission configuration: Berth's own, which the cluster
			// configuration kubeadm join reads points the API server at.
			if _, err := berthsystem.WriteAdmissionConfiguration(j.fs, j.cfg.KubernetesDir); err != nil {
				return err
			}
		}
		if err := cpfiles.Write(j.fs, j.dirs(), files); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidTicket, err)
		}
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(kubeletKey)
	if err != nil {
		return fmt.Errorf("encoding kubelet key: %w", err)
	}
	var pair bytes.Buffer
	pair.Write(t.GetKubeletCert())
	if err := pem.Encode(&pair, &pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}); err != nil {
		return fmt.Errorf("encoding kubelet key: %w", err)
	}
	certDir := filepath.Join(j.cfg.KubeletDir, "pki")
	if err := j.fs.MkdirAll(certDir, 0o700); err != nil {
		return fmt.Errorf("creating kubelet PKI directory: %w", err)
	}
	if err := afero.WriteFile(j.fs, filepath.Join(certDir, "kubelet-client-current.pem"), pair.Bytes(), 0o600); err != nil {
		return fmt.Errorf("writing kubelet client certificate: %w", err)
	}
	return nil
}

// tail keeps the last max bytes written to it.
type tail struct {
	max int
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = t.buf[over:]
	}
	return len(p), nil
}

func (t *tail) String() string { return string(t.buf) }

// zapWriter logs command output at debug level.
type zapWriter struct{ log *zap.Logger }

func (w *zapWriter) Write(p []byte) (int, error) {
	w.log.Debug("kubeadm output", zap.ByteString("output", p))
	return len(p), nil
}

// diskBinder re-keys the node's fresh state disk to the cluster's disk key (bootstage.Stage).
type diskBinder interface {
	Bind(ctx context.Context, diskKey, clusterID, binding []byte) error
}

// kmsInstaller makes a key set the node's KMS keys (kmskeeper.Keeper).
type kmsInstaller interface {
	Install(ctx context.Context, set kmsplugin.KeySet) error
}

// WithKMS makes Join of a control plane install the ticket's KMS keys (the plugin runs and the API
// server's EncryptionConfiguration is in place) before kubeadm join starts the API server, which the
// cluster's kubeadm configuration tells to encrypt through the plugin.
func (j *Joiner) WithKMS(k kmsInstaller) *Joiner {
	j.kms = k
	return j
}

// WithDisk makes Join bind the node's state disk to the cluster right after it took the node lock,
// before it writes anything of the cluster's.
func (j *Joiner) WithDisk(d diskBinder) *Joiner {
	j.disk = d
	return j
}

// locker is the node lock.
type locker interface {
	TryLockOnce(ctx context.Context, owner string, clusterID []byte) error
}

// kubeadmRunner runs kubeadm's join steps.
type kubeadmRunner interface {
	Join(ctx context.Context, out io.Writer, configPath string) error
	Reset(ctx context.Context, out io.Writer, criSocket string) error
}

// kubeletStarter starts and stops the kubelet (internal/kubelet).
type kubeletStarter interface {
	// Start enables the kubelet; it may return before the kubelet runs.
	Start(ctx context.Context) error
	// Stop stops the kubelet and returns once it no longer runs.
	Stop(ctx context.Context) error
}

// stateStore persists the node state.
type stateStore interface {
	Save(*nodestate.State) error
}
