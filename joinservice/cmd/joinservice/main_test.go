package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/cli"
	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(proctest.Main(m))) }

// stopGrace is how long the joinservice gets to stop cleanly after SIGTERM.
const stopGrace = 20 * time.Second

// startJoinService builds this package's binary (once per test binary) and starts it against env with
// the joinservice's RBAC identity, the static metadata meta, a fake cluster PKI, a free listen address
// and replica name cp-0, plus args and env. It is stopped at t's cleanup; so is a process left
// running. It returns the process and its listen address.
func startJoinService(t *testing.T, env *apiservertest.Env, meta string, environ []string, args ...string) (*proctest.Process, string) {
	t.Helper()
	dir := t.TempDir()
	pki := catest.WriteControlPlaneDir(t)
	metaFile := filepath.Join(dir, "metadata.yaml")
	if err := os.WriteFile(metaFile, []byte(meta), 0o600); err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := env.WriteKubeconfig(apiservertest.JoinServiceUser)
	if err != nil {
		t.Fatal(err)
	}
	addr := proctest.FreeAddr(t)
	p := proctest.Start(t, proctest.Cmd{
		Name: "joinservice", Path: proctest.Build(t, "."), Env: environ, Grace: stopGrace,
		Args: append([]string{"--metadata=static", "--metadata-file=" + metaFile, "--kubeconfig=" + kubeconfig,
			"--listen=" + addr, "--pki-dir=" + pki, "--replica=cp-0"}, args...),
	})
	return p, addr
}

// clientFrom dials addr from the loopback address src, so the joinservice sees src as the peer.
func clientFrom(t *testing.T, addr, src string) joinproto.JoinServiceClient {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return joinproto.NewJoinServiceClient(conn)
}

