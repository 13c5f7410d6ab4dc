package install

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"

	"github.com/berth-k8s/berth/internal/pemcerts"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// Certificates: the webhook's own CA and serving certificate, kept in Secret berth-webhook-tls,
// renewed and rotated without a moment in which a served certificate is not in the published bundle.

func serviceDNSNames() []string {
	return []string{webhookconfig.Name, webhookconfig.Name + "." + namespace, webhookconfig.Name + "." + namespace + ".svc", webhookconfig.Name + "." + namespace + ".svc.cluster.local"}
}

func serverName() string { return webhookconfig.Name + "." + namespace + ".svc" }

// tlsMaterial is what Secret berth-webhook-tls holds: the current CA (it signs the leaf), the
// serving keypair, and the CA bundle the webhook configuration publishes. The bundle is the CA alone,
// except during a CA rotation, when it also holds the previous CA.
type tlsMaterial struct {
	caPEM, caKeyPEM, certPEM, keyPEM, bundlePEM []byte
	// resourceVersion is the Secret's when the material was read from it.
	resourceVersion string
}

func (m tlsMaterial) data() map[string][]byte {
	return map[string][]byte{"ca.crt": m.caPEM, "ca.key": m.caKeyPEM, "tls.crt": m.certPEM, "tls.key": m.keyPEM, "ca-bundle.crt": m.bundlePEM}
}

func (m tlsMaterial) equal(o tlsMaterial) bool {
	for k, v := range m.data() {
		if !bytes.Equal(v, o.data()[k]) {
			return false
		}
	}
	return true
}

func (m tlsMaterial) secret() *unstructured.Unstructured {
	return typed(corev1ac.Secret(webhookconfig.TLSSecret, namespace).
		WithType(corev1.SecretTypeOpaque).
		WithLabels(ownLabels()).
		WithData(map[string][]byte{
			"ca.crt": m.caPEM, "ca.key": m.caKeyPEM, "tls.crt": m.certPEM, "tls.key": m.keyPEM,
			"ca-bundle.crt": m.bundlePEM,
		}))
}

// rotating reports whether the bundle still holds a CA besides the current one.
func (m tlsMaterial) rotating() bool {
	cas, err1 := pemcerts.Parse(m.caPEM)
	bundle, err2 := pemcerts.Parse(m.bundlePEM)
	if err1 != nil || err2 != nil {
		return false
	}
	return slices.ContainsFunc(bundle, func(c *x509.Certificate) bool { return !c.Equal(cas[0]) })
}

func (w *Installer) readTLS(ctx context.Context) (tlsMaterial, error) {
	existing, err := w.kube.CoreV1().Secrets(namespace).Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return tlsMaterial{}, nil
	}
	if err != nil {
		return tlsMaterial{}, failure(ErrApply, "check the API server and retry", "reading Secret %s: %v", webhookconfig.TLSSecret, err)
	}
	d := existing.Data
	return tlsMaterial{caPEM: d["ca.crt"], caKeyPEM: d["ca.key"], certPEM: d["tls.crt"], keyPEM: d["tls.key"], bundlePEM: d["ca-bundle.crt"],
		resourceVersion: existing.ResourceVersion}, nil
}

// tlsSecret returns the TLS Secret to apply and the CA bundle to publish.
func (w *Installer) tlsSecret(ctx context.Context) (*unstructured.Unstructured, []byte, error) {
	cur, err := w.readTLS(ctx)
	if err != nil {
		return nil, nil, err
	}
	armed, err := w.bundleHolds(ctx, cur.caPEM)
	if err != nil {
		return nil, nil, err
	}
	next, err := planTLS(cur, w.cfg.Now(), w.cfg.Lifetimes, armed, true, w.say)
	if err != nil {
		return nil, nil, failure(ErrApply, "retry", "%v", err)
	}
	return next.secret(), next.bundlePEM, nil
}

