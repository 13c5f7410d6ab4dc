package certkeeper

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	authorizationv1 "k8s.io/api/authorization/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/metadata"
)

// recordNamespace holds the machine record of the approver's tests.
const recordNamespace = "berth-system"

type peers struct {
	list []metadata.Instance
	err  error
}

func (p peers) Peers(context.Context) ([]metadata.Instance, error) { return p.list, p.err }

type csrSpec struct {
	cn, org    string
	dns        []string
	ips        []string
	email, uri bool
}

func csrPEM(t *testing.T, s csrSpec) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.CertificateRequest{Subject: pkix.Name{CommonName: s.cn, Organization: []string{s.org}}, DNSNames: s.dns}
	for _, ip := range s.ips {
		tmpl.IPAddresses = append(tmpl.IPAddresses, net.ParseIP(ip))
	}
	if s.email {
		tmpl.EmailAddresses = []string{"kubelet@example.test"}
	}
	if s.uri {
		tmpl.URIs = []*url.URL{{Scheme: "spiffe", Host: "example.test"}}
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

func servingCSR(name, user string, groups []string, request []byte, usages ...certificatesv1.KeyUsage) *certificatesv1.CertificateSigningRequest {
	if usages == nil {
		usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageKeyEncipherment, certificatesv1.UsageServerAuth}
	}
	return &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			SignerName: certificatesv1.KubeletServingSignerName, Username: user, Groups: groups, Request: request, Usages: usages,
		},
	}
}

