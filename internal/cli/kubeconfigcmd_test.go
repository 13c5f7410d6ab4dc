package cli

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// fakeAdminService is a joinservice's admin RPCs: nonces it remembers, proofs checked with keys,
// certificates signed by a throwaway CA.
type fakeAdminService struct {
	joinproto.UnimplementedJoinServiceServer
	caKey  *ecdsa.PrivateKey
	caCert *x509.Certificate
	caPEM  []byte

	mu         sync.Mutex
	keys       *clusterkeys.Keys
	nonces     map[string]bool
	challenges int
	requests   []*joinproto.IssueAdminCredentialRequest
}

func newFakeAdminService(t *testing.T, keys *clusterkeys.Keys) *fakeAdminService {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &fakeAdminService{caKey: key, caCert: cert, caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keys: keys, nonces: map[string]bool{}}
}

func (f *fakeAdminService) AdminChallenge(context.Context, *joinproto.AdminChallengeRequest) (*joinproto.AdminChallengeResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.challenges++
	n := make([]byte, 32)
	_, _ = rand.Read(n)
	f.nonces[string(n)] = true
	return &joinproto.AdminChallengeResponse{Nonce: n}, nil
}

func (f *fakeAdminService) IssueAdminCredential(_ context.Context, req *joinproto.IssueAdminCredentialRequest) (*joinproto.IssueAdminCredentialResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, req)
	if !f.nonces[string(req.GetNonce())] || !f.keys.VerifyAdminProof(req.GetNonce(), req.GetPublicKey(), req.GetValiditySeconds(), req.GetProof()) {
		st, _ := status.New(codes.PermissionDenied, "the master secret does not match this cluster").
			WithDetails(&errdetails.ErrorInfo{Reason: joinproto.ReasonAdminProofMismatch})
		return nil, st.Err()
	}
	delete(f.nonces, string(req.GetNonce()))
	pub, err := x509.ParsePKIXPublicKey(req.GetPublicKey())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "berth-admin", Organization: []string{"kubeadm:cluster-admins"}},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Duration(req.GetValiditySeconds()) * time.Second),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, f.caCert, pub, f.caKey)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &joinproto.IssueAdminCredentialResponse{Certificate: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		ClusterCaCert: f.caPEM, ApiServerEndpoint: "198.51.100.1:6443"}, nil
}

func (f *fakeAdminService) calls() (challenges int, requests []*joinproto.IssueAdminCredentialRequest) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.challenges, append([]*joinproto.IssueAdminCredentialRequest(nil), f.requests...)
}

func (f *fakeAdminService) reset(keys *clusterkeys.Keys) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys, f.challenges, f.requests = keys, 0, nil
}

