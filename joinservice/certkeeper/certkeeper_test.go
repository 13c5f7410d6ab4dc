package certkeeper

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/pemcerts"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

func TestMain(m *testing.M) {
	// client-go v0.37 lists through a watch stream by default and waits for the stream's closing
	// bookmark, which the fake clientset inside a synctest bubble never sends in time: the schedule
	// test's informer then missed the webhook configuration's change. Every test of this package,
	// those against a real API server too, lists as before v0.37.
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", "false"); err != nil {
		panic(err)
	}
	goleak.VerifyTestMain(apiservertest.StoppingShared(m))
}

// checker is a webhook pass that records when it ran and answers report (or err).
type checker struct {
	mu     sync.Mutex
	times  []time.Time
	report install.KeepReport
	err    error
}

func (c *checker) Check(context.Context) (install.KeepReport, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.times = append(c.times, time.Now())
	return c.report, c.err
}

func (c *checker) passes() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.times)
}

func TestNextPass(t *testing.T) {
	now := time.Now()
	period := install.Settings{CheckPeriod: 30 * time.Second, Lifetimes: install.Lifetimes{Leaf: 4 * time.Minute, LeafRenewBefore: time.Minute, CA: time.Hour}}
	cases := []struct {
		name string
		rep  install.KeepReport
		err  error
		want time.Duration
	}{
		{"the period", install.KeepReport{Settings: period}, nil, 30 * time.Second},
		{"default period", install.KeepReport{}, nil, install.DefaultCheckPeriod},
		{"renewal due sooner", install.KeepReport{Settings: period, Expiry: install.Expiry{Leaf: now.Add(70 * time.Second), CA: now.Add(time.Hour)}}, nil, 10 * time.Second},
		{"renewal overdue", install.KeepReport{Settings: period, Expiry: install.Expiry{Leaf: now.Add(10 * time.Second), CA: now.Add(time.Hour)}}, nil, minPause},
		{"after a failure", install.KeepReport{Settings: period}, install.ErrNoReadyEndpoints, retryAfterFailure},
		{"not installed", install.KeepReport{}, install.ErrNotInstalled, install.DefaultCheckPeriod},
		{"rotation waits for the slot", install.KeepReport{Settings: period, RotationWaits: "busy", Expiry: install.Expiry{Leaf: now.Add(3 * time.Minute), CA: now.Add(time.Minute)}}, nil, retryAfterFailure},
	}
	for _, c := range cases {
		if got := nextPass(c.rep, c.err, now); got != c.want {
			t.Errorf("%s: nextPass = %s, want %s", c.name, got, c.want)
		}
	}
}

// TestKeepWebhookSchedule: the leader checks at once, then every check period, and at once (after
// the one-second pause) when the webhook configuration changes; a failure is retried sooner.
func TestKeepWebhookSchedule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client := fake.NewClientset(&admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.ConfigName}})
		c := &checker{report: install.KeepReport{Settings: install.Settings{CheckPeriod: time.Minute}}}
		d := Deps{Log: zap.NewNop(), Client: client, Webhook: c, Metrics: NewMetrics(prometheus.NewRegistry(), nil)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		start := time.Now()
		go func() { defer close(done); d.keepWebhook(ctx) }()
		synctest.Wait()
		if c.passes() != 1 {
			t.Fatalf("%d passes at the start, want 1", c.passes())
		}
		time.Sleep(time.Minute)
		synctest.Wait()
		if c.passes() != 2 || c.times[1].Sub(start) != time.Minute {
			t.Fatalf("passes at %v, want the second one a period after the first", c.times)
		}
		time.Sleep(10 * time.Second)
		vwc, err := client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vwc.Annotations = map[string]string{"changed": "by hand"}
		if _, err := client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Update(ctx, vwc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(minPause)
		synctest.Wait()
		if c.passes() != 3 || c.times[2].Sub(start) != time.Minute+10*time.Second+minPause {
			t.Fatalf("passes at %v, want a third one a second after the change at 1m10s", c.times)
		}
		c.mu.Lock()
		c.err = install.ErrNoReadyEndpoints
		c.mu.Unlock()
		time.Sleep(time.Minute)
		synctest.Wait()
		time.Sleep(retryAfterFailure)
		synctest.Wait()
		if c.passes() != 5 {
			t.Fatalf("%d passes, want a retry %s after the failed one", c.passes(), retryAfterFailure)
		}
		cancel()
		<-done
	})
}

