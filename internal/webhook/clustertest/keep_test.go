package clustertest

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// newKeeper returns a keeper that works as the joinservice's ServiceAccount, with the RBAC the
// installer gave it and nothing more.
func newKeeper(tb testing.TB, e *env) *install.Keeper {
	tb.Helper()
	cfg := e.Config(apiservertest.JoinServiceUser)
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return install.NewKeeper(install.Config{
		Budget: 2 * time.Minute, StableInterval: 300 * time.Millisecond, MaxBackoff: time.Second, EndToEndWindow: 4 * time.Second,
	}, kube, dyn, logWriter{tb})
}

// setSettings writes ConfigMap berth-webhook-certificates (nil data deletes it) and restores the
// previous state when the test ends.
func setSettings(tb testing.TB, e *env, data map[string]string) {
	tb.Helper()
	ctx := ctxFor(tb, 30*time.Second)
	cms := e.kube.CoreV1().ConfigMaps(joinconfig.Namespace)
	err := cms.Delete(ctx, webhookconfig.CertificatesConfigMap, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cms.Delete(context.Background(), webhookconfig.CertificatesConfigMap, metav1.DeleteOptions{})
	})
	if data == nil {
		return
	}
	if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.CertificatesConfigMap, Namespace: joinconfig.Namespace}, Data: data},
		metav1.CreateOptions{}); err != nil {
		tb.Fatal(err)
	}
}

// TestKeeperRepairsTheCABundle: a caBundle replaced by hand with a foreign CA (every call now fails
// x509 verification, so pod creates fail closed) is replaced by the keeper's next pass with the
// Secret's bundle, after the endpoints passed their probes against it, and the webhook enforces
// again; the pass after that writes nothing. An emptied caBundle is repaired the same way.
func TestKeeperRepairsTheCABundle(t *testing.T) {
	e := sharedEnv(t)
	armed(t, e)
	setSettings(t, e, nil)
	ctx := ctxFor(t, 4*time.Minute)
	ensureNamespace(t, e.kube, "keep")
	vwcs := e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	secret, err := e.kube.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := secret.Data["ca-bundle.crt"]

	foreign, _, err := foreignKeypair()
	if err != nil {
		t.Fatal(err)
	}
	for name, bundle := range map[string][]byte{"a foreign CA": foreign, "an empty caBundle": nil} {
		vwc, err := vwcs.Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vwc.Webhooks[0].ClientConfig.CABundle = bundle
		if _, err := vwcs.Update(ctx, vwc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		failCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = waitFailsClosed(failCtx, e.kube, "keep", "broken")
		cancel()
		if err != nil {
			t.Fatalf("%s: creates while the caBundle is wrong never failed closed: %v", name, err)
		}
		start := time.Now()
		rep, err := newKeeper(t, e).Check(ctx)
		if err != nil {
			t.Fatalf("%s: keeper: %v", name, err)
		}
		if !rep.BundleRepaired || !rep.ConfigOK || rep.LeafRenewed || rep.CARenewed {
			t.Fatalf("%s: keeper report %v, want only a repaired bundle", name, rep)
		}
		vwc, err = vwcs.Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(vwc.Webhooks[0].ClientConfig.CABundle, want) {
			t.Fatalf("%s: caBundle after the keeper's pass is not the Secret's bundle", name)
		}
		if err := waitDenied(ctx, e.kube, "keep", "after-repair"); err != nil {
			t.Fatalf("%s: not enforcing after the repair: %v", name, err)
		}
		t.Logf("%s: repaired in one pass of %s (%v)", name, time.Since(start).Round(time.Millisecond), rep.Writes)
	}
	// The keeper's RBAC is exactly its job: as the joinservice's ServiceAccount it may not touch
	// another Secret of berth-system.
	other := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "keeper-may-not", Namespace: joinconfig.Namespace}}
	if _, err := e.kube.CoreV1().Secrets(joinconfig.Namespace).Create(ctx, other, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	asKeeper, err := kubernetes.NewForConfig(e.Config(apiservertest.JoinServiceUser))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := asKeeper.CoreV1().Secrets(joinconfig.Namespace).Update(ctx, other, metav1.UpdateOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("the keeper's identity updating another Secret: %v, want Forbidden", err)
	}

	rv := resourceVersions(t, e)
	rep, err := newKeeper(t, e).Check(ctx)
	if err != nil || len(rep.Writes) != 0 {
		t.Fatalf("keeper pass on a healthy chain: writes %v, %v", rep.Writes, err)
	}
	for k, v := range resourceVersions(t, e) {
		if rv[k] != v {
			t.Errorf("%s changed on a healthy pass: %s -> %s", k, rv[k], v)
		}
	}
}

