package install

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
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
	return leafUsable(m.certPEM, m.keyPEM, cas[0], time.Now())
}

// TestPlanTLSRotatesTheCAInSteps walks a CA rotation the way successive installer steps see it:
// the new CA joins the bundle while the old leaf keeps serving; then the leaf switches; only then
// is the old CA dropped (by finishCARotation); a re-run changes nothing.
func TestPlanTLSRotatesTheCAInSteps(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	renew := Lifetimes{}
	// A CA valid for a year with a rotation window of 200 days: a ten-year CA outlives it, and so
	// does the year's CA that replaces it until it is 200 days from its end.
	dueCA := Lifetimes{CA: 365 * 24 * time.Hour, Leaf: 90 * 24 * time.Hour, CARenewBefore: 200 * 24 * time.Hour}

	fresh, err := planTLS(tlsMaterial{}, now, renew, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if fresh.rotating() || len(certsOf(t, fresh.bundlePEM)) != 1 || !leafIssuedBy(t, fresh, fresh.caPEM) {
		t.Fatalf("fresh material: rotating=%v, bundle of %d", fresh.rotating(), len(certsOf(t, fresh.bundlePEM)))
	}
	again, err := planTLS(fresh, now, renew, true, true, quiet)
	if err != nil || string(again.certPEM) != string(fresh.certPEM) || string(again.caPEM) != string(fresh.caPEM) || string(again.bundlePEM) != string(fresh.bundlePEM) {
		t.Fatalf("a re-run regenerated material: %v", err)
	}

	// Step 1: the CA is due (it outlives the shorter validity).
	step1, err := planTLS(fresh, now, dueCA, true, true, quiet)
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
	step3, err := planTLS(step1, now, dueCA, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if string(step3.caPEM) != string(step1.caPEM) || !leafIssuedBy(t, step3, step3.caPEM) || string(step3.certPEM) == string(step1.certPEM) {
		t.Fatal("step 3 did not issue the leaf from the new CA")
	}
	if len(certsOf(t, step3.bundlePEM)) != 2 {
		t.Fatal("step 3 dropped a CA from the bundle before every endpoint serves the new leaf")
	}

	// Step 4 (finishCARotation) sets the bundle to the new CA; a re-plan keeps it so.
	step3.bundlePEM = step3.caPEM
	done, err := planTLS(step3, now, dueCA, true, true, quiet)
	if err != nil || done.rotating() || string(done.certPEM) != string(step3.certPEM) {
		t.Fatalf("after the rotation: rotating=%v, leaf changed=%v, %v", done.rotating(), string(done.certPEM) != string(step3.certPEM), err)
	}
}

// TestPlanTLSDropsExpiredBundleEntries: an expired CA left in the bundle is not published again.
func TestPlanTLSDropsExpiredBundleEntries(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	old, err := planTLS(tlsMaterial{}, now.Add(-DefaultCAValidity-time.Hour), Lifetimes{}, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := planTLS(tlsMaterial{}, now, Lifetimes{}, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	cur.bundlePEM = append(append([]byte{}, old.caPEM...), cur.caPEM...)
	next, err := planTLS(cur, now, Lifetimes{}, true, true, quiet)
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

// TestPlanTLSKeepsTheOldLeafUntilTheNewCAIsPublished: a rotation whose new CA is in the Secret but
// not yet in the configuration (a run interrupted between the two) keeps the old CA's leaf, even a
// due one; once the configuration publishes the new CA, the leaf switches.
func TestPlanTLSKeepsTheOldLeafUntilTheNewCAIsPublished(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	short := Lifetimes{Leaf: 40 * time.Minute, CA: 90 * time.Minute, CARenewBefore: time.Hour}
	fresh, err := planTLS(tlsMaterial{}, now, short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	// 31 minutes in, less than an hour is left of the CA: a rotation starts.
	started, err := planTLS(fresh, now.Add(31*time.Minute), short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !started.rotating() || string(started.certPEM) != string(fresh.certPEM) {
		t.Fatalf("the rotation did not start with the old leaf kept: rotating=%v", started.rotating())
	}
	// 32 minutes after the first leaf: it is due (less than a third of 40 minutes left), but the new
	// CA is not published yet: it stays.
	waiting, err := planTLS(started, now.Add(32*time.Minute), short, false, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !waiting.equal(started) {
		t.Fatal("the leaf changed before the new CA was published")
	}
	switched, err := planTLS(started, now.Add(32*time.Minute), short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	newCA := certsOf(t, switched.caPEM)[0]
	if !leafUsable(switched.certPEM, switched.keyPEM, newCA, now.Add(32*time.Minute)) || len(certsOf(t, switched.bundlePEM)) != 2 {
		t.Fatal("with the new CA published the leaf did not switch to it, or the bundle lost the old CA")
	}
}

// TestPlanTLSRenewsAtTheConfiguredPoint: a leaf is kept while more than LeafRenewBefore is left and
// renewed after; a leaf valid for longer than a shortened validity is re-issued at once, and so is a
// CA (as a rotation).
func TestPlanTLSRenewsAtTheConfiguredPoint(t *testing.T) {
	now := time.Now().Truncate(time.Second) // certificates keep whole seconds
	quiet := func(string, ...any) {}
	l := Lifetimes{Leaf: 9 * time.Minute, LeafRenewBefore: 6 * time.Minute, CA: time.Hour}
	first, err := planTLS(tlsMaterial{}, now, l, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	leaf := certsOf(t, first.certPEM)[0]
	if got := leaf.NotAfter.Sub(now); got != 9*time.Minute {
		t.Errorf("leaf valid for %s after issue, want 9m", got)
	}
	if got := now.Sub(leaf.NotBefore); got != 54*time.Second {
		t.Errorf("leaf backdated by %s, want a tenth of its validity (54s)", got)
	}
	kept, err := planTLS(first, now.Add(2*time.Minute+59*time.Second), l, true, true, quiet)
	if err != nil || !kept.equal(first) {
		t.Fatalf("the leaf was renewed with more than 6 minutes left: %v", err)
	}
	renewed, err := planTLS(first, now.Add(3*time.Minute+time.Second), l, true, true, quiet)
	if err != nil || renewed.equal(first) || string(renewed.caPEM) != string(first.caPEM) {
		t.Fatalf("the leaf was not renewed from the same CA with less than 6 minutes left: %v", err)
	}

	// The operator shortens the validity: the year-long leaf and ten-year CA of the defaults outlive it.
	long, err := planTLS(tlsMaterial{}, now, Lifetimes{}, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	shortened, err := planTLS(long, now, l, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !shortened.rotating() || string(shortened.certPEM) != string(long.certPEM) {
		t.Fatal("a CA that outlives the shortened validity did not start a rotation (with the leaf kept)")
	}
	onlyLeaf, err := planTLS(long, now, Lifetimes{Leaf: 9 * time.Minute}, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if string(onlyLeaf.caPEM) != string(long.caPEM) || certsOf(t, onlyLeaf.certPEM)[0].NotAfter.Sub(now) != 9*time.Minute {
		t.Fatal("a leaf that outlives the shortened validity was not re-issued from the same CA")
	}
	if _, err := planTLS(long, now, Lifetimes{Leaf: time.Minute, LeafRenewBefore: time.Minute}, true, true, quiet); err == nil {
		t.Fatal("planTLS accepted a renewal point that is not inside the validity")
	}
}

func TestParseSettings(t *testing.T) {
	s, err := ParseSettings(nil)
	if err != nil {
		t.Fatal(err)
	}
	if s.Lifetimes.Leaf != DefaultLeafValidity || s.Lifetimes.CA != DefaultCAValidity || s.CheckPeriod != DefaultCheckPeriod ||
		s.Lifetimes.LeafRenewBefore != DefaultLeafValidity/3 || s.Lifetimes.CARenewBefore != DefaultLeafValidity+90*24*time.Hour {
		t.Fatalf("defaults = %+v", s)
	}
	s, err = ParseSettings(map[string]string{"leafValidity": "4m", "leafRenewBefore": "150s", "caValidity": "12m", "checkPeriod": "20s"})
	if err != nil {
		t.Fatal(err)
	}
	if s.Lifetimes.Leaf != 4*time.Minute || s.Lifetimes.LeafRenewBefore != 150*time.Second || s.Lifetimes.CA != 12*time.Minute ||
		s.Lifetimes.CARenewBefore != 4*time.Minute+18*time.Second || s.CheckPeriod != 20*time.Second {
		t.Fatalf("settings = %+v", s)
	}
	for name, data := range map[string]map[string]string{
		"unknown key":       {"leafValidty": "4m"},
		"not a duration":    {"leafValidity": "four minutes"},
		"negative":          {"checkPeriod": "-1m"},
		"renew after end":   {"leafValidity": "4m", "leafRenewBefore": "5m"},
		"leaf outlives CA":  {"leafValidity": "2h", "caValidity": "1h"},
		"CA renew too late": {"caValidity": "1h", "leafValidity": "10m", "caRenewBefore": "2h"},
	} {
		if _, err := ParseSettings(data); !errors.Is(err, ErrInvalidConfiguration) {
			t.Errorf("%s: ParseSettings(%v) = %v, want ErrInvalidConfiguration", name, data, err)
		}
	}
}

// TestPlanTLSWithoutRotationLock: a plan that may not rotate (the keeper did not get the
// control-plane slot) starts no rotation of a due CA but still renews a due leaf from the current
// CA, and during a rotation keeps the old CA's leaf although the new CA is published; with the lock
// the same plans rotate (the negative: mayRotate is what holds them back).
func TestPlanTLSWithoutRotationLock(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	short := Lifetimes{Leaf: 40 * time.Minute, CA: 90 * time.Minute, CARenewBefore: time.Hour}
	fresh, err := planTLS(tlsMaterial{}, now, short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	// 31 minutes in, the CA is due and so is the leaf (less than a third of 40 minutes left).
	at := now.Add(31 * time.Minute)
	held, err := planTLS(fresh, at, short, true, false, quiet)
	if err != nil {
		t.Fatal(err)
	}
	ca := certsOf(t, fresh.caPEM)[0]
	if held.rotating() || string(held.caPEM) != string(fresh.caPEM) {
		t.Fatal("a plan that may not rotate started a CA rotation")
	}
	if string(held.certPEM) == string(fresh.certPEM) || !leafUsable(held.certPEM, held.keyPEM, ca, at) {
		t.Fatal("a plan that may not rotate did not renew the due leaf from the current CA")
	}
	started, err := planTLS(fresh, at, short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !started.rotating() {
		t.Fatal("with the lock the due CA did not start a rotation")
	}
	// The new CA is published (armed): only a plan that may rotate switches the leaf.
	kept, err := planTLS(started, at.Add(time.Minute), short, true, false, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !kept.equal(started) {
		t.Fatal("a plan that may not rotate switched the leaf to the new CA")
	}
	switched, err := planTLS(started, at.Add(time.Minute), short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if string(switched.certPEM) == string(started.certPEM) {
		t.Fatal("with the lock the leaf did not switch to the new CA")
	}
}
