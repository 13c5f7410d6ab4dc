package install

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/berth-k8s/berth/internal/webhookconfig"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestKeeperEndToEndStopsWhenTheBundleChanges: while the API server fails calling the webhook, the
// keeper's end-to-end check retries for its window, unless the configuration stops publishing the
// bundle the pass checks (changed by hand meanwhile): then it fails at once, and the next pass (a
// change starts one) checks the new state.
func TestKeeperEndToEndStopsWhenTheBundleChanges(t *testing.T) {
	for name, live := range map[string][]byte{"bundle unchanged": []byte("checked"), "bundle changed": []byte("changed by hand")} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				cs := fake.NewClientset(&admissionregistrationv1.ValidatingWebhookConfiguration{
					ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.ConfigName},
					Webhooks:   []admissionregistrationv1.ValidatingWebhook{{Name: webhookconfig.HookName, ClientConfig: admissionregistrationv1.WebhookClientConfig{CABundle: live}}},
				})
				cs.PrependReactor("create", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, errors.New(`Internal error occurred: failed calling webhook "` + webhookconfig.HookName + `": tls: failed to verify certificate`)
				})
				w := New(Config{Image: "keeper", EndToEndWindow: 15 * time.Second}, cs, nil, io.Discard)
				w.keep, w.checking = true, []byte("checked")
				start := time.Now()
				err := w.endToEnd(context.Background())
				took := time.Since(start)
				if !errors.Is(err, ErrCallFailed) {
					t.Fatalf("endToEnd = %v, want ErrCallFailed", err)
				}
				changed := string(live) != "checked"
				if changed != strings.Contains(err.Error(), "caBundle changed during the check") || changed != (took < time.Second) {
					t.Fatalf("bundle changed=%v: endToEnd took %s: %v", changed, took, err)
				}
			})
		})
	}
}

// fakeLock is a RotationLock that is free or held by someone else.
type fakeLock struct {
	busy           bool
	locks, unlocks int
}

func (l *fakeLock) Lock(context.Context) (func(), error) {
	l.locks++
	if l.busy {
		return nil, errors.New("the control-plane slot is taken: bootstrapper@cp3 holds the control-plane slot for the cert-renewal of cp3")
	}
	return func() { l.unlocks++ }, nil
}

// TestKeeperPlanTakesTheRotationLock: a pass whose plan starts a CA rotation, or that finds one under
// way, takes the rotation lock before it writes anything and gives it back at the end; when the lock
// stays held by another operation the pass plans without the rotation (the serving certificate is
// still renewed) and says why; a pass with nothing to rotate never asks for it.
func TestKeeperPlanTakesTheRotationLock(t *testing.T) {
	now := time.Now()
	quiet := func(string, ...any) {}
	short := Lifetimes{Leaf: 40 * time.Minute, CA: 90 * time.Minute, CARenewBefore: time.Hour}
	fresh, err := planTLS(tlsMaterial{}, now, short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	rotating, err := planTLS(fresh, now.Add(31*time.Minute), short, true, true, quiet)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name                  string
		cur                   tlsMaterial
		at                    time.Duration
		busy                  bool
		wantLocks             int
		wantRotate, wantWaits bool
	}{
		{name: "nothing due", cur: fresh, at: time.Minute},
		{name: "CA due, lock free", cur: fresh, at: 31 * time.Minute, wantLocks: 1, wantRotate: true},
		{name: "CA due, lock busy", cur: fresh, at: 31 * time.Minute, busy: true, wantLocks: 1, wantWaits: true},
		{name: "rotation under way, lock free", cur: rotating, at: 32 * time.Minute, wantLocks: 1, wantRotate: true},
		{name: "rotation under way, lock busy", cur: rotating, at: 32 * time.Minute, busy: true, wantLocks: 1, wantRotate: true, wantWaits: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.TLSSecret, Namespace: namespace, ResourceVersion: "1"}, Data: tc.cur.data()}
			cs := fake.NewClientset(secret, &admissionregistrationv1.ValidatingWebhookConfiguration{
				ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.ConfigName},
				Webhooks:   []admissionregistrationv1.ValidatingWebhook{{Name: webhookconfig.HookName, ClientConfig: admissionregistrationv1.WebhookClientConfig{CABundle: tc.cur.bundlePEM}}},
			})
			lock := &fakeLock{busy: tc.busy}
			k := NewKeeper(Config{}, cs, nil, io.Discard).WithRotationLock(lock)
			w := New(Config{Image: "keeper", Lifetimes: short, Now: func() time.Time { return now.Add(tc.at) }}, cs, nil, io.Discard)
			w.keep = true
			var rep KeepReport
			_, next, err := k.plan(context.Background(), w, &rep)
			if err != nil {
				t.Fatal(err)
			}
			if lock.locks != tc.wantLocks || (rep.RotationWaits != "") != tc.wantWaits {
				t.Fatalf("locks=%d RotationWaits=%q, want %d locks and waits=%v", lock.locks, rep.RotationWaits, tc.wantLocks, tc.wantWaits)
			}
			if next.rotating() != tc.wantRotate {
				t.Fatalf("planned rotating=%v, want %v", next.rotating(), tc.wantRotate)
			}
			if tc.busy && tc.cur.rotating() && string(next.certPEM) != string(tc.cur.certPEM) {
				t.Fatal("without the lock the leaf switched to the rotation's new CA")
			}
			if !tc.busy && tc.cur.rotating() && string(next.certPEM) == string(tc.cur.certPEM) {
				t.Fatal("with the lock the rotation did not go on (the leaf did not switch)")
			}
			if w.mayRotate() != (tc.wantLocks == 1 && !tc.busy) {
				t.Fatalf("mayRotate=%v after the plan", w.mayRotate())
			}
			// finishCARotation does nothing without the lock: the Secret is left alone.
			if tc.busy {
				if err := w.finishCARotation(context.Background()); err != nil {
					t.Fatal(err)
				}
				if got, _ := cs.CoreV1().Secrets(namespace).Get(context.Background(), webhookconfig.TLSSecret, metav1.GetOptions{}); got.ResourceVersion != "1" {
					t.Fatal("finishCARotation wrote the Secret without the lock")
				}
			}
			w.unlockRotation()
			if lock.unlocks != lock.locks-boolInt(tc.busy) {
				t.Fatalf("%d unlocks after %d locks", lock.unlocks, lock.locks)
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