// TestKeeperLeavesWhatItDoesNotOwn: a paused configuration is left alone (its wrong caBundle stays);
// a deleted configuration is reported as ErrConfigMissing and not re-created; a broken settings
// ConfigMap is reported as ErrInvalidConfiguration and nothing is written.
func TestKeeperLeavesWhatItDoesNotOwn(t *testing.T) {
	e := sharedEnv(t)
	armed(t, e)
	ctx := ctxFor(t, 4*time.Minute)
	vwcs := e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()

	setSettings(t, e, map[string]string{"leafValidity": "soon"})
	before := resourceVersions(t, e)
	if _, err := newKeeper(t, e).Check(ctx); !errors.Is(err, install.ErrInvalidConfiguration) {
		t.Fatalf("keeper with a broken settings ConfigMap = %v, want ErrInvalidConfiguration", err)
	}
	for k, v := range resourceVersions(t, e) {
		if before[k] != v {
			t.Errorf("%s written despite broken settings", k)
		}
	}
	setSettings(t, e, nil)

	vwc, err := vwcs.Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	good := vwc.Webhooks[0].ClientConfig.CABundle
	vwc.Annotations = map[string]string{webhookconfig.PausedAnnotation: "true"}
	vwc.Webhooks[0].ClientConfig.CABundle = []byte("operator's choice")
	paused, err := vwcs.Update(ctx, vwc, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := newKeeper(t, e).Check(ctx)
	if err != nil || !rep.Paused {
		t.Fatalf("keeper on a paused configuration: %v, %v", rep, err)
	}
	if got, _ := vwcs.Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{}); got.ResourceVersion != paused.ResourceVersion {
		t.Fatal("the keeper changed a paused configuration")
	}
	restore := func() {
		cur, err := vwcs.Get(context.Background(), webhookconfig.ConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cur.Annotations = nil
		cur.Webhooks[0].ClientConfig.CABundle = good
		if _, err := vwcs.Update(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	restore()

	deleted, err := vwcs.Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := vwcs.Delete(ctx, webhookconfig.ConfigName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		deleted.ResourceVersion = ""
		if _, err := vwcs.Create(context.Background(), deleted, metav1.CreateOptions{}); err != nil {
			t.Errorf("restoring the configuration: %v", err)
		}
	}()
	if _, err := newKeeper(t, e).Check(ctx); !errors.Is(err, install.ErrConfigMissing) {
		t.Fatalf("keeper without a configuration = %v, want ErrConfigMissing", err)
	}
	if configExists(t, e) {
		t.Fatal("the keeper created the configuration")
	}
}

// TestKeeperUnderLoad is the keeper's whole job, compressed: leaf valid 40 s and renewed with 25 s
// left, CA valid 100 s with its rotation starting 50 s before it expires. While two clients send
// dry-run creates, the keeper runs every 2 s (as the certificate keeper's loop does, with a kubelet
// stand-in copying the Secret into the pods' files every 2 s) for 100 s: leaves are renewed, a CA
// rotation runs its four steps, zero requests fail, and every fresh TLS connection verifies against
// the bundle published at that moment. Needs BERTH_WEBHOOK_LOAD=1.
func TestKeeperUnderLoad(t *testing.T) {
	if os.Getenv("BERTH_WEBHOOK_LOAD") != "1" {
		t.Skip("load test: set BERTH_WEBHOOK_LOAD=1 (make test-webhook-load)")
	}
	e, ctx, _, pids := rotationSetup(t, "keep-load")
	setSettings(t, e, map[string]string{"leafValidity": "40s", "leafRenewBefore": "25s", "caValidity": "100s", "caRenewBefore": "50s"})
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()

	stopKubelet := runKubelet(t, ctx, e, 2*time.Second)
	defer stopKubelet()
	fresh, mismatched, firstMismatch, stopCheck := checkFreshConnections(t, ctx, e)

	stop := make(chan struct{})
	start := time.Now()
	stats := startLoad(t, ctx, e, "keep-load", stop, 0)
	var leaves, cas, rotations, passes int
	var times []string
	prevLeaf, prevCA := secretCerts(t, ctx, e)
	for time.Since(start) < 100*time.Second {
		rep, err := newKeeper(t, e).Check(ctx)
		passes++
		if err != nil {
			t.Fatalf("keeper pass %d at %s: %v", passes, time.Since(start).Round(time.Second), err)
		}
		leaf, ca := secretCerts(t, ctx, e)
		if !leaf.Equal(prevLeaf) {
			leaves++
			times = append(times, fmt.Sprintf("leaf %s (valid to %s)", time.Since(start).Round(time.Second), leaf.NotAfter.Format(time.TimeOnly)))
		}
		if !ca.Equal(prevCA) {
			cas++
			times = append(times, fmt.Sprintf("CA %s", time.Since(start).Round(time.Second)))
		}
		if rep.RotationDone {
			rotations++
			times = append(times, fmt.Sprintf("rotation done %s", time.Since(start).Round(time.Second)))
		}
		prevLeaf, prevCA = leaf, ca
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(2 * time.Second):
		}
	}
	close(stop)
	stats.wait()
	stopCheck()
	t.Logf("keeper under load: %d passes, %d new leaves, %d new CAs, %d rotations finished: %s", passes, leaves, cas, rotations, strings.Join(times, "; "))
	t.Logf("fresh TLS connections verified against the published bundle: %d, failed: %d", fresh.Load(), mismatched.Load())
	if mismatched.Load() != 0 {
		t.Errorf("%d fresh connections did not verify against the published bundle; first: %s", mismatched.Load(), *firstMismatch.Load())
	}
	if leaves < 3 || rotations < 1 {
		t.Errorf("%d leaf renewals and %d CA rotations in 100 s, want at least 3 and 1", leaves, rotations)
	}
	for _, p := range e.runner.livePods() {
		if pids[p.name] != p.cmd.Process.Pid {
			t.Errorf("pod %s was restarted", p.name)
		}
	}
	stats.report(t, fmt.Sprintf("keeper under load: %d leaf renewals, %d CA rotations", leaves, rotations), time.Since(start))
}

// secretCerts returns the Secret's serving certificate and CA.
func secretCerts(tb testing.TB, ctx context.Context, e *env) (leaf, ca *x509.Certificate) {
	tb.Helper()
	s, err := e.kube.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	parse := func(b []byte) *x509.Certificate {
		block, _ := pem.Decode(b)
		if block == nil {
			tb.Fatal("no PEM certificate in the Secret")
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			tb.Fatal(err)
		}
		return c
	}
	return parse(s.Data["tls.crt"]), parse(s.Data["ca.crt"])
}

// runKubelet copies the Secret's keypair into the running pods' files every period, as a kubelet
// updates a Secret volume; the returned func stops it.
func runKubelet(tb testing.TB, ctx context.Context, e *env, period time.Duration) func() {
	kctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		wait.UntilWithContext(kctx, func(ctx context.Context) {
			if _, err := e.runner.refreshTLS(ctx); err != nil && ctx.Err() == nil {
				tb.Logf("kubelet stand-in: %v", err)
			}
		}, period)
	}()
	return func() { cancel(); <-done }
}

// checkFreshConnections opens a fresh TLS connection to every pod every 20 ms, as an API server
// opening a new connection would, verified against the bundle the configuration publishes at that
// moment; it counts them and the ones that failed.
func checkFreshConnections(tb testing.TB, ctx context.Context, e *env) (fresh, mismatched *atomic.Int64, first *atomic.Pointer[string], stop func()) {
	fresh, mismatched, first = &atomic.Int64{}, &atomic.Int64{}, &atomic.Pointer[string]{}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		wait.UntilWithContext(cctx, func(cctx context.Context) {
			vwc, err := e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(cctx, webhookconfig.ConfigName, metav1.GetOptions{})
			if err != nil {
				return
			}
			if err := verifyPods(e, vwc.Webhooks[0].ClientConfig.CABundle, fresh); err != nil {
				mismatched.Add(1)
				msg := err.Error()
				first.CompareAndSwap(nil, &msg)
			}
		}, 20*time.Millisecond)
	}()
	return fresh, mismatched, first, func() { cancel(); <-done }
}

// verifyPods opens a fresh TLS connection to every live pod, verified against bundle with the
// Service's name; it counts the connections in fresh and returns an error per failed one.
func verifyPods(e *env, bundle []byte, fresh *atomic.Int64) error {
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(bundle)
	var errs []error
	for _, p := range e.runner.livePods() {
		conn, err := tls.Dial("tcp", p.ip+":8443", &tls.Config{RootCAs: roots, ServerName: webhookconfig.Name + "." + joinconfig.Namespace + ".svc"})
		fresh.Add(1)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p.name, err))
			continue
		}
		conn.Close()
	}
	return errors.Join(errs...)
}