// TestKubeconfigWithTheMasterSecret runs berth kubeconfig against a joinservice that attests with a
// simulated TPM whose lock register holds a control plane's value for the cluster of keys.
func TestKubeconfigWithTheMasterSecret(t *testing.T) {
	sim, caPEM := simulatedTPM(t)
	dir := t.TempDir()
	right, keys := newMasterSecret(t, dir, "master-secret.json", 1)
	wrong, wrongKeys := newMasterSecret(t, dir, "other-master-secret.json", 2)
	// The control plane's lock register: what nodelock.ForRole extends on a control plane.
	if err := vtpm.NewLockRegister(sim.Open, vtpm.DefaultLockPCR).MarkBootstrapped(t.Context(), nodelock.ControlPlaneLockID(keys.ClusterID())); err != nil {
		t.Fatal(err)
	}
	lock := hex.EncodeToString(vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(keys.ClusterID())))
	policyPath := writePolicy(t, dir, "join-policy.yaml", "  15: {expected: "+lock+"}\n", caPEM)
	fake := newFakeAdminService(t, keys)
	creds, err := atls.NewCredentials(vtpm.NewIssuer(sim.Open, zap.NewNop()), nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(creds))
	joinproto.RegisterJoinServiceServer(srv, fake)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	addr := lis.Addr().String()
	kubeconfig := func(secret, out string, extra ...string) (int, string) {
		return run(append([]string{"kubeconfig", "--endpoint", addr, "--master-secret", secret, "--policy", policyPath, "--out", out}, extra...)...)
	}

	t.Run("the right master secret gets a working kubeconfig", func(t *testing.T) {
		fake.reset(keys)
		out := filepath.Join(dir, "admin.conf")
		code, output := kubeconfig(right, out, "--validity", "2h")
		if code != 0 || !strings.Contains(output, "Wrote "+out+": berth-admin in") {
			t.Fatalf("exit %d\n%s", code, output)
		}
		if found := secretsIn(output, keys); len(found) > 0 {
			t.Fatalf("the output shows the %v", found)
		}
		st, err := os.Stat(out)
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("kubeconfig %v, mode %v; want 0600", err, st.Mode())
		}
		cfg, err := clientcmd.BuildConfigFromFlags("", out)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Host != "https://198.51.100.1:6443" || string(cfg.CAData) != string(fake.caPEM) {
			t.Errorf("kubeconfig server %s, CA %q", cfg.Host, cfg.CAData)
		}
		b, _ := pem.Decode(cfg.CertData)
		cert, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		kb, _ := pem.Decode(cfg.KeyData)
		key, err := x509.ParseECPrivateKey(kb.Bytes)
		if err != nil || !key.PublicKey.Equal(cert.PublicKey) {
			t.Fatalf("the kubeconfig's key is not the certificate's: %v", err)
		}
		_, reqs := fake.calls()
		if len(reqs) != 1 || reqs[0].GetValiditySeconds() != 7200 {
			t.Fatalf("the joinservice got %d requests, want 1 for 7200 s", len(reqs))
		}
		// Nothing secret crossed the wire: no private key, no master secret, in any request field.
		for _, field := range [][]byte{reqs[0].GetNonce(), reqs[0].GetPublicKey(), reqs[0].GetProof()} {
			if strings.Contains(string(field), string(keys.MasterSecret())) || strings.Contains(string(field), string(kb.Bytes)) {
				t.Fatal("the request carries the master secret or the private key")
			}
		}
	})

	t.Run("an existing kubeconfig is kept without --force", func(t *testing.T) {
		fake.reset(keys)
		out := filepath.Join(dir, "kept.conf")
		if err := os.WriteFile(out, []byte("old"), 0o644); err != nil {
			t.Fatal(err)
		}
		code, output := kubeconfig(right, out)
		if code != exitUsage || !strings.Contains(output, ErrKubeconfigExists.Error()) {
			t.Fatalf("exit %d\n%s", code, output)
		}
		if b, _ := os.ReadFile(out); string(b) != "old" {
			t.Fatal("the existing kubeconfig was changed")
		}
		if ch, _ := fake.calls(); ch != 0 {
			t.Fatalf("the joinservice was asked %d times for a kubeconfig that cannot be written", ch)
		}
		if code, output := kubeconfig(right, out, "--force"); code != 0 {
			t.Fatalf("--force: exit %d\n%s", code, output)
		}
		if st, err := os.Stat(out); err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("the replaced kubeconfig: %v, mode %v; want 0600", err, st.Mode())
		}
		if _, err := clientcmd.LoadFromFile(out); err != nil {
			t.Fatalf("the replaced kubeconfig: %v", err)
		}
	})

	t.Run("a wrong master secret is refused before anything is sent", func(t *testing.T) {
		fake.reset(keys)
		out := filepath.Join(dir, "wrong.conf")
		code, output := kubeconfig(wrong, out)
		if code != exitRejected || !strings.Contains(output, "the master secret does not match this cluster") || !strings.Contains(output, "nothing was sent") {
			t.Fatalf("exit %d\n%s", code, output)
		}
		if _, reqs := fake.calls(); len(reqs) != 0 {
			t.Fatalf("the joinservice got %d requests", len(reqs))
		}
		if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a kubeconfig was written: %v", err)
		}
		if found := secretsIn(output, wrongKeys); len(found) > 0 {
			t.Fatalf("the output shows the %v", found)
		}
	})

	t.Run("a joinservice that refuses the proof", func(t *testing.T) {
		fake.reset(wrongKeys)
		out := filepath.Join(dir, "refused.conf")
		code, output := kubeconfig(right, out)
		if code != exitRejected || !strings.Contains(output, "the joinservice refused the proof: the master secret does not match this cluster") {
			t.Fatalf("exit %d\n%s", code, output)
		}
		if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a kubeconfig was written: %v", err)
		}
	})

	t.Run("a joinservice outside the policy", func(t *testing.T) {
		fake.reset(keys)
		strict := writePolicy(t, dir, "strict.yaml", "  0: {expected: "+strings.Repeat("ab", 32)+"}\n", caPEM)
		code, output := run("kubeconfig", "--endpoint", addr, "--master-secret", right, "--policy", strict, "--out", filepath.Join(dir, "strict.conf"))
		if code != exitRejected || !strings.Contains(output, "failed attestation") {
			t.Fatalf("exit %d\n%s", code, output)
		}
		if ch, reqs := fake.calls(); ch != 0 || len(reqs) != 0 {
			t.Fatalf("a joinservice outside the policy was asked %d times", ch+len(reqs))
		}
	})
}

