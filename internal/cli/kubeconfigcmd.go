package cli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spf13/afero"
	"github.com/spf13/cobra"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/workspace"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// ErrMasterSecretMismatch is returned by berth kubeconfig when the master secret is not the
// cluster's: the joinservice's lock register holds another cluster's value (nothing was sent), or
// the joinservice refused the proof.
var ErrMasterSecretMismatch = errors.New("the master secret does not match this cluster")

// ErrKubeconfigExists is returned when the kubeconfig to write exists and --force is not given:
// nothing was asked of the cluster.
var ErrKubeconfigExists = errors.New("the kubeconfig exists: pass --force to replace it, or --out another file")

// defaultAdminValidity is how long berth kubeconfig's credential is valid unless --validity says.
const defaultAdminValidity = 24 * time.Hour

// Names in the kubeconfig berth kubeconfig writes.
const (
	kubeconfigCluster = "kubernetes"
	kubeconfigUser    = "berth-admin"
	kubeconfigContext = kubeconfigUser + "@" + kubeconfigCluster
)

type kubeconfigOptions struct {
	workspace    string
	endpoint     string
	masterSecret string
	policyPath   string
	out          string
	force        bool
	validity     time.Duration
	timeout      time.Duration
}

func newKubeconfigCmd() *cobra.Command {
	o := kubeconfigOptions{workspace: ".", validity: defaultAdminValidity, timeout: time.Minute}
	cmd := &cobra.Command{
		Use:   "kubeconfig --endpoint CONTROL_PLANE[:PORT] [--validity D] [--out FILE] [--force]",
		Short: "Get a fresh admin kubeconfig with the master secret",
		Long: `kubeconfig gets a new cluster-admin credential from the cluster, for example after the
admin.conf of berth init expired or was lost. It needs the master secret (master-secret.json as
berth init wrote it), not a working credential.

It connects to the joinservice of a control plane (--endpoint, port ` + strconv.Itoa(joinconfig.JoinPort) + ` unless given), has it
attest inside the TLS handshake and judges it against --policy (the cluster's join policy), and
checks that the control plane's lock register holds the cluster ID the master secret derives:
when it does not, the master secret is not this cluster's and nothing is sent. It then generates
a private key here, asks the joinservice for a nonce and proves that it holds the master secret
with an HMAC over the nonce, the public key and the validity, under a key derived from the master
secret for this alone. Neither the master secret nor the private key leaves this machine. The
joinservice answers with a client certificate in kubeadm's group kubeadm:cluster-admins, signed
by the cluster CA and valid for --validity (` + joinproto.MinAdminValidity.String() + ` to ` + joinproto.MaxAdminValidity.String() + `), and records it in the join ledger
(berth status) and its log.

The kubeconfig is written with mode 0600 and never replaces a file unless --force is given.
--workspace names the directory berth init wrote; --master-secret, --policy and --out default to
its master-secret.json, join-policy.yaml and admin.conf. --endpoint is a control plane's own
address (a load balancer in front of the API servers forwards only their port).

Exit code 3: the joinservice failed attestation, or the master secret does not match the cluster.`,
		Example: `  berth kubeconfig --endpoint 198.51.100.10 --workspace my-cluster --validity 8h --force
  berth kubeconfig --endpoint 198.51.100.10 --master-secret master-secret.json --policy join-policy.yaml --validity 1h --out ops.conf`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runKubeconfig(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.workspace, "workspace", o.workspace, "directory berth init wrote (master-secret.json, join-policy.yaml, admin.conf)")
	f.StringVar(&o.endpoint, "endpoint", "", "a control plane's joinservice, HOST[:PORT] (required)")
	f.StringVar(&o.masterSecret, "master-secret", "", "the cluster's master-secret.json (default: the workspace's)")
	f.StringVar(&o.policyPath, "policy", "", "the cluster's join policy, which the joinservice must satisfy (default: the workspace's join-policy.yaml)")
	f.StringVar(&o.out, "out", "", "kubeconfig to write (default: the workspace's admin.conf)")
	f.BoolVar(&o.force, "force", false, "replace --out when it exists")
	f.DurationVar(&o.validity, "validity", o.validity, "how long the credential is valid ("+joinproto.MinAdminValidity.String()+" to "+joinproto.MaxAdminValidity.String()+")")
	f.DurationVar(&o.timeout, "timeout", o.timeout, "give up after this long")
	return cmd
}

// resolve fills the defaults from the workspace and checks the flags; every failure is a usage error.
func (o *kubeconfigOptions) resolve() error {
	if err := checkAdminValidity(o.validity); err != nil {
		return &exitError{code: exitUsage, err: err}
	}
	if o.masterSecret == "" {
		o.masterSecret = filepath.Join(o.workspace, workspace.MasterSecret)
	}
	if o.policyPath == "" {
		o.policyPath = filepath.Join(o.workspace, workspace.JoinPolicy)
	}
	if o.out == "" {
		o.out = filepath.Join(o.workspace, workspace.AdminConf)
	}
	if o.endpoint == "" {
		return usageErr("kubeconfig needs --endpoint: the address of a control plane (its joinservice)")
	}
	if _, _, err := net.SplitHostPort(o.endpoint); err != nil {
		o.endpoint = net.JoinHostPort(o.endpoint, strconv.Itoa(joinconfig.JoinPort))
	}
	if _, _, err := net.SplitHostPort(o.endpoint); err != nil {
		return usageErr("--endpoint %q: %w", o.endpoint, err)
	}
	if !o.force {
		if _, err := os.Lstat(o.out); err == nil {
			return &exitError{code: exitUsage, err: fmt.Errorf("%s: %w", o.out, ErrKubeconfigExists)}
		}
	}
	return nil
}

// checkAdminValidity checks a validity against the joinservice's bounds.
func checkAdminValidity(d time.Duration) error {
	if d < joinproto.MinAdminValidity || d > joinproto.MaxAdminValidity {
		return fmt.Errorf("--validity %s is outside %s..%s", d, joinproto.MinAdminValidity, joinproto.MaxAdminValidity)
	}
	return nil
}

func runKubeconfig(ctx context.Context, out, errOut io.Writer, o kubeconfigOptions) error {
	if err := o.resolve(); err != nil {
		return err
	}
	keys, err := readMasterSecret(o.masterSecret)
	if err != nil {
		return err
	}
	_, validator, err := loadValidator(o.policyPath)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	// The operator attests nothing: the joinservice attests to this side, and the proof admits the
	// operator.
	var verdictMu sync.Mutex
	var verdict error
	creds, err := atls.NewCredentials(nil, validator, atls.WithObserver(func(_ atls.Evidence, err error) {
		verdictMu.Lock()
		defer verdictMu.Unlock()
		verdict = err
	}))
	if err != nil {
		return fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	conn, err := grpc.NewClient(o.endpoint, grpc.WithTransportCredentials(creds))
	if err != nil {
		return usageErr("--endpoint %q: %w", o.endpoint, err)
	}
	defer func() { _ = conn.Close() }()
	client := joinproto.NewJoinServiceClient(conn)

	var p peer.Peer
	ch, err := client.AdminChallenge(ctx, &joinproto.AdminChallengeRequest{}, grpc.Peer(&p))
	info, attested := p.AuthInfo.(atls.AuthInfo)
	if err != nil && !attested {
		verdictMu.Lock()
		rejected := verdict
		verdictMu.Unlock()
		if rejected != nil {
			return &exitError{code: exitRejected, err: fmt.Errorf("the joinservice at %s failed attestation: %s; nothing was sent", o.endpoint, quotePeer(rejected.Error()))}
		}
		return fmt.Errorf("reaching the joinservice at %s: %s", o.endpoint, peerStatus(err))
	}
	if !attested || info.Evidence == nil {
		return &exitError{code: exitRejected, err: fmt.Errorf("the connection to %s carries no attestation; nothing was sent", o.endpoint)}
	}
	if err := controlPlaneOf(info.Evidence, keys); err != nil {
		return &exitError{code: exitRejected, err: fmt.Errorf("%w: the joinservice at %s is not a control plane of the cluster %s derives: %w; nothing was sent",
			ErrMasterSecretMismatch, o.endpoint, o.masterSecret, err)}
	}
	if err != nil {
		return fmt.Errorf("asking the joinservice for a challenge: %s", peerStatus(err))
	}
	_, _ = fmt.Fprintf(errOut, "Joinservice %s attested (%s), a control plane of cluster %s\n", o.endpoint, info.Evidence.Variant, shortID(keys.ClusterID()))

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generating the key: %w", err)
	}
	pub, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return fmt.Errorf("encoding the public key: %w", err)
	}
	seconds := int64(o.validity / time.Second)
	resp, err := client.IssueAdminCredential(ctx, &joinproto.IssueAdminCredentialRequest{
		Nonce: ch.GetNonce(), PublicKey: pub, ValiditySeconds: seconds, Proof: keys.AdminProof(ch.GetNonce(), pub, seconds),
	})
	if err != nil {
		return adminRefusal(err)
	}
	cert, err := parseAdminCert(resp.GetCertificate(), pub)
	if err != nil {
		return err
	}
	server := resp.GetApiServerEndpoint()
	if _, _, err := net.SplitHostPort(server); err != nil {
		return fmt.Errorf("the joinservice named no valid API server endpoint (%s)", quotePeer(server))
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("encoding the private key: %w", err)
	}
	data, err := adminKubeconfig("https://"+server, resp.GetClusterCaCert(), resp.GetCertificate(),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	if err != nil {
		return err
	}
	if err := writeAdminKubeconfig(o.out, data, o.force); err != nil {
		return err
	}
	_, _ = fmt.Fprintf(out, "Wrote %s: %s in %s on https://%s, valid until %s\n", o.out, cert.Subject.CommonName,
		quotePeer(strings.Join(cert.Subject.Organization, ",")), server, cert.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// controlPlaneOf checks that the joinservice's lock register holds the control-plane value of the
// cluster keys derives (nodelock.ControlPlaneLockID), as a node checks its ticket's joinservice: a
// worker's register, another cluster's control plane's, or a master secret of another cluster fail.
func controlPlaneOf(ev *atls.Evidence, keys *clusterkeys.Keys) error {
	var index uint32
	var expected func([]byte) []byte
	switch ev.Variant {
	case vtpm.Variant:
		index, expected = vtpm.DefaultLockPCR, vtpm.ExpectedLockValue
	case tdx.VariantName:
		index, expected = uint32(1+tdx.DefaultLockRTMR), tdx.ExpectedLockRTMR
	default:
		return fmt.Errorf("variant %s has no known lock register", quotePeer(ev.Variant))
	}
	got, ok := ev.Result.Measurements[index]
	if !ok {
		return fmt.Errorf("its attestation does not include lock register %d", index)
	}
	if want := expected(nodelock.ControlPlaneLockID(keys.ClusterID())); !bytes.Equal(got, want) {
		return fmt.Errorf("its lock register %d holds %x, a control plane of this master secret's cluster %x", index, got, want)
	}
	return nil
}

// adminRefusal turns IssueAdminCredential's error into the CLI's.
func adminRefusal(err error) error {
	var reason string
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			reason = info.GetReason()
		}
	}
	switch reason {
	case joinproto.ReasonAdminProofMismatch:
		return &exitError{code: exitRejected, err: fmt.Errorf("the joinservice refused the proof: %w", ErrMasterSecretMismatch)}
	case joinproto.ReasonBadValidity:
		return &exitError{code: exitUsage, err: fmt.Errorf("the joinservice refused the validity: %s", peerStatus(err))}
	}
	return fmt.Errorf("asking for an admin credential: %s", peerStatus(err))
}

// parseAdminCert parses the certificate the joinservice issued and checks that it is for pub.
func parseAdminCert(certPEM, pub []byte) (*x509.Certificate, error) {
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return nil, errors.New("the joinservice's certificate is not PEM")
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parsing the joinservice's certificate: %w", err)
	}
	got, err := x509.MarshalPKIXPublicKey(cert.PublicKey)
	if err != nil || string(got) != string(pub) {
		return nil, errors.New("the joinservice's certificate is for another key")
	}
	return cert, nil
}

// adminKubeconfig is a kubeconfig for server with the cluster CA and the client certificate and key
// (all PEM), built with client-go's types.
func adminKubeconfig(server string, caPEM, certPEM, keyPEM []byte) ([]byte, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[kubeconfigCluster] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caPEM}
	cfg.AuthInfos[kubeconfigUser] = &clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}
	cfg.Contexts[kubeconfigContext] = &clientcmdapi.Context{Cluster: kubeconfigCluster, AuthInfo: kubeconfigUser}
	cfg.CurrentContext = kubeconfigContext
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("encoding the kubeconfig: %w", err)
	}
	return data, nil
}

// writeAdminKubeconfig writes data to path with mode 0600: created exclusively, or with force replacing
// what is there in one rename (atomicfile), so that a failure leaves the old file.
func writeAdminKubeconfig(path string, data []byte, force bool) error {
	if force {
		if err := atomicfile.Write(afero.NewOsFs(), path, data, 0o600); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
		return nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return &exitError{code: exitUsage, err: fmt.Errorf("%s: %w", path, ErrKubeconfigExists)}
	}
	if err != nil {
		return fmt.Errorf("creating %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}
