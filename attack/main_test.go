package attack

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
	"github.com/berth-k8s/berth/nodelock"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(apiservertest.StoppingShared(proctest.Main(m)))
}

// zero is a PCR of the genuine image in this suite (every PCR of a genuine software TPM is zero).
var zero = strings.Repeat("00", 32)

// genuinePCRs are a genuine node's PCRs; tamperedPCRs deviate in PCR 4, the image.
func genuinePCRs() map[uint32][]byte {
	pcrs := map[uint32][]byte{}
	for i := range uint32(24) {
		pcrs[i] = make([]byte, 32)
	}
	return pcrs
}

func tamperedPCRs() map[uint32][]byte {
	pcrs := genuinePCRs()
	for i := range pcrs[4] {
		pcrs[4][i] = 0x11
	}
	return pcrs
}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i := range lines {
		lines[i] = prefix + lines[i]
	}
	return strings.Join(lines, "\n") + "\n"
}

// Addresses metadata gives the joinservice's cluster: workers 127.0.1.1-127.0.1.40, control planes
// 127.0.3.1-127.0.3.3. 127.0.9.9 belongs to no instance.
const (
	workers       = 40
	controlPlanes = 3
	unknownIP     = "127.0.9.9"
)

func workerIP(i int) string       { return fmt.Sprintf("127.0.1.%d", i) }
func controlPlaneIP(i int) string { return fmt.Sprintf("127.0.3.%d", i) }

// joinCluster is a joinservice under attack: the real binary attesting with swtpm, a real API server
// with Berth installed, and the policies its genuine nodes use.
type joinCluster struct {
	env   *apiservertest.Env
	admin kubernetes.Interface
	addr  string
	js    *proctest.Process
	// nodeCA is the EK CA the cluster policy trusts.
	nodeCA *vtpmtest.CA
	// swCA is the swtpm CA the cluster policy trusts too (the joinservice's own TPM's).
	swCA *vtpmtest.SwtpmCA
	// joinPolicy is what genuine nodes demand of the joinservice; activating is the same without the
	// cluster's attestation-key CA, so that nodes probe the joinservice's identity and activate its key.
	joinPolicy, activating *policy.Policy
	// metricsAddr serves the joinservice's probes.
	metricsAddr string
}

