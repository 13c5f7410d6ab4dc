package install

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/pemcerts"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// Keeping: after the install, the keeper owns the webhook's trust chain for as long as the cluster
// lives. It writes only the TLS Secret and the caBundle of the armed configuration, never the
// backend and never the rest of the configuration, and it runs the same steps the installer runs:
// renewal and the four-step CA rotation (tls.go), the TLS probes of every ready endpoint (ready.go)
// and the end-to-end check through the API server (arm.go).

// KeeperFieldManager is the field manager of the keeper's writes.
const KeeperFieldManager = "berth-cert-keeper"

// Outcomes of a keeper pass that are not failures of the chain itself.
var (
	// ErrNotInstalled: there is no TLS Secret, so the webhook was never installed (the bootstrapper
	// installs it only with a webhook image) or was uninstalled. The keeper never creates it.
	ErrNotInstalled = errors.New("image-policy webhook not installed")
	// ErrConfigMissing: the webhook configuration does not exist. The keeper never creates it
	// (deleting it is the operator's break-glass; re-installing arms it again).
	ErrConfigMissing = errors.New("webhook configuration missing")
)

// RotationLock keeps every control plane's API server from restarting or joining while a keeper
// pass changes which CA the API servers must trust (the control-plane slot, internal/cpslot). An API
// server that starts in the middle of a CA rotation was seen refusing the webhook's certificate
// after the rotation had finished (the fresh-clone CI of 7a596cb: 5,138 of 122,026 requests under
// load, starting 19 s after the old CA was dropped, while a renewal had restarted cp3's API server
// through the whole rotation); one taken in turn with the restarts cannot meet a rotation half done.
type RotationLock interface {
	// Lock takes the lock, waiting a bounded time for its holder; unlock gives it back. An error
	// names who holds it.
	Lock(ctx context.Context) (unlock func(), err error)
}

// KeepReport says what one pass of the keeper found and did.
type KeepReport struct {
	// Writes lists every write ("update Secret ...", "update ValidatingWebhookConfiguration ...").
	Writes []string
	// LeafRenewed: a new serving certificate was written (when due, or the new CA's leaf during a
	// rotation). CARenewed: a new CA was written (a rotation started, or the CA was unusable).
	LeafRenewed, CARenewed bool
	// RotationDone: a CA rotation finished in this pass (the bundle holds only the new CA).
	RotationDone bool
	// BundleRepaired: the configuration published a caBundle other than the Secret's although the
	// Secret's had not changed in this pass (someone changed or emptied it), and it was replaced.
	BundleRepaired bool
	// Paused: the configuration carries the operator's paused marker and was left alone.
	Paused bool
	// ConfigOK: the configuration exists and publishes the Secret's bundle (as the pass found it,
	// or after it replaced the caBundle).
	ConfigOK bool
	// Expiry is the NotAfter of the Secret's certificates after this pass; zero when unknown.
	Expiry Expiry
	// Settings are the settings the pass used.
	Settings Settings
	// RotationWaits says why a CA rotation that is due or under way did not go on in this pass (the
	// rotation lock was held by another operation); empty when it did or none was due.
	RotationWaits string
}

// Expiry holds when the webhook's certificates expire.
type Expiry struct {
	// Leaf is the serving certificate's; CA the current CA's; Bundle the earliest of the bundle's.
	Leaf, CA, Bundle time.Time
}

// Keeper keeps the installed webhook's trust chain healthy: one Check is one pass.
type Keeper struct {
	cfg  Config
	kube kubernetes.Interface
	dyn  dynamic.Interface
	out  io.Writer
	lock RotationLock
}

// NewKeeper returns a keeper; cfg sets the probing (timeouts, stable passes, budget of a pass), the
// rest comes from the cluster: the policy from ConfigMap berth-webhook-policy and the validity
// periods from ConfigMap berth-webhook-certificates. Progress goes to out.
func NewKeeper(cfg Config, kube kubernetes.Interface, dyn dynamic.Interface, out io.Writer) *Keeper {
	return &Keeper{cfg: cfg, kube: kube, dyn: dyn, out: out}
}