// TestApproverDecides: a kubelet serving request that names the requesting node and its platform
// addresses is approved; every way of naming something else is denied with its reason; a request
// that cannot be checked yet stays pending; other signers and decided requests are left alone.
func TestApproverDecides(t *testing.T) {
	nodeGroups := []string{"system:nodes", "system:authenticated"}
	good := csrSpec{cn: "system:node:w1", org: "system:nodes", dns: []string{"w1"}, ips: []string{"198.51.100.12"}}
	withSpec := func(f func(*csrSpec)) csrSpec { s := good; f(&s); return s }
	cases := []struct {
		name   string
		user   string
		groups []string
		spec   csrSpec
		usages []certificatesv1.KeyUsage
		peers  peers
		noNode bool
		// revoked lists w1 as removed in the machine record (which otherwise lists w1 admitted).
		revoked bool
		want    certificatesv1.RequestConditionType // "" = still pending
		reason  string
	}{
		{name: "the node itself", user: "system:node:w1", groups: nodeGroups, spec: good, want: certificatesv1.CertificateApproved, reason: reasonApproved},
		{name: "another node's name", user: "system:node:w2", groups: nodeGroups, spec: good, want: certificatesv1.CertificateDenied, reason: ReasonSubject},
		{name: "a user, not a node", user: "mallory", groups: []string{"system:authenticated"}, spec: good, want: certificatesv1.CertificateDenied, reason: ReasonNotANode},
		{name: "node name without the nodes group", user: "system:node:w1", groups: []string{"system:authenticated"}, spec: good, want: certificatesv1.CertificateDenied, reason: ReasonNotANode},
		{name: "another node's address", user: "system:node:w1", groups: nodeGroups,
			spec: withSpec(func(s *csrSpec) { s.ips = []string{"198.51.100.12", "198.51.100.11"} }), want: certificatesv1.CertificateDenied, reason: ReasonAddresses},
		{name: "a foreign DNS name", user: "system:node:w1", groups: nodeGroups,
			spec: withSpec(func(s *csrSpec) { s.dns = []string{"w1", "kubernetes.default.svc"} }), want: certificatesv1.CertificateDenied, reason: ReasonNames},
		{name: "an e-mail address", user: "system:node:w1", groups: nodeGroups, spec: withSpec(func(s *csrSpec) { s.email = true }), want: certificatesv1.CertificateDenied, reason: ReasonNames},
		{name: "a URI", user: "system:node:w1", groups: nodeGroups, spec: withSpec(func(s *csrSpec) { s.uri = true }), want: certificatesv1.CertificateDenied, reason: ReasonNames},
		{name: "a wrong organization", user: "system:node:w1", groups: nodeGroups, spec: withSpec(func(s *csrSpec) { s.org = "system:masters" }), want: certificatesv1.CertificateDenied, reason: ReasonSubject},
		{name: "client usage", user: "system:node:w1", groups: nodeGroups, spec: good,
			usages: []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth, certificatesv1.UsageClientAuth}, want: certificatesv1.CertificateDenied, reason: ReasonUsages},
		{name: "no server auth", user: "system:node:w1", groups: nodeGroups, spec: good,
			usages: []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature}, want: certificatesv1.CertificateDenied, reason: ReasonUsages},
		{name: "an instance the platform does not know", user: "system:node:w9", groups: nodeGroups,
			spec: withSpec(func(s *csrSpec) { s.cn, s.dns, s.ips = "system:node:w9", []string{"w9"}, nil }), want: certificatesv1.CertificateDenied, reason: ReasonUnknownNode},
		{name: "metadata unreachable", user: "system:node:w1", groups: nodeGroups, spec: good, peers: peers{err: errors.New("connection refused")}},
		{name: "no Node yet", user: "system:node:w1", groups: nodeGroups, spec: good, noNode: true},
		{name: "a removed node", user: "system:node:w1", groups: nodeGroups, spec: good, revoked: true, want: certificatesv1.CertificateDenied, reason: ReasonRevoked},
	}
	platform := peers{list: []metadata.Instance{
		{Name: "cp1", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}},
		{Name: "w1", Role: metadata.RoleWorker, IPs: []string{"198.51.100.12"}},
		{Name: "w2", Role: metadata.RoleWorker, IPs: []string{"198.51.100.11"}},
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			client := fake.NewClientset()
			if !c.noNode {
				for _, n := range []string{"w1", "w2", "w9"} {
					if _, err := client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
						t.Fatal(err)
					}
				}
			}
			if _, err := machines.Update(context.Background(), client, recordNamespace, func([]machines.Machine) ([]machines.Machine, error) {
				m := machines.Machine{Identity: "aa", Node: "w1", Role: machines.RoleWorker}
				if c.revoked {
					m.Removal = &machines.Removal{}
				}
				return []machines.Machine{m}, nil
			}); err != nil {
				t.Fatal(err)
			}
			csr := servingCSR("csr-1", c.user, c.groups, csrPEM(t, c.spec), c.usages...)
			if _, err := client.CertificatesV1().CertificateSigningRequests().Create(context.Background(), csr, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			meta := platform
			if c.peers.err != nil {
				meta = c.peers
			}
			m := NewMetrics(prometheus.NewRegistry(), nil)
			NewApprover(zap.NewNop(), client, meta, m).WithRevocations(recordNamespace).Decide(context.Background(), csr)
			got, err := client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), "csr-1", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if c.want == "" {
				if len(got.Status.Conditions) != 0 {
					t.Fatalf("conditions %+v, want the request still pending", got.Status.Conditions)
				}
				return
			}
			if len(got.Status.Conditions) != 1 || got.Status.Conditions[0].Type != c.want || got.Status.Conditions[0].Reason != c.reason {
				t.Fatalf("conditions %+v, want %s with reason %s", got.Status.Conditions, c.want, c.reason)
			}
			decision := "approved"
			if c.want == certificatesv1.CertificateDenied {
				decision = "denied"
			}
			if v := testutil.ToFloat64(m.csr.WithLabelValues(decision, c.reason)); v != 1 {
				t.Errorf("berth_certkeeper_csr_decisions_total{decision=%q,reason=%q} = %v, want 1", decision, c.reason, v)
			}
		})
	}
}