// TestLeaderElection: of two replicas against a real API server exactly one leads (Lease
// berth-cert-keeper, berth_certkeeper_leader 1 there and 0 on the other) and runs the passes; when
// it stops, it releases the Lease and the other takes over and runs them.
func TestLeaderElection(t *testing.T) {
	env := apiservertest.Shared(t)
	kube := env.Client(t, apiservertest.AdminUser)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// berth-system and the joinservice's Role (Leases) as berth init installs them.
	if err := env.InstallBerth(ctx, ""); err != nil {
		t.Fatal(err)
	}

	type replica struct {
		checker *checker
		metrics *Metrics
		cancel  context.CancelFunc
		done    chan error
	}
	start := func(identity string) *replica {
		r := &replica{checker: &checker{err: install.ErrNotInstalled}, done: make(chan error, 1)}
		r.metrics = NewMetrics(prometheus.NewRegistry(), nil)
		rctx, rcancel := context.WithCancel(ctx)
		r.cancel = rcancel
		go func() {
			r.done <- Run(rctx, Deps{
				Log: zaptest.NewLogger(t).Named(identity), Client: env.Client(t, apiservertest.JoinServiceUser), Namespace: joinconfig.Namespace,
				Identity: identity, Webhook: r.checker, Metrics: r.metrics,
				LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 500 * time.Millisecond,
			})
		}()
		return r
	}
	a, b := start("cp1_a"), start("cp2_b")
	leader := func() (*replica, *replica) {
		var lead, other *replica
		_ = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
			la, lb := testutil.ToFloat64(a.metrics.leader), testutil.ToFloat64(b.metrics.leader)
			switch {
			case la == 1 && lb == 0:
				lead, other = a, b
			case lb == 1 && la == 0:
				lead, other = b, a
			}
			return lead != nil && lead.checker.passes() > 0, nil
		})
		return lead, other
	}
	lead, other := leader()
	if lead == nil {
		t.Fatal("no replica leads")
	}
	lease, err := kube.CoordinationV1().Leases(joinconfig.Namespace).Get(ctx, LeaseName, metav1.GetOptions{})
	if err != nil || lease.Spec.HolderIdentity == nil {
		t.Fatalf("Lease %s: %+v, %v", LeaseName, lease, err)
	}
	t.Logf("leader %s", *lease.Spec.HolderIdentity)
	if other.checker.passes() != 0 {
		t.Fatal("the replica that does not lead ran passes")
	}
	stopped := time.Now()
	lead.cancel()
	if err := <-lead.done; err != nil {
		t.Fatalf("Run of the stopped leader: %v", err)
	}
	if err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		return testutil.ToFloat64(other.metrics.leader) == 1 && other.checker.passes() > 0, nil
	}); err != nil {
		t.Fatal("the other replica did not take over")
	}
	t.Logf("the other replica led and checked %s after the leader stopped", time.Since(stopped).Round(time.Millisecond))
	other.cancel()
	if err := <-other.done; err != nil {
		t.Fatal(err)
	}
}