// planTLS decides this run's TLS material from the Secret's. A re-run never regenerates
// what is still good. The CA and the leaf are never replaced in one step:
//   - no usable CA: a new CA and leaf, the bundle is the new CA (nothing depends on the old one);
//   - the CA is due (less than l.CARenewBefore left, or valid for longer than l.CA allows) and no
//     rotation is under way: a new CA joins the bundle next to the old one, and the leaf stays; it
//     is switched on a later step, once the bundle is published;
//   - the leaf is missing, due (less than l.LeafRenewBefore left, or valid for longer than l.Leaf
//     allows) or not signed by the current CA: a new leaf from the current CA. The bundle still
//     holds every CA that can have signed a served leaf.
//
// armed says that the configuration publishes the Secret's current CA: only then may a rotation's
// new CA issue the leaf. Until then a leaf that an older CA of the bundle verifies stays, due or not.
// mayRotate says that this plan may change which CA the API servers must trust (the keeper holds the
// control-plane slot, see Keeper.WithRotationLock): without it a due CA waits for a later plan, and
// during a rotation the old CA's leaf keeps serving while it is usable, as if the new CA were not
// published. Certificates in the bundle that have expired are dropped. l may leave periods at zero
// (defaults).
func planTLS(cur tlsMaterial, now time.Time, l Lifetimes, armed, mayRotate bool, say func(string, ...any)) (tlsMaterial, error) {
	l = l.WithDefaults()
	if err := l.Validate(); err != nil {
		return tlsMaterial{}, err
	}
	next := cur
	ca, caKey, caOK := parseCA(cur.caPEM, cur.caKeyPEM, now)
	var bundle []*x509.Certificate
	if certs, err := pemcerts.Parse(cur.bundlePEM); err == nil {
		for _, c := range certs {
			if now.Before(c.NotAfter) {
				bundle = append(bundle, c)
			}
		}
	}
	// While the bundle still holds an older CA, the rotation under way is finished before another
	// can start: the new CA's leaf must be published against a bundle that holds it.
	inRotation := caOK && slices.ContainsFunc(bundle, func(c *x509.Certificate) bool { return !c.Equal(ca) })
	switch {
	case !caOK:
		var err error
		if ca, caKey, next.caPEM, next.caKeyPEM, err = newCA(now, l.CA); err != nil {
			return tlsMaterial{}, fmt.Errorf("creating the webhook CA: %w", err)
		}
		next.certPEM, next.keyPEM = nil, nil
		bundle = nil
		say("created a new webhook CA")
	case mayRotate && !inRotation && due(ca.NotAfter, now, l.CA, l.CARenewBefore):
		old := ca
		var err error
		if ca, caKey, next.caPEM, next.caKeyPEM, err = newCA(now, l.CA); err != nil {
			return tlsMaterial{}, fmt.Errorf("creating the webhook CA: %w", err)
		}
		if !containsCert(bundle, old) {
			bundle = append(bundle, old)
		}
		say("CA rotation: a new CA joins the bundle; the old one (expires %s) stays until no endpoint serves a certificate it signed", old.NotAfter.UTC().Format(time.RFC3339))
		if leafUsable(cur.certPEM, cur.keyPEM, old, now) {
			// The leaf follows once the bundle with both CAs is in place (finishCARotation), even
			// when it is due itself: a leaf of the new CA must never be served before the bundle
			// that holds the new CA is published.
			next.bundlePEM = encodeBundle(append(bundle, ca))
			return next, nil
		}
	}
	if inRotation && (!armed || !mayRotate) && !leafUsable(cur.certPEM, cur.keyPEM, ca, now) &&
		slices.ContainsFunc(bundle, func(old *x509.Certificate) bool { return leafUsable(cur.certPEM, cur.keyPEM, old, now) }) {
		// A rotation whose new CA is not published yet (an interrupted run), or that may not
		// go on now: the leaf of the old CA keeps serving until it is and it may.
		if !containsCert(bundle, ca) {
			bundle = append(bundle, ca)
		}
		next.bundlePEM = encodeBundle(bundle)
		return next, nil
	}
	if !leafValid(next.certPEM, next.keyPEM, ca, now, l) {
		var err error
		if next.certPEM, next.keyPEM, err = newLeaf(ca, caKey, now, l.Leaf); err != nil {
			return tlsMaterial{}, fmt.Errorf("issuing the webhook serving certificate: %w", err)
		}
		say("issued a new webhook serving certificate")
	}
	if !containsCert(bundle, ca) {
		bundle = append(bundle, ca)
	}
	next.bundlePEM = encodeBundle(bundle)
	return next, nil
}

func containsCert(certs []*x509.Certificate, c *x509.Certificate) bool {
	return slices.ContainsFunc(certs, func(x *x509.Certificate) bool { return x.Equal(c) })
}

func encodeBundle(certs []*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}