// WithRotationLock makes every pass that starts, goes on with or finishes a CA rotation hold lock
// for its whole length; without it the rotation waits for a later pass, and everything else (a
// serving certificate that is due, the caBundle's repair) goes on. Without a lock a keeper rotates
// at will (tests, a cluster that restarts no API server).
func (k *Keeper) WithRotationLock(lock RotationLock) *Keeper {
	k.lock = lock
	return k
}

// Check runs one pass: it renews the serving certificate or starts a CA rotation when one is due and
// writes the TLS Secret; when the configuration's caBundle differs from the Secret's bundle it
// probes every ready endpoint against the Secret's bundle, replaces the caBundle and proves
// enforcement end to end (restoring the previous caBundle when the proof fails); otherwise it probes
// and proves the chain as it is; then it finishes a CA rotation whose new CA is published. A pass on
// a healthy cluster writes nothing. Unlike the installer it does not wait for the API server's
// readiness check first. Every error wraps an Err* category.
func (k *Keeper) Check(ctx context.Context) (rep KeepReport, err error) {
	cfg := k.cfg
	cfg.Image = "keeper" // the keeper never applies the backend; the image is not used
	w := New(cfg, k.kube, k.dyn, k.out)
	w.keep, w.started = true, time.Now()
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Budget)
	defer cancel()
	defer func() {
		rep.Writes = w.result.Writes
		rep.LeafRenewed, rep.CARenewed, rep.RotationDone = w.leafRenewed, w.caRenewed, w.rotationDone
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if cur, err := w.readTLS(rctx); err == nil {
			rep.Expiry = expiryOf(cur)
		}
	}()
	// No wait for the API server's /readyz, unlike the installer after a restart: an API server
	// whose readiness check fails (a slow etcd under load, a post-start hook) may still serve every
	// read and write the keeper needs, and a certificate that is due must not wait for it. Each
	// call below fails on its own when the API server does not answer.
	settings, err := ReadSettings(ctx, k.kube)
	switch {
	case errors.Is(err, ErrInvalidConfiguration):
		return rep, failure(ErrInvalidConfiguration, "fix ConfigMap "+namespace+"/"+webhookconfig.CertificatesConfigMap, "%v", err)
	case err != nil:
		return rep, failure(ErrAPINotReady, "check the control plane (kube-apiserver, etcd); the keeper retries", "%v", err)
	}
	rep.Settings = settings
	w.cfg.Lifetimes = settings.Lifetimes
	if w.cfg.Policy, err = clusterPolicy(ctx, k.kube); err != nil {
		return rep, err
	}

	w.lockless = k.lock == nil
	defer w.unlockRotation()
	cur, next, err := k.plan(ctx, w, &rep)
	if err != nil {
		return rep, err
	}
	if next, err = w.writeTLS(ctx, cur, next); err != nil {
		return rep, err
	}

	live, err := w.vwcs().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return rep, failure(ErrConfigMissing, "re-install the webhook, or leave it deleted on purpose (break-glass)", "configuration %s does not exist", webhookconfig.ConfigName)
	case err != nil:
		return rep, failure(ErrApply, "check the API server and retry", "reading configuration %s: %v", webhookconfig.ConfigName, err)
	case live.Annotations[webhookconfig.PausedAnnotation] == "true":
		w.say("configuration %s is paused by the operator (annotation %s): left alone", webhookconfig.ConfigName, webhookconfig.PausedAnnotation)
		rep.Paused = true
		return rep, nil
	}
	if !publishes(live, next.bundlePEM) {
		w.say("configuration %s publishes a CA bundle other than Secret %s: probing the endpoints against the Secret's", webhookconfig.ConfigName, webhookconfig.TLSSecret)
		if _, err := w.waitServing(ctx, next.bundlePEM); err != nil {
			return rep, err
		}
		if err := w.publishBundle(ctx, live, next.bundlePEM); err != nil {
			return rep, err
		}
		rep.ConfigOK = true
		rep.BundleRepaired = bytes.Equal(cur.bundlePEM, next.bundlePEM)
	} else {
		rep.ConfigOK = true
		w.checking = next.bundlePEM
		if _, err := w.waitServing(ctx, next.bundlePEM); err != nil {
			return rep, err
		}
		if err := w.endToEnd(ctx); err != nil {
			return rep, err
		}
	}
	if err := w.finishCARotation(ctx); err != nil {
		return rep, err
	}
	w.say("trust chain checked (%d writes in this pass)", len(w.result.Writes))
	return rep, nil
}