// TestTakeoverRenews: the leader that ran init is powered off (its Lease is held by an identity that
// no longer renews it); a replica on another control plane takes the Lease over and, with the
// compressed lifetimes of the mini e2e (a 4-minute leaf, a 10-minute CA: the installed year-long
// chain outlives them), starts a CA rotation within one check period of the settings, writing the
// TLS Secret as the joinservice's ServiceAccount with the RBAC the installer gave it. There are no
// webhook pods and no configuration here, so the rotation stops after its first step.
func TestTakeoverRenews(t *testing.T) {
	env := apiservertest.Shared(t)
	kube := env.Client(t, apiservertest.AdminUser)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := env.InstallBerth(ctx, ""); err != nil {
		t.Fatal(err)
	}
	installWithoutPods(t, ctx, env)
	secrets := kube.CoreV1().Secrets(joinconfig.Namespace)
	before, err := secrets.Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cms := kube.CoreV1().ConfigMaps(joinconfig.Namespace)
	if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.CertificatesConfigMap},
		Data: map[string]string{"leafValidity": "4m", "leafRenewBefore": "2m30s", "caValidity": "10m", "checkPeriod": "5s"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cms.Delete(context.Background(), webhookconfig.CertificatesConfigMap, metav1.DeleteOptions{})
	}()
	// cp1 held the Lease when it was powered off.
	now := metav1.NewMicroTime(time.Now())
	leases := kube.CoordinationV1().Leases(joinconfig.Namespace)
	if err := leases.Delete(ctx, LeaseName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err) // left by another test of the shared API server
	}
	if _, err := leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: LeaseName},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("cp1_gone"), LeaseDurationSeconds: ptr.To(int32(3)), AcquireTime: &now, RenewTime: &now}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = leases.Delete(context.Background(), LeaseName, metav1.DeleteOptions{}) }()

	asJoinService := env.Config(apiservertest.JoinServiceUser)
	jkube := env.Client(t, apiservertest.JoinServiceUser)
	jdyn, err := dynamic.NewForConfig(asJoinService)
	if err != nil {
		t.Fatal(err)
	}
	metrics := NewMetrics(prometheus.NewRegistry(), nil)
	rctx, rcancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		done <- Run(rctx, Deps{
			Log: zaptest.NewLogger(t), Client: jkube, Namespace: joinconfig.Namespace, Identity: "cp2_a",
			Webhook: install.NewKeeper(install.Config{Budget: 20 * time.Second}, jkube, jdyn, io.Discard), Metrics: metrics,
			LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 500 * time.Millisecond,
		})
	}()
	var after *corev1.Secret
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		after, err = secrets.Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
		return err == nil && !bytes.Equal(after.Data["ca.crt"], before.Data["ca.crt"]), nil
	})
	took := time.Since(start)
	rcancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err != nil {
		t.Fatalf("no CA rotation started within 30 s of the takeover (leader %v)", testutil.ToFloat64(metrics.leader))
	}
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity == "cp1_gone" || ptr.Deref(lease.Spec.LeaseTransitions, 0) == 0 {
		t.Fatalf("Lease after the takeover: holder %v, transitions %v", lease.Spec.HolderIdentity, lease.Spec.LeaseTransitions)
	}
	ca, err := pemcerts.Parse(after.Data["ca.crt"])
	if err != nil || len(ca) != 1 {
		t.Fatalf("the new CA: %v", err)
	}
	if validity := ca[0].NotAfter.Sub(ca[0].NotBefore); validity > 12*time.Minute {
		t.Errorf("the new CA is valid for %s, want the compressed 10 minutes (plus its backdating)", validity)
	}
	bundle, err := pemcerts.Parse(after.Data["ca-bundle.crt"])
	if err != nil || len(bundle) != 2 {
		t.Errorf("the bundle during the rotation holds %d CAs, want the old and the new one (%v)", len(bundle), err)
	}
	t.Logf("the replica that took over started a CA rotation %s after it started", took.Round(time.Millisecond))
}

// installWithoutPods runs the webhook's installer, which applies the TLS Secret and the keeper's
// RBAC, then waits for webhook pods that never come (there are no nodes).
func installWithoutPods(t *testing.T, ctx context.Context, env *apiservertest.Env) {
	t.Helper()
	dyn, err := dynamic.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	kube := env.Client(t, apiservertest.AdminUser)
	// A fresh year-long chain, whatever another test of the shared API server left.
	if err := kube.CoreV1().Secrets(joinconfig.Namespace).Delete(ctx, webhookconfig.TLSSecret, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if _, err := install.New(install.Config{Image: "berth/webhook:test", Budget: 3 * time.Second}, kube, dyn, io.Discard).Install(ctx); !errors.Is(err, install.ErrDeploymentNotReady) {
		t.Fatalf("installing the webhook without pods = %v, want ErrDeploymentNotReady", err)
	}
}

// TestConfigurationChangeStartsAPass: as the joinservice's ServiceAccount, with the RBAC the
// installer gives the keeper (the configuration by name: get, list, watch), the leader's watch on
// the webhook configuration sees a change made by hand and starts a pass a pause after it, long
// before the check period: a wrong caBundle waits for one pass, not for the period.
func TestConfigurationChangeStartsAPass(t *testing.T) {
	env := apiservertest.Shared(t)
	kube := env.Client(t, apiservertest.AdminUser)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := env.InstallBerth(ctx, ""); err != nil {
		t.Fatal(err)
	}
	installWithoutPods(t, ctx, env)
	vwcs := kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	if _, err := vwcs.Create(ctx, &admissionregistrationv1.ValidatingWebhookConfiguration{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.ConfigName}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	defer func() { _ = vwcs.Delete(context.Background(), webhookconfig.ConfigName, metav1.DeleteOptions{}) }()
	c := &checker{report: install.KeepReport{Settings: install.Settings{CheckPeriod: time.Hour}}}
	d := Deps{Log: zaptest.NewLogger(t), Client: env.Client(t, apiservertest.JoinServiceUser), Webhook: c, Metrics: NewMetrics(prometheus.NewRegistry(), nil)}
	kctx, kcancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); d.keepWebhook(kctx) }()
	defer func() { kcancel(); <-done }()
	// The first pass runs at once; the watch is up once the informer listed the configuration,
	// which a change made before that would not count as (it is the state the first pass saw).
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return c.passes() == 1, nil
	}); err != nil {
		t.Fatal("no first pass")
	}
	var changedAt time.Time
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		if c.passes() > 1 {
			return true, nil
		}
		vwc, err := vwcs.Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		vwc.Annotations = map[string]string{"changed-by-hand": time.Now().Format(time.RFC3339Nano)}
		if _, err := vwcs.Update(ctx, vwc, metav1.UpdateOptions{}); err != nil {
			return false, err
		}
		changedAt = time.Now()
		return false, nil
	})
	if err != nil {
		t.Fatalf("no pass after changes of the configuration (check period an hour): %v", err)
	}
	c.mu.Lock()
	after := c.times[1].Sub(changedAt)
	c.mu.Unlock()
	t.Logf("a pass started %s after the configuration changed", after.Round(time.Millisecond))
}

