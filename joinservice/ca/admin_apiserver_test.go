package ca_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/ca/catest"
)

// adminClient signs an admin certificate valid for validity with authority and returns a client
// that authenticates with it (and its key) to env's API server, and the certificate's end.
func adminClient(t *testing.T, env *apiservertest.Env, authority *ca.Authority, validity time.Duration) (kubernetes.Interface, time.Time) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	pub, _ := x509.MarshalPKIXPublicKey(key.Public())
	certPEM, _, err := authority.SignAdminClient(pub, validity)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(certPEM)
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	cfg := env.Config(apiservertest.AdminUser)
	cfg = &rest.Config{Host: cfg.Host, TLSClientConfig: rest.TLSClientConfig{CAData: cfg.CAData, CertData: certPEM,
		KeyData: pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})}, Timeout: 30 * time.Second}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c, cert.NotAfter
}

// TestAdminCertificateAuthenticatesAsAdmin: against a real kube-apiserver that trusts the cluster CA
// for clients and binds kubeadm:cluster-admins to cluster-admin (as kubeadm init does), an admin
// certificate reads Secrets in kube-system; one of another CA is refused; one whose validity ended
// is refused from then on.
func TestAdminCertificateAuthenticatesAsAdmin(t *testing.T) {
	apiservertest.Require(t)
	certPEM, keyPEM := catest.PEM(t)
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	env := apiservertest.Start(t, apiservertest.APIServerArgs("--client-ca-file="+caFile))
	ctx := context.Background()
	_, err := env.Client(t, apiservertest.AdminUser).RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: ca.AdminGroup},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "cluster-admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: ca.AdminGroup}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	authority, err := ca.New(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	admin, _ := adminClient(t, env, authority, time.Hour)
	if _, err := admin.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatalf("an admin certificate cannot list Secrets in kube-system: %v", err)
	}

	otherCert, otherKey := catest.PEM(t)
	other, err := ca.New(otherCert, otherKey)
	if err != nil {
		t.Fatal(err)
	}
	foreign, _ := adminClient(t, env, other, time.Hour)
	if _, err := foreign.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); !apierrors.IsUnauthorized(err) {
		t.Fatalf("a certificate of another CA: %v, want 401 Unauthorized", err)
	}

	// A short validity: works at first, then the API server says 401, polled for (no fixed sleep).
	const validity = 3 * time.Second
	start := time.Now()
	short, notAfter := adminClient(t, env, authority, validity)
	if _, err := short.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatalf("a fresh short-lived admin certificate: %v", err)
	}
	var last error
	if err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, validity+time.Minute, true, func(ctx context.Context) (bool, error) {
		_, last = short.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{})
		return apierrors.IsUnauthorized(last), nil
	}); err != nil {
		t.Fatalf("the expired certificate is still accepted: %v (last answer %v)", err, last)
	}
	// X.509 times have whole seconds: the certificate ends at most a second before start+validity.
	if now := time.Now(); now.Before(notAfter) {
		t.Fatalf("refused at %s, before the certificate's end %s", now.UTC().Format(time.RFC3339Nano), notAfter.UTC().Format(time.RFC3339))
	}
	t.Logf("a certificate valid for %s was refused %s after it was issued", validity, time.Since(start).Round(time.Millisecond))
}