// startJoinCluster starts the joinservice with extraArgs (on top of its default limits).
func startJoinCluster(t *testing.T, extraArgs ...string) *joinCluster {
	t.Helper()
	ctx := context.Background()
	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm (fails under CI=true)
	env := apiservertest.Shared(t) // skips without kube-apiserver and etcd
	serviceTPM := vtpmtest.StartSwtpm(t, swCA)
	// The joinservice runs on a control plane: its lock register holds the control plane's value.
	if err := vtpm.NewLockRegister(serviceTPM.Open, 15).MarkBootstrapped(ctx, nodelock.ControlPlaneLockID(apiservertest.ClusterID())); err != nil {
		t.Fatal(err)
	}
	nodeCA, err := vtpmtest.NewCA("attack suite EK CA")
	if err != nil {
		t.Fatal(err)
	}
	// The cluster's policy trusts the EK CAs of all its machines, the joinservice's too: it checks
	// its own EK against the policy before its attestation key is certified.
	clusterPolicy := "variant: tpm\nmeasurements:\n  4: {expected: " + zero + ", source: the image}\n  15: {expected: " + zero + ", source: fresh node}\n" +
		"trustRoots:\n  - pem: |\n" + indent(string(nodeCA.PEM())+string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	// The tests share one API server: each starts with an empty join ledger, so that what it reads
	// there (a flood's last address, the evidence share) is its own and not an earlier test's, whose
	// flood may have used the same addresses. InstallBerth creates the ConfigMap again.
	admin := env.Client(t, apiservertest.AdminUser)
	if err := admin.CoreV1().ConfigMaps(joinconfig.Namespace).Delete(ctx, joinconfig.JoinLedgerName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if err := env.InstallBerth(ctx, clusterPolicy); err != nil {
		t.Fatal(err)
	}
	keys := apiservertest.ClusterKeys()
	akCA, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		t.Fatal(err)
	}
	activatingText := "variant: tpm\nmeasurements:\n  4: {expected: " + zero + ", source: the image}\n  15: {nonZero: true, source: bootstrapped}\n" +
		"trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")
	joinPolicy, err := policy.Parse([]byte(activatingText+"akRoots:\n  - pem: |\n"+indent(string(akCA.PEM()), "      ")), "join policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	activating, err := policy.Parse([]byte(activatingText), "join policy without the AK CA", nil)
	if err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	var meta strings.Builder
	meta.WriteString("self: {name: cp-1, role: control-plane, ips: [" + controlPlaneIP(1) + "]}\npeers:\n")
	for i := 1; i <= workers; i++ {
		fmt.Fprintf(&meta, "  - {name: worker-%d, role: worker, ips: [%s]}\n", i, workerIP(i))
	}
	for i := 1; i <= controlPlanes; i++ {
		fmt.Fprintf(&meta, "  - {name: cp-%d, role: control-plane, ips: [%s]}\n", i, controlPlaneIP(i))
	}
	if err := os.WriteFile(filepath.Join(dir, "metadata.yaml"), []byte(meta.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.JoinServiceUser)
	if err != nil {
		t.Fatal(err)
	}
	c := &joinCluster{env: env, admin: admin, addr: proctest.FreeAddr(t), nodeCA: nodeCA, swCA: swCA,
		joinPolicy: joinPolicy, activating: activating, metricsAddr: proctest.FreeAddr(t)}
	// As many cores as its DaemonSet's CPU limit gives it (Go sizes GOMAXPROCS to the limit there).
	c.js = proctest.Start(t, proctest.Cmd{
		Name: "joinservice", Path: proctest.Build(t, "github.com/berth-k8s/berth/joinservice/cmd/joinservice"), Grace: 20 * time.Second,
		Env: []string{fmt.Sprintf("GOMAXPROCS=%d", berthsystem.JoinServiceCPUs)},
		Args: append([]string{"--attestation=tpm", "--tpm=" + serviceTPM.Spec, "--metadata=static",
			"--metadata-file=" + filepath.Join(dir, "metadata.yaml"), "--kubeconfig=" + kubeconfig, "--listen=" + c.addr,
			"--metrics-listen=" + c.metricsAddr, "--pki-dir=" + catest.WriteControlPlaneDir(t), "--replica=cp-1"}, extraArgs...),
	})
	if err := proctest.WaitReady(ctx, 100*time.Millisecond, 2*time.Minute, c.ready, c.js); err != nil {
		t.Fatalf("waiting for the joinservice's /readyz: %v", err)
	}
	return c
}

// ready reports whether the joinservice serves joins (/readyz answers OK).
func (c *joinCluster) ready(ctx context.Context) error {
	return proctest.HTTPOK("http://" + c.metricsAddr + "/readyz")(ctx)
}

// softTPM is a software TPM whose EK the cluster's CA (or another) certified, quoting pcrs.
func softTPM(t *testing.T, ca *vtpmtest.CA, pcrs map[uint32][]byte) *vtpmtest.SoftTPM {
	t.Helper()
	s, err := vtpmtest.NewSoftTPM(ca, pcrs)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// conn dials the joinservice from ip (a loopback address), attesting with issuer and validating the
// joinservice with the genuine nodes' join policy.
func (c *joinCluster) conn(t *testing.T, ip string, issuer atls.Issuer) *grpc.ClientConn {
	t.Helper()
	return c.connWith(t, ip, issuer, c.joinPolicy)
}

// connWith is conn with another join policy.
func (c *joinCluster) connWith(t *testing.T, ip string, issuer atls.Issuer, p *policy.Policy) *grpc.ClientConn {
	t.Helper()
	conn, err := c.dial(ip, issuer, p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// dial is connWith for goroutines other than the test's: the caller closes the connection.
func (c *joinCluster) dial(ip string, issuer atls.Issuer, p *policy.Policy) (*grpc.ClientConn, error) {
	validator, err := choose.NewValidator(p, zap.NewNop())
	if err != nil {
		return nil, err
	}
	creds, err := atls.NewCredentials(issuer, validator)
	if err != nil {
		return nil, err
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return grpc.NewClient("passthrough:///"+c.addr, grpc.WithTransportCredentials(creds),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
}

// join asks for a worker's ticket from ip with a fresh connection.
func (c *joinCluster) join(t *testing.T, ip string, issuer atls.Issuer, req *joinproto.IssueJoinTicketRequest) (*joinproto.IssueJoinTicketResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := c.conn(t, ip, issuer)
	defer conn.Close()
	return joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, req)
}

// joinWith is join validating the joinservice with policy p.
func (c *joinCluster) joinWith(t *testing.T, ip string, issuer atls.Issuer, p *policy.Policy, req *joinproto.IssueJoinTicketRequest) (*joinproto.IssueJoinTicketResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := c.connWith(t, ip, issuer, p)
	defer conn.Close()
	return joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, req)
}

// workerRequest is a genuine worker's request with a fresh key's CSR.
func workerRequest(t *testing.T, disk string) *joinproto.IssueJoinTicketRequest {
	return &joinproto.IssueJoinTicketRequest{KubeletCsr: newCSR(t, pkix.Name{CommonName: "system:node:me"}), Role: joinproto.Role_ROLE_WORKER, DiskUuid: disk}
}

func newCSR(t *testing.T, subject pkix.Name, dns ...string) []byte {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: subject, DNSNames: dns}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// reasonOf is the joinservice's reason code of a refused call.
func reasonOf(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// waitLedger waits until the join ledger holds an entry that match accepts and returns it.
func (c *joinCluster) waitLedger(t *testing.T, what string, match func(joinledger.Entry) bool) joinledger.Entry {
	t.Helper()
	var found joinledger.Entry
	var last []joinledger.Entry
	if err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		es, err := joinledger.Read(ctx, c.admin, joinconfig.Namespace)
		if err != nil {
			return false, nil //nolint:nilerr // no ledger yet: keep waiting
		}
		last = es
		for _, e := range es {
			if match(e) {
				found = e
				return true, nil
			}
		}
		return false, nil
	}); err != nil {
		var lines []string
		for _, e := range last {
			lines = append(lines, fmt.Sprintf("%s %s %s %s %s", e.Peer, e.RPC, e.Outcome, e.Reason, e.Message))
		}
		t.Fatalf("the ledger never showed %s; it holds:\n%s", what, strings.Join(lines, "\n"))
	}
	return found
}

// ledgerRefusal matches a refusal of peer with reason.
func ledgerRefusal(peer, reason string) func(joinledger.Entry) bool {
	return func(e joinledger.Entry) bool {
		return e.Peer == peer && e.Outcome == joinledger.OutcomeRejected && e.Reason == reason
	}
}