// finishCARotation completes a CA rotation that the armed bundle now allows (the rotation's last two
// steps): it switches the leaf to the new CA, waits until every endpoint serves a leaf that the new
// CA alone verifies (the pods read the Secret's files), and only then drops the old CA from the
// bundle, checking enforcement end to end. Without a rotation under way, or for a keeper that does
// not hold the rotation lock, it does nothing.
func (w *Installer) finishCARotation(ctx context.Context) error {
	if !w.mayRotate() {
		return nil
	}
	cur, err := w.readTLS(ctx)
	if err != nil || !cur.rotating() {
		return err
	}
	// No leaf of the new CA is served before the configuration publishes it (a paused
	// configuration, for one, does not).
	if armed, err := w.bundleHolds(ctx, cur.caPEM); err != nil || !armed {
		return err
	}
	next, err := planTLS(cur, w.cfg.Now(), w.cfg.Lifetimes, true, true, w.say)
	if err != nil {
		return failure(ErrApply, "retry", "%v", err)
	}
	if next, err = w.writeTLS(ctx, cur, next); err != nil {
		return err
	}
	w.say("CA rotation: waiting for every endpoint to serve the certificate of the new CA")
	if _, err := w.waitServing(ctx, next.caPEM); err != nil {
		return err
	}
	switched := next
	switched.bundlePEM = next.caPEM
	if _, err := w.writeTLS(ctx, next, switched); err != nil {
		return err
	}
	if err := w.publish(ctx, switched.caPEM); err != nil {
		return err
	}
	w.rotationDone = true
	w.say("CA rotation done: the bundle holds only the new CA")
	return nil
}

// writeTLS writes next into the TLS Secret when it differs from cur (what was read) and returns next
// as written. The installer applies the whole Secret; the keeper updates it on cur's
// resourceVersion, so that of two keepers that both read cur only one writes.
func (w *Installer) writeTLS(ctx context.Context, cur, next tlsMaterial) (tlsMaterial, error) {
	if !w.keep {
		return next, w.ensure(ctx, next.secret())
	}
	if cur.equal(next) {
		return next, nil
	}
	secrets := w.kube.CoreV1().Secrets(namespace)
	live, err := secrets.Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	switch {
	case err != nil:
	case live.ResourceVersion != cur.resourceVersion:
		err = fmt.Errorf("resourceVersion %s, read as %s: changed by another writer", live.ResourceVersion, cur.resourceVersion)
	default:
		live.Data = next.data()
		live, err = secrets.Update(ctx, live, metav1.UpdateOptions{FieldManager: KeeperFieldManager})
	}
	if err != nil {
		return cur, failure(ErrApply, "retry; a conflict means another keeper wrote the Secret first", "writing Secret %s: %v", webhookconfig.TLSSecret, err)
	}
	next.resourceVersion = live.ResourceVersion
	w.result.Writes = append(w.result.Writes, "update Secret "+namespace+"/"+webhookconfig.TLSSecret)
	if !bytes.Equal(cur.certPEM, next.certPEM) {
		w.leafRenewed = true
	}
	if !bytes.Equal(cur.caPEM, next.caPEM) {
		w.caRenewed = true
	}
	return next, nil
}

func parseCA(certPEM, keyPEM []byte, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, bool) {
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, nil, false
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil || !ca.IsCA {
		return nil, nil, false
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil || !key.PublicKey.Equal(ca.PublicKey) {
		return nil, nil, false
	}
	if now.Before(ca.NotBefore) || !now.Before(ca.NotAfter) {
		return nil, nil, false
	}
	return ca, key, true
}

// leafValid: the leaf is usable (leafUsable) and not due (l: see due).
func leafValid(certPEM, keyPEM []byte, ca *x509.Certificate, now time.Time, l Lifetimes) bool {
	leaf := usableLeaf(certPEM, keyPEM, ca, now)
	if leaf == nil {
		return false
	}
	l = l.WithDefaults()
	return !due(leaf.NotAfter, now, l.Leaf, l.LeafRenewBefore)
}

// leafUsable: the pair matches and chains to ca for the service name at now.
func leafUsable(certPEM, keyPEM []byte, ca *x509.Certificate, now time.Time) bool {
	return usableLeaf(certPEM, keyPEM, ca, now) != nil
}

func usableLeaf(certPEM, keyPEM []byte, ca *x509.Certificate, now time.Time) *x509.Certificate {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: serverName(), CurrentTime: now}); err != nil {
		return nil
	}
	return leaf
}

func serial() (*big.Int, error) { return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127)) }

func newCA(now time.Time, validity time.Duration) (*x509.Certificate, *ecdsa.PrivateKey, []byte, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn, Subject: pkix.Name{CommonName: "berth-webhook-ca"},
		NotBefore: now.Add(-backdate(validity)), NotAfter: now.Add(validity),
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	return ca, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}

func newLeaf(ca *x509.Certificate, caKey *ecdsa.PrivateKey, now time.Time, validity time.Duration) ([]byte, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn, Subject: pkix.Name{CommonName: serverName()},
		NotBefore: now.Add(-backdate(validity)), NotAfter: now.Add(validity),
		DNSNames: serviceDNSNames(), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}