// notReady answers every /readyz with the API server's answer for a failing etcd check, and passes
// every other request on: an API server that serves reads and writes while its readiness check fails
// (a slow etcd under load, a post-start hook).
type notReady struct{ next http.RoundTripper }

func (n notReady) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Path != "/readyz" {
		return n.next.RoundTrip(req)
	}
	body := "[-]etcd-readiness failed: reason withheld\nreadyz check failed\n"
	return &http.Response{StatusCode: http.StatusInternalServerError, Status: "500 Internal Server Error", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"text/plain"}}, Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body)), Request: req}, nil
}

// TestKeeperRenewsWhileReadyzFails: the keeper's pass renews what is due even when its API server's
// /readyz fails, as long as the API server serves the keeper's reads and writes: with the mini e2e's
// compressed lifetimes the pass starts a CA rotation in the TLS Secret (and stops at the missing
// configuration), instead of waiting out its whole budget for a readiness that does not come.
func TestKeeperRenewsWhileReadyzFails(t *testing.T) {
	env := apiservertest.Shared(t)
	kube := env.Client(t, apiservertest.AdminUser)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := env.InstallBerth(ctx, ""); err != nil {
		t.Fatal(err)
	}
	installWithoutPods(t, ctx, env)
	_ = kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(ctx, webhookconfig.ConfigName, metav1.DeleteOptions{})
	secrets := kube.CoreV1().Secrets(joinconfig.Namespace)
	before, err := secrets.Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cms := kube.CoreV1().ConfigMaps(joinconfig.Namespace)
	if err := cms.Delete(ctx, webhookconfig.CertificatesConfigMap, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.CertificatesConfigMap},
		Data: map[string]string{"leafValidity": "4m", "leafRenewBefore": "2m30s", "caValidity": "10m"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cms.Delete(context.Background(), webhookconfig.CertificatesConfigMap, metav1.DeleteOptions{})
	}()

	cfg := env.Config(apiservertest.JoinServiceUser)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return notReady{rt} })
	jkube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := jkube.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx); err == nil {
		t.Fatal("/readyz through the fault injection answered ok")
	}
	jdyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	rep, err := install.NewKeeper(install.Config{Budget: 15 * time.Second}, jkube, jdyn, io.Discard).Check(ctx)
	t.Logf("pass with /readyz failing: %v in %s: %v", rep, time.Since(start).Round(time.Millisecond), err)
	after, gerr := secrets.Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if gerr != nil {
		t.Fatal(gerr)
	}
	if !rep.CARenewed || bytes.Equal(after.Data["ca.crt"], before.Data["ca.crt"]) {
		t.Fatalf("the pass did not start the due CA rotation while /readyz failed: %v", err)
	}
	if !errors.Is(err, install.ErrConfigMissing) {
		t.Errorf("the pass without a configuration = %v, want ErrConfigMissing", err)
	}
}
