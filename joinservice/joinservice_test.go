package joinservice

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
	"github.com/berth-k8s/berth/joinservice/health"
	"github.com/berth-k8s/berth/joinservice/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// listener opens loopback listeners on free ports and hands each out on addrs.
type listener struct{ addrs chan string }

func (l listener) Listen(ctx context.Context, network, _ string) (net.Listener, error) {
	lis, err := (&net.ListenConfig{}).Listen(ctx, network, "127.0.0.1:0")
	if err == nil {
		l.addrs <- lis.Addr().String()
	}
	return lis, err
}

type peers []metadata.Instance

func (p peers) Peers(context.Context) ([]metadata.Instance, error) { return p, nil }

// cluster is what berth init leaves in berth-system for the joinservice.
func cluster() *fake.Clientset {
	return fake.NewClientset(
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.SecretName, Namespace: joinconfig.Namespace},
			Data: joinconfig.ClusterSecrets{MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32)}.Data()},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.JoinConfigName, Namespace: joinconfig.Namespace},
			Data: joinconfig.Config{APIServerEndpoint: "198.51.100.10:6443", KubernetesVersion: "v1.34.2"}.Data()},
	)
}

func deps(t *testing.T, client *fake.Clientset, l listener) Deps {
	return Deps{
		Log: zap.NewNop(), Client: client, Listen: l, Attestation: "insecure-none",
		Metadata: peers{{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}},
		Address:  "unused", MetricsAddress: "unused", Namespace: joinconfig.Namespace, PKIDir: catest.WriteDir(t), Replica: "cp-0",
		Limits: server.DefaultLimits, AttestLimits: atls.DefaultLimits,
	}
}

// TestRunServesAndStops: Run serves tickets and metrics until its context ends; then everything
// stops, and the ledger writer, which stops last, has written the attempts of the last calls.
func TestRunServesAndStops(t *testing.T) {
	client := cluster()
	l := listener{addrs: make(chan string, 2)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, deps(t, client, l)) }()
	metricsAddr, addr := <-l.addrs, <-l.addrs

	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "x"}}, key)
	resp, err := joinproto.NewJoinServiceClient(conn).IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr, Role: joinproto.Role_ROLE_WORKER, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"})
	if err != nil || resp.GetNodeName() != "worker-0" || resp.GetApiServerEndpoint() != "198.51.100.10:6443" {
		t.Fatalf("IssueJoinTicket() = %v, %v", resp, err)
	}

	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	mresp, err := hc.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	if want := `berth_joinservice_attempts_total{outcome="accepted",reason="",rpc="join"} 1`; !strings.Contains(string(body), want) {
		t.Errorf("metrics lack %s", want)
	}

	for _, path := range []string{"/livez", "/readyz"} {
		if code, body := probe(t, metricsAddr, path); code != http.StatusOK {
			t.Errorf("%s while serving = %d %q, want 200", path, code, body)
		}
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v after its context ended, want nil", err)
	}
	es, err := joinledger.Read(context.Background(), client, joinconfig.Namespace)
	if err != nil || len(es) != 1 || es[0].Node != "worker-0" || es[0].Outcome != joinledger.OutcomeAccepted {
		t.Fatalf("ledger after Run: %+v, %v", es, err)
	}
	if _, err := net.Dial("tcp", addr); err == nil {
		t.Fatal("the gRPC listener is still open after Run")
	}
}

// TestRunWithoutJoinConfiguration: a start failure is returned before anything listens or runs.
func TestRunWithoutJoinConfiguration(t *testing.T) {
	client := cluster()
	if err := client.CoreV1().ConfigMaps(joinconfig.Namespace).Delete(context.Background(), joinconfig.JoinConfigName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	l := listener{addrs: make(chan string, 2)}
	err := Run(context.Background(), deps(t, client, l))
	if err == nil || !strings.Contains(err.Error(), "reading join configuration") {
		t.Fatalf("Run() = %v, want an error reading the join configuration", err)
	}
	// Only the probes' port was opened (it answers from the start), and it is closed again.
	if len(l.addrs) != 1 {
		t.Fatalf("Run opened %d listeners although it could not start, want only the metrics port", len(l.addrs))
	}
	if _, err := net.Dial("tcp", <-l.addrs); err == nil {
		t.Fatal("the metrics listener is still open after a failed start")
	}
}

// probe GETs path on the metrics port.
func probe(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := hc.Get("http://" + addr + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// TestProbesWhileWaitingForSecrets: right after init the cluster Secret may not be readable yet.
// The joinservice then is live (the kubelet must not restart it) and not ready, saying why; once
// the Secret is there it serves and is ready.
func TestProbesWhileWaitingForSecrets(t *testing.T) {
	client := cluster()
	secret, err := client.CoreV1().Secrets(joinconfig.Namespace).Get(context.Background(), joinconfig.SecretName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.CoreV1().Secrets(joinconfig.Namespace).Delete(context.Background(), joinconfig.SecretName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	l := listener{addrs: make(chan string, 2)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, deps(t, client, l)) }()
	metricsAddr := <-l.addrs

	// Not ready, naming the Secret, once the first read has failed.
	var body string
	if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		var code int
		code, body = probe(t, metricsAddr, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "[-]cluster-secrets: reading cluster secrets"), nil
	}); err != nil {
		t.Fatalf("/readyz while the Secret is missing: %q, want 503 naming cluster-secrets", body)
	}
	if !strings.Contains(body, "[-]join-server: not checked yet") {
		t.Errorf("/readyz while the Secret is missing does not say the server is not serving yet: %q", body)
	}
	if code, body := probe(t, metricsAddr, "/livez"); code != http.StatusOK {
		t.Fatalf("/livez while waiting for the Secret = %d %q, want 200", code, body)
	}

	if _, err := client.CoreV1().Secrets(joinconfig.Namespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		var code int
		code, body = probe(t, metricsAddr, "/readyz")
		return code == http.StatusOK, nil
	}); err != nil {
		t.Fatalf("/readyz after the Secret appeared: %q, want 200", body)
	}
	<-l.addrs // the join listener
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v", err)
	}
}

type failingIssuer struct{ err error }

func (failingIssuer) Variant() string { return "tpm" }
func (i failingIssuer) Issue(context.Context, []byte, []byte) ([]byte, error) {
	return nil, i.err
}

// TestIssuerSelfCheck: the readiness self-check passes with an issuer that makes documents and fails,
// naming the variant and the reason, with one that does not, or with none.
func TestIssuerSelfCheck(t *testing.T) {
	if _, err := issueOnce(context.Background(), atlstest.Issuer{}); err != nil {
		t.Fatalf("self-check with a working issuer: %v", err)
	}
	_, err := issueOnce(context.Background(), failingIssuer{errors.New("opening TPM: no such device")})
	if err == nil || !strings.Contains(err.Error(), "tpm") || !strings.Contains(err.Error(), "no such device") {
		t.Fatalf("self-check with a failing issuer = %v", err)
	}
	if _, err := issueOnce(context.Background(), nil); err == nil {
		t.Fatal("self-check without an issuer passed")
	}

	// The loop records the result as the attestation-issuer condition until its context ends.
	probes := health.New(condIssuer)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		checkIssuer(ctx, failingIssuer{errors.New("TPM gone")}, probes, zap.NewNop())
	}()
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		err := probes.Ready()
		return err != nil && strings.Contains(err.Error(), "TPM gone"), nil
	}); err != nil {
		t.Fatalf("readiness after a failed self-check: %v", probes.Ready())
	}
	cancel()
	<-done
}