// plan reads the TLS Secret and plans this pass's material. When the plan would start, go on with or
// finish a CA rotation, the pass takes the rotation lock first and reads the Secret again under it
// (the wait may have let another keeper write); when the lock is not had, the pass plans without the
// rotation's steps and says why in rep.
func (k *Keeper) plan(ctx context.Context, w *Installer, rep *KeepReport) (cur, next tlsMaterial, err error) {
	for {
		cur, err = w.readTLS(ctx)
		if err != nil {
			return cur, next, err
		}
		if cur.resourceVersion == "" {
			return cur, next, failure(ErrNotInstalled, "install it with the bootstrapper's --webhook-image, or ignore this on a cluster without it", "Secret %s/%s does not exist", namespace, webhookconfig.TLSSecret)
		}
		armed, err := w.bundleHolds(ctx, cur.caPEM)
		if err != nil {
			return cur, next, err
		}
		if !w.mayRotate() && rep.RotationWaits == "" {
			// A silent trial plan: does this pass want to rotate? Without a rotation due or under
			// way, the plan without the rotation's steps is the same plan.
			trial, err := planTLS(cur, w.cfg.Now(), w.cfg.Lifetimes, armed, true, func(string, ...any) {})
			if err != nil {
				return cur, next, failure(ErrApply, "retry", "%v", err)
			}
			if cur.rotating() || trial.rotating() {
				unlock, err := k.lock.Lock(ctx)
				if err == nil {
					w.rotationLocked, w.unlock = true, unlock
					w.say("CA rotation: holding the control-plane slot, so that no API server restarts or joins meanwhile")
					continue
				}
				rep.RotationWaits = err.Error()
				w.say("CA rotation waits for a later pass: %v", err)
			}
		}
		next, err = planTLS(cur, w.cfg.Now(), w.cfg.Lifetimes, armed, w.mayRotate(), w.say)
		if err != nil {
			return cur, next, failure(ErrApply, "retry", "%v", err)
		}
		return cur, next, nil
	}
}

// unlockRotation gives the rotation lock back when the pass took it.
func (w *Installer) unlockRotation() {
	if w.unlock != nil {
		w.unlock()
		w.unlock, w.rotationLocked = nil, false
	}
}

// bundleChanged reports, for the keeper, whether the live configuration no longer publishes the
// bundle this pass checks (someone changed it meanwhile).
func (w *Installer) bundleChanged(ctx context.Context) bool {
	if !w.keep || w.checking == nil {
		return false
	}
	live, err := w.vwcs().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
	return err == nil && !publishes(live, w.checking)
}

// publishes reports whether every webhook of the configuration carries bundle as its caBundle.
func publishes(cfg *admissionregistrationv1.ValidatingWebhookConfiguration, bundle []byte) bool {
	return len(cfg.Webhooks) > 0 && !slices.ContainsFunc(cfg.Webhooks, func(h admissionregistrationv1.ValidatingWebhook) bool {
		return !bytes.Equal(h.ClientConfig.CABundle, bundle)
	})
}

// publish makes bundle the configuration's CA bundle: the installer arms the whole configuration,
// the keeper replaces the caBundle of the live one only.
func (w *Installer) publish(ctx context.Context, bundle []byte) error {
	if !w.keep {
		return w.arm(ctx, bundle)
	}
	live, err := w.vwcs().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
	if err != nil {
		return failure(ErrApply, "check the API server and retry", "reading configuration %s: %v", webhookconfig.ConfigName, err)
	}
	if live.Annotations[webhookconfig.PausedAnnotation] == "true" {
		w.say("configuration %s is paused by the operator (annotation %s): left alone", webhookconfig.ConfigName, webhookconfig.PausedAnnotation)
		return nil
	}
	if publishes(live, bundle) {
		return w.endToEnd(ctx)
	}
	return w.publishBundle(ctx, live, bundle)
}