// TestApproverLeavesOthersAlone: a request for another signer, and one already decided, get no
// decision from the approver.
func TestApproverLeavesOthersAlone(t *testing.T) {
	request := csrPEM(t, csrSpec{cn: "system:node:w1", org: "system:nodes", dns: []string{"w1"}})
	client := fake.NewClientset()
	a := NewApprover(zap.NewNop(), client, peers{list: []metadata.Instance{{Name: "w1", IPs: []string{"198.51.100.12"}}}}, NewMetrics(prometheus.NewRegistry(), nil))
	other := servingCSR("client", "system:node:w1", []string{"system:nodes"}, request)
	other.Spec.SignerName = certificatesv1.KubeAPIServerClientKubeletSignerName
	decided := servingCSR("decided", "system:node:w1", []string{"system:nodes"}, request)
	decided.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue, Reason: "ByHand"}}
	for _, csr := range []*certificatesv1.CertificateSigningRequest{other, decided} {
		if _, err := client.CertificatesV1().CertificateSigningRequests().Create(context.Background(), csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		a.Decide(context.Background(), csr)
		got, err := client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), csr.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Status.Conditions) != len(csr.Status.Conditions) {
			t.Errorf("%s: conditions %+v, want them unchanged", csr.Name, got.Status.Conditions)
		}
	}
}

// TestApproverOnAPIServer: against a real API server, with the RBAC berth init installs, the
// approver running as the joinservice's ServiceAccount approves a serving request a node (the
// admin impersonating system:node:w1) makes for itself and denies one naming another node's
// address; the API server records the requester, not the node's claim.
func TestApproverOnAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := env.InstallBerth(ctx, ""); err != nil {
		t.Fatal(err)
	}
	admin := env.Client(t, apiservertest.AdminUser)
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w1"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	// Nodes may request certificates (kubeadm grants this too; the test API server authorizes by
	// RBAC only).
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "test:nodes-request-certificates"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "system:node-bootstrapper"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: "rbac.authorization.k8s.io", Name: "system:nodes"}},
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	nodeCfg := env.Config(apiservertest.AdminUser)
	nodeCfg.Impersonate = rest.ImpersonationConfig{UserName: "system:node:w1", Groups: []string{"system:nodes", "system:authenticated"}}
	node, err := kubernetes.NewForConfig(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	// The binding takes effect once the API server's RBAC authorizer has it (an informer).
	if err := apiservertest.WaitAllowed(ctx, node, authorizationv1.ResourceAttributes{Verb: "create", Group: "certificates.k8s.io", Resource: "certificatesigningrequests"}); err != nil {
		t.Fatal(err)
	}
	good := csrSpec{cn: "system:node:w1", org: "system:nodes", dns: []string{"w1"}, ips: []string{"198.51.100.12"}}
	bad := good
	bad.ips = []string{"198.51.100.11"}
	t.Cleanup(func() { // for the next run (-count) on the shared API server
		for _, name := range []string{"w1-good", "w1-bad"} {
			if err := admin.CertificatesV1().CertificateSigningRequests().Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("deleting %s: %v", name, err)
			}
		}
	})
	for name, spec := range map[string]csrSpec{"w1-good": good, "w1-bad": bad} {
		csr := servingCSR(name, "", nil, csrPEM(t, spec))
		if _, err := node.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	a := NewApprover(zaptest.NewLogger(t), env.Client(t, apiservertest.JoinServiceUser), peers{list: []metadata.Instance{
		{Name: "w1", IPs: []string{"198.51.100.12"}}, {Name: "w2", IPs: []string{"198.51.100.11"}},
	}}, NewMetrics(prometheus.NewRegistry(), nil))
	actx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(actx) }()
	defer func() { stop(); <-done }()
	want := map[string]certificatesv1.RequestConditionType{"w1-good": certificatesv1.CertificateApproved, "w1-bad": certificatesv1.CertificateDenied}
	for name, kind := range want {
		var got *certificatesv1.CertificateSigningRequest
		if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			got, err = admin.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
			return err == nil && len(got.Status.Conditions) > 0, nil
		}); err != nil {
			t.Fatalf("%s: no decision", name)
		}
		if got.Spec.Username != "system:node:w1" || got.Status.Conditions[0].Type != kind {
			t.Fatalf("%s: requester %s, conditions %+v, want %s", name, got.Spec.Username, got.Status.Conditions, kind)
		}
		t.Logf("%s: %s (%s: %s)", name, kind, got.Status.Conditions[0].Reason, got.Status.Conditions[0].Message)
	}
}
