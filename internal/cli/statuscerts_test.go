package cli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

func pemCert(t *testing.T, notAfter time.Time) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "c"}, NotBefore: notAfter.Add(-time.Hour), NotAfter: notAfter}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// TestStatusCertificates: berth status shows the earliest expiry of the webhook's chain (from its
// Secret) and of every control plane (from its Node), and who renews each: the node holding the
// certificate keeper's Lease, and each control plane itself.
func TestStatusCertificates(t *testing.T) {
	now := time.Now().Truncate(time.Second).UTC()
	leaf, ca, oldCA := now.Add(200*24*time.Hour), now.Add(9*365*24*time.Hour), now.Add(30*time.Hour)
	holder := "cp2_x7k2p9q1"
	renewed := metav1.NewMicroTime(now)
	cpNode := func(name string, expiry time.Time, ready corev1.ConditionStatus) *corev1.Node {
		return &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"node-role.kubernetes.io/control-plane": ""},
				Annotations: map[string]string{joinconfig.NodeCertExpiryAnnotation: expiry.Format(time.RFC3339), joinconfig.NodeCertsRenewedAnnotation: now.Add(-time.Hour).Format(time.RFC3339)}},
			Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: ready}}},
		}
	}
	client := fake.NewClientset(
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.TLSSecret, Namespace: joinconfig.Namespace}, Data: map[string][]byte{
			"tls.crt": pemCert(t, leaf), "ca.crt": pemCert(t, ca), "ca-bundle.crt": append(pemCert(t, oldCA), pemCert(t, ca)...), "ca.key": []byte("secret"),
		}},
		&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.CertKeeperLease, Namespace: joinconfig.Namespace},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder, RenewTime: &renewed}},
		cpNode("cp2", now.Add(300*24*time.Hour), corev1.ConditionTrue),
		cpNode("cp1", now.Add(100*24*time.Hour), corev1.ConditionUnknown),
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w1"}},
	)
	var out bytes.Buffer
	printCertificates(&out, readCertificates(context.Background(), client, joinconfig.Namespace), now)
	s := out.String()
	t.Log("\n" + s)
	for _, want := range []string{
		"Earliest expiry: " + oldCA.Format(time.RFC3339) + " (in 30h0m0s)",
		"webhook serving certificate", "certificate keeper on cp2 (renews at 2/3 of its life)", "a CA rotation is under way",
		"control plane cp1", "100d", "the node is not ready", "control plane cp2", "itself (bootstrapper, or berth-cert-renew.timer on the image)",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("status lacks %q", want)
		}
	}
	if strings.Contains(s, "w1") || strings.Contains(s, "secret") {
		t.Error("status shows a worker or the CA key")
	}

	out.Reset()
	if err := runStatus(context.Background(), &out, client, joinconfig.Namespace, 0, outputText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Certificates\n") {
		t.Errorf("berth status does not print the certificates section:\n%s", out.String())
	}
	out.Reset()
	if err := runStatus(context.Background(), &out, client, joinconfig.Namespace, 0, outputJSON); err != nil {
		t.Fatal(err)
	}
	var r statusReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	c := r.Certificates
	if c.Earliest == nil || !c.Earliest.Equal(oldCA) || c.Webhook == nil || !c.Webhook.ServingExpiry.Equal(leaf) || !c.Webhook.CAExpiry.Equal(ca) ||
		!c.Webhook.BundleExpiry.Equal(oldCA) || !c.Webhook.RotationUnderWay || c.Webhook.RenewedBy != "cp2" || len(c.ControlPlanes) != 2 ||
		c.ControlPlanes[0].Node != "cp1" || c.ControlPlanes[0].Ready || !c.ControlPlanes[1].Ready {
		t.Fatalf("certificates section: %+v", c)
	}

	// Without the webhook, no leader, and a Node whose renewer never ran.
	client = fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cp1", Labels: map[string]string{"node-role.kubernetes.io/control-plane": ""}}})
	out.Reset()
	if err := runStatus(context.Background(), &out, client, joinconfig.Namespace, 0, outputText); err != nil {
		t.Fatal(err)
	}
	if s := out.String(); !strings.Contains(s, "unknown (no renewal check recorded yet)") || strings.Contains(s, "webhook") {
		t.Fatalf("status without webhook:\n%s", s)
	}
}
