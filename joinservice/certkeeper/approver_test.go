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

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/metadata"
)

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
		want   certificatesv1.RequestConditionType // "" = still pending
		reason string
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
			csr := servingCSR("csr-1", c.user, c.groups, csrPEM(t, c.spec), c.usages...)
			if _, err := client.CertificatesV1().CertificateSigningRequests().Create(context.Background(), csr, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			meta := platform
			if c.peers.err != nil {
				meta = c.peers
			}
			m := NewMetrics(prometheus.NewRegistry(), nil)
			NewApprover(zap.NewNop(), client, meta, m).Decide(context.Background(), csr)
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