func TestKubeconfigUsage(t *testing.T) {
	dir := t.TempDir()
	secret, _ := newMasterSecret(t, dir, "master-secret.json", 1)
	policyPath := filepath.Join(dir, "policy.yaml") // never read: every case fails before
	for name, args := range map[string][]string{
		"no endpoint":             {"kubeconfig", "--master-secret", secret, "--policy", policyPath},
		"validity under 1m":       {"kubeconfig", "--endpoint", "127.0.0.1:1", "--master-secret", secret, "--policy", policyPath, "--validity", "59s"},
		"validity over a week":    {"kubeconfig", "--endpoint", "127.0.0.1:1", "--master-secret", secret, "--policy", policyPath, "--validity", "169h"},
		"negative validity":       {"kubeconfig", "--endpoint", "127.0.0.1:1", "--master-secret", secret, "--policy", policyPath, "--validity", "-1h"},
		"missing master secret":   {"kubeconfig", "--endpoint", "127.0.0.1:1", "--master-secret", filepath.Join(dir, "none.json"), "--policy", policyPath, "--out", filepath.Join(dir, "a")},
		"missing policy":          {"kubeconfig", "--endpoint", "127.0.0.1:1", "--master-secret", secret, "--policy", policyPath, "--out", filepath.Join(dir, "b")},
		"workspace without files": {"kubeconfig", "--endpoint", "127.0.0.1:1", "--workspace", t.TempDir()},
		"bad endpoint":            {"kubeconfig", "--endpoint", "[::1", "--master-secret", secret, "--policy", policyPath},
	} {
		if code, out := run(args...); code != exitUsage {
			t.Errorf("%s: exit %d, want %d\n%s", name, code, exitUsage, out)
		}
	}
	for _, d := range []time.Duration{joinproto.MinAdminValidity, defaultAdminValidity, joinproto.MaxAdminValidity} {
		if err := checkAdminValidity(d); err != nil {
			t.Errorf("validity %s: %v", d, err)
		}
	}
	code, out := run("kubeconfig", "--help")
	for _, want := range []string{"master secret", "kubeadm:cluster-admins", "0600", "--force", "--validity", "1m0s to 168h0m0s", "Neither the master secret nor the private key leaves"} {
		if !strings.Contains(out, want) {
			t.Errorf("kubeconfig --help lacks %q", want)
		}
	}
	if code != 0 {
		t.Errorf("kubeconfig --help: exit %d", code)
	}
}
