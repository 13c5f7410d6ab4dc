package joinservice

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
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
	if len(l.addrs) != 0 {
		t.Fatal("Run listened although it could not start")
	}
}
