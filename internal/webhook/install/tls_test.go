package install

import (
	"bytes"
	"context"
	"crypto/x509"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/pemcerts"
)

func certsOf(t *testing.T, b []byte) []*x509.Certificate {
	t.Helper()
	c, err := pemcerts.Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func leafIssuedBy(t *testing.T, m tlsMaterial, ca []byte) bool {
	t.Helper()
	cas := certsOf(t, ca)
	return leafValid(m.certPEM, m.keyPEM, cas[0], time.Now())
}

// TestPlanTLSRotatesTheCAInSteps walks a CA rotation the way successive installer steps see it:
// the new CA joins the bundle while the old leaf keeps serving; then the leaf switches; only then
// is the old CA dropped (by finishCARotation); a re-run changes nothing.
func TestPlanTLSRotatesTheCAInSteps(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	renew := leafLifetime + 90*24*time.Hour

	fresh, err := planTLS(tlsMaterial{}, now, renew, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if fresh.rotating() || len(certsOf(t, fresh.bundlePEM)) != 1 || !leafIssuedBy(t, fresh, fresh.caPEM) {
		t.Fatalf("fresh material: rotating=%v, bundle of %d", fresh.rotating(), len(certsOf(t, fresh.bundlePEM)))
	}
	again, err := planTLS(fresh, now, renew, quiet)
	if err != nil || string(again.certPEM) != string(fresh.certPEM) || string(again.caPEM) != string(fresh.caPEM) || string(again.bundlePEM) != string(fresh.bundlePEM) {
		t.Fatalf("a re-run regenerated material: %v", err)
	}

	// Step 1: the CA is due (a renew window longer than its life makes it so today).
	step1, err := planTLS(fresh, now, caLifetime+time.Hour, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if string(step1.certPEM) != string(fresh.certPEM) {
		t.Error("step 1 replaced the leaf together with the CA")
	}
	if string(step1.caPEM) == string(fresh.caPEM) || !step1.rotating() {
		t.Fatal("step 1 did not start a rotation")
	}
	bundle := certsOf(t, step1.bundlePEM)
	if len(bundle) != 2 || !bundle[0].Equal(certsOf(t, fresh.caPEM)[0]) || !bundle[1].Equal(certsOf(t, step1.caPEM)[0]) {
		t.Fatalf("step 1 bundle = %d certificates, want old CA then new CA", len(bundle))
	}

	// Step 3: with the bundle published, the leaf switches to the new CA; the bundle keeps both.
	// No second rotation starts while one is under way, even if the new CA counted as due.
	step3, err := planTLS(step1, now, caLifetime+time.Hour, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if string(step3.caPEM) != string(step1.caPEM) || !leafIssuedBy(t, step3, step3.caPEM) || leafIssuedBy(t, step3, fresh.caPEM) {
		t.Fatal("step 3 did not issue the leaf from the new CA")
	}
	if len(certsOf(t, step3.bundlePEM)) != 2 {
		t.Fatal("step 3 dropped a CA from the bundle before every endpoint serves the new leaf")
	}

	// Step 4 (finishCARotation) sets the bundle to the new CA; a re-plan keeps it so.
	step3.bundlePEM = step3.caPEM
	done, err := planTLS(step3, now, renew, quiet)
	if err != nil || done.rotating() || string(done.certPEM) != string(step3.certPEM) {
		t.Fatalf("after the rotation: rotating=%v, leaf changed=%v, %v", done.rotating(), string(done.certPEM) != string(step3.certPEM), err)
	}
}

// TestPlanTLSDropsExpiredBundleEntries: an expired CA left in the bundle is not published again.
func TestPlanTLSDropsExpiredBundleEntries(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	old, err := planTLS(tlsMaterial{}, now.Add(-caLifetime-time.Hour), leafLifetime, quiet)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := planTLS(tlsMaterial{}, now, leafLifetime, quiet)
	if err != nil {
		t.Fatal(err)
	}
	cur.bundlePEM = append(append([]byte{}, old.caPEM...), cur.caPEM...)
	next, err := planTLS(cur, now, leafLifetime, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if next.rotating() || len(certsOf(t, next.bundlePEM)) != 1 {
		t.Fatalf("bundle keeps %d certificates, want only the current CA", len(certsOf(t, next.bundlePEM)))
	}
}

// TestTLSSecretReuse is the certificate reuse and rotation rule: a valid Secret is reused byte for
// byte, a leaf past 2/3 of its life is renewed from the same CA, and an unusable CA is replaced.
func TestTLSSecretReuse(t *testing.T) {
	now := time.Date(2026, 11, 21, 0, 0, 0, 0, time.UTC)
	first, ca1, err := installer(t, now).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	existing := secretFrom(first)

	again, ca2, err := installer(t, now.Add(24*time.Hour), existing).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ca1, ca2) || !contains(first.Object, again.Object) {
		t.Fatal("a valid Secret was not reused as is")
	}

	renewed, ca3, err := installer(t, now.Add(250*24*time.Hour), existing).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ca1, ca3) {
		t.Fatal("renewing the leaf replaced the CA")
	}
	if secretFrom(renewed).Data["tls.crt"] == nil || bytes.Equal(secretFrom(renewed).Data["tls.crt"], existing.Data["tls.crt"]) {
		t.Fatal("a leaf past 2/3 of its life was not renewed")
	}

	broken := existing.DeepCopy()
	broken.Data["ca.key"] = []byte("garbage")
	_, ca4, err := installer(t, now, broken).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(ca1, ca4) {
		t.Fatal("a CA without a usable key was kept")
	}
}