// publishBundle replaces the caBundle of every webhook of live (an update on live's resourceVersion,
// so a concurrent change makes it fail instead of being overwritten), proves enforcement end to end,
// and restores live's caBundles when the proof fails.
func (w *Installer) publishBundle(ctx context.Context, live *admissionregistrationv1.ValidatingWebhookConfiguration, bundle []byte) error {
	next := live.DeepCopy()
	for n := range next.Webhooks {
		next.Webhooks[n].ClientConfig.CABundle = bundle
	}
	updated, err := w.vwcs().Update(ctx, next, metav1.UpdateOptions{FieldManager: KeeperFieldManager})
	if err != nil {
		return failure(ErrApply, "retry; a conflict means the configuration changed meanwhile", "updating the caBundle of %s: %v", webhookconfig.ConfigName, err)
	}
	w.checking = bundle
	w.result.Writes = append(w.result.Writes, "update ValidatingWebhookConfiguration "+webhookconfig.ConfigName+" caBundle")
	w.say("configuration %s: caBundle replaced (%d certificates)", webhookconfig.ConfigName, countCerts(bundle))
	if err := w.endToEnd(ctx); err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		restore := updated.DeepCopy()
		for n := range restore.Webhooks {
			if n < len(live.Webhooks) {
				restore.Webhooks[n].ClientConfig.CABundle = live.Webhooks[n].ClientConfig.CABundle
			}
		}
		if _, rerr := w.vwcs().Update(rctx, restore, metav1.UpdateOptions{FieldManager: KeeperFieldManager}); rerr != nil {
			w.say("rolling back: restoring the caBundle of %s failed: %v", webhookconfig.ConfigName, rerr)
		} else {
			w.result.Writes = append(w.result.Writes, "update ValidatingWebhookConfiguration "+webhookconfig.ConfigName+" caBundle (rollback)")
			w.say("rolled back: the previous caBundle of %s is restored", webhookconfig.ConfigName)
		}
		return err
	}
	return nil
}

// bundleHolds reports whether the live configuration publishes ca (a PEM certificate) in every
// webhook's caBundle.
func (w *Installer) bundleHolds(ctx context.Context, caPEM []byte) (bool, error) {
	live, err := w.vwcs().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, failure(ErrApply, "check the API server and retry", "reading configuration %s: %v", webhookconfig.ConfigName, err)
	}
	cas, err := pemcerts.Parse(caPEM)
	if err != nil || len(live.Webhooks) == 0 {
		return false, nil
	}
	for _, h := range live.Webhooks {
		certs, err := pemcerts.Parse(h.ClientConfig.CABundle)
		if err != nil || !containsCert(certs, cas[0]) {
			return false, nil
		}
	}
	return true, nil
}

func countCerts(bundle []byte) int {
	c, _ := pemcerts.Parse(bundle)
	return len(c)
}

// expiryOf returns when the material's certificates expire; unparsable ones leave zero times.
func expiryOf(m tlsMaterial) Expiry {
	var e Expiry
	first := func(b []byte) *x509.Certificate {
		c, err := pemcerts.Parse(b)
		if err != nil || len(c) == 0 {
			return nil
		}
		return c[0]
	}
	if c := first(m.certPEM); c != nil {
		e.Leaf = c.NotAfter
	}
	if c := first(m.caPEM); c != nil {
		e.CA = c.NotAfter
	}
	if certs, err := pemcerts.Parse(m.bundlePEM); err == nil {
		for _, c := range certs {
			if e.Bundle.IsZero() || c.NotAfter.Before(e.Bundle) {
				e.Bundle = c.NotAfter
			}
		}
	}
	return e
}

// NextDue is when the next renewal is due (the serving certificate's, or the start of a CA
// rotation) by the pass's settings; zero when the expiry is unknown.
func (r KeepReport) NextDue() time.Time {
	if r.Expiry.Leaf.IsZero() || r.Expiry.CA.IsZero() {
		return time.Time{}
	}
	l := r.Settings.Lifetimes.WithDefaults()
	leaf, ca := r.Expiry.Leaf.Add(-l.LeafRenewBefore), r.Expiry.CA.Add(-l.CARenewBefore)
	if ca.Before(leaf) {
		return ca
	}
	return leaf
}

// String formats the report's outcome for a log line.
func (r KeepReport) String() string {
	return fmt.Sprintf("writes=%d leafRenewed=%v caRenewed=%v rotationDone=%v bundleRepaired=%v paused=%v configOK=%v",
		len(r.Writes), r.LeafRenewed, r.CARenewed, r.RotationDone, r.BundleRepaired, r.Paused, r.ConfigOK)
}