func csr(t *testing.T) []byte {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "system:node:someone-else"}}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func reasonOf(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// TestBinaryAgainstAPIServer runs the real joinservice binary (without attestation) against a real
// API server on which Berth's components are installed, with the joinservice's RBAC identity: no
// ticket needs a bootstrap token (no Secret is written for a worker or a control plane), every attempt lands in the ledger that berth status prints, metrics
// are served, and SIGTERM stops it cleanly.
func TestBinaryAgainstAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	adminConfig, err := env.WriteKubeconfig(apiservertest.AdminUser)
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := proctest.FreeAddr(t)
	js, addr := startJoinService(t, env, `self: {name: cp-0, role: control-plane, ips: [198.51.100.10]}
peers:
  - {name: worker-0, role: worker, ips: [127.0.0.2]}
  - {name: cp-1, role: control-plane, ips: [127.0.0.3]}
`, []string{"BERTH_ATTESTATION=", "BERTH_METADATA="}, "--attestation=insecure-none", "--metrics-listen="+metricsAddr)

	// The first join waits until the joinservice serves; any answer but Unavailable ends the wait.
	worker := clientFrom(t, addr, "127.0.0.2")
	var resp *joinproto.IssueJoinTicketResponse
	workerCSR := csr(t)
	var joinErr error
	if err := proctest.WaitReady(ctx, 100*time.Millisecond, 30*time.Second, func(ctx context.Context) error {
		resp, joinErr = worker.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: workerCSR, Role: joinproto.Role_ROLE_WORKER, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"})
		if status.Code(joinErr) == codes.Unavailable {
			return joinErr
		}
		return nil
	}, js); err != nil {
		t.Fatalf("waiting for the joinservice: %v", err)
	}
	if joinErr != nil {
		t.Fatalf("worker join: %v", joinErr)
	}
	admin := env.Client(t, apiservertest.AdminUser)
	if resp.GetBootstrapToken() != "" {
		t.Fatal("worker ticket carries a bootstrap token")
	}
	if secrets, err := admin.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{FieldSelector: "type=bootstrap.kubernetes.io/token"}); err != nil || len(secrets.Items) != 0 {
		t.Fatalf("bootstrap token Secrets after a worker join: %d (%v), want none", len(secrets.Items), err)
	}
	block, _ := pem.Decode(resp.GetKubeletCert())
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil || cert.Subject.CommonName != "system:node:worker-0" {
		t.Fatalf("kubelet certificate for %v (%v), want system:node:worker-0", cert.Subject.CommonName, err)
	}
	if _, err := worker.IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"}); reasonOf(err) != "ROLE_MISMATCH" {
		t.Fatalf("worker asking for control plane: %v", err)
	}
	cp, err := clientFrom(t, addr, "127.0.0.3").IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t), Role: joinproto.Role_ROLE_CONTROL_PLANE, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"})
	if err != nil || len(cp.GetControlPlaneFiles()) != 8 {
		t.Fatalf("control-plane join: %v", err)
	}
	if cp.GetBootstrapToken() != "" {
		t.Fatal("control-plane ticket carries a bootstrap token")
	}
	if secrets, err := admin.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{FieldSelector: "type=bootstrap.kubernetes.io/token"}); err != nil || len(secrets.Items) != 0 {
		t.Fatalf("bootstrap token Secrets after a control-plane join: %d (%v), want none", len(secrets.Items), err)
	}
	// The control plane's join holds the slot past its ticket, until it has joined (it never will
	// here: there is no etcd) or the join timeout frees it.
	holder, held, err := cpslot.New(admin, "berth-system", "test", nil, nil).Current(ctx)
	if err != nil || !held || holder.State != cpslot.Joining || holder.Node != "cp-1" || holder.Address != "127.0.0.3" {
		t.Fatalf("control-plane slot after the ticket: %+v held=%v %v, want it held for cp-1's join", holder, held, err)
	}
	if _, err := clientFrom(t, addr, "127.0.0.4").IssueJoinTicket(ctx, &joinproto.IssueJoinTicketRequest{KubeletCsr: csr(t), Role: joinproto.Role_ROLE_WORKER, DiskUuid: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"}); reasonOf(err) != "UNKNOWN_PEER" {
		t.Fatalf("unknown peer: %v", err)
	}

	var entries []ledger.Entry
	// The ledger is written asynchronously: wait until this test's four attempts are in (or time out
	// and judge what is there).
	_ = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		all, _ := joinledger.Read(ctx, admin, joinconfig.Namespace)
		entries = entries[:0]
		for _, e := range all {
			if e.Peer == "127.0.0.2" || e.Peer == "127.0.0.3" || e.Peer == "127.0.0.4" { // this test's peers
				entries = append(entries, e)
			}
		}
		return len(entries) >= 4, nil
	})
	reasons := map[string]int{}
	for _, e := range entries {
		reasons[e.Outcome+"/"+e.Reason]++
	}
	if len(entries) != 4 || reasons["accepted/"] != 2 || reasons["rejected/ROLE_MISMATCH"] != 1 || reasons["rejected/UNKNOWN_PEER"] != 1 {
		t.Fatalf("ledger: %+v", entries)
	}

	var out, errOut bytes.Buffer
	if code := cli.Execute(ctx, []string{"status", "--kubeconfig", adminConfig}, &out, &errOut); code != 0 {
		t.Fatalf("berth status exited %d: %s", code, errOut.String())
	}
	t.Logf("berth status:\n%s", out.String())
	if s := out.String(); strings.Index(s, "UNKNOWN_PEER") > strings.Index(s, "ACCEPTED") || !strings.Contains(s, "worker-0") {
		t.Fatalf("berth status output:\n%s", s)
	}

	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	mresp, err := hc.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, want := range []string{
		`berth_joinservice_attempts_total{outcome="accepted",reason="",rpc="join"} 2`,
		`berth_joinservice_attempts_total{outcome="rejected",reason="UNKNOWN_PEER",rpc="join"} 1`,
		`berth_joinservice_ledger_dropped_total 0`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %s", want)
		}
	}

	if err := js.Stop(); err != nil {
		t.Fatalf("joinservice on SIGTERM: %v", err)
	}
}
