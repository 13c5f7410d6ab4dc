// Package certkeeper keeps the cluster's certificates valid from the joinservice, which runs on
// every control plane, so that no node is special: whichever replica holds the Lease
// berth-cert-keeper in berth-system (client-go leader election) does the cluster's work, and another
// takes over within a lease duration when that node goes away.
//
// The leader:
//   - keeps the image-policy webhook's trust chain (internal/webhook/install.Keeper): one pass at
//     once, then every check period (ConfigMap berth-webhook-certificates, default one minute), at
//     the moment the next renewal is due, and at once when the webhook configuration changes (a
//     watch), so a wrong caBundle is repaired within seconds and always within one period;
//   - approves kubelet serving certificates for the node that asks (approver.go).
//
// Every replica reports the expiry of its own node's control-plane certificates (expiry.go).
// Metrics are in metrics.go.
package certkeeper

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/leaderterm"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// LeaseName is the Lease in the joinservice's namespace that elects the certificate keeper.
const LeaseName = joinconfig.CertKeeperLease

// Leader election timing: the leader renews every RetryPeriod and gives up after RenewDeadline
// without a renewal; another replica takes over LeaseDuration after the last renewal (client-go's
// defaults for controllers).
const (
	LeaseDuration = 15 * time.Second
	RenewDeadline = 10 * time.Second
	RetryPeriod   = 2 * time.Second
)

// Scheduling of the webhook passes: after a failed pass the next comes after retryAfterFailure (the
// pass itself already retried for up to its budget); a pass never comes sooner than minPause after
// the previous one, whatever triggered it.
const (
	retryAfterFailure = 10 * time.Second
	minPause          = time.Second
	// watchResync is the resync period of the informers; resyncs trigger nothing.
	watchResync = 10 * time.Minute
)

// Checker is one pass over the webhook's trust chain (install.Keeper).
type Checker interface {
	Check(ctx context.Context) (install.KeepReport, error)
}

// Deps are the keeper's parts.
type Deps struct {
	Log *zap.Logger
	// Client reaches the API server as the joinservice.
	Client kubernetes.Interface
	// Namespace holds the Lease.
	Namespace string
	// Identity names this replica in the Lease.
	Identity string
	// Webhook checks the webhook's trust chain.
	Webhook Checker
	// Approver approves kubelet serving certificates; nil leaves them to someone else.
	Approver interface {
		Run(ctx context.Context) error
	}
	// Metrics records what the keeper does.
	Metrics *Metrics
	// Lease timing; zero means the defaults above.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
}

// Run campaigns for the Lease until ctx ends and, whenever this replica holds it, runs the leader's
// work; it returns nil when ctx ends.
func Run(ctx context.Context, d Deps) error {
	if d.LeaseDuration == 0 {
		d.LeaseDuration, d.RenewDeadline, d.RetryPeriod = LeaseDuration, RenewDeadline, RetryPeriod
	}
	return leaderterm.Run(ctx, leaderterm.Config{
		Client: d.Client, Namespace: d.Namespace, Name: LeaseName, Identity: d.Identity,
		LeaseDuration: d.LeaseDuration, RenewDeadline: d.RenewDeadline, RetryPeriod: d.RetryPeriod,
		OnNewLeader: func(identity string) {
			d.Log.Info("certificate keeper leader", zap.String("leader", identity), zap.Bool("self", identity == d.Identity))
		},
	}, d.lead)
}

// lead runs the leader's work until ctx (the term) ends.
func (d Deps) lead(ctx context.Context) {
	d.Log.Info("leading the certificate keeper", zap.String("lease", d.Namespace+"/"+LeaseName))
	d.Metrics.Leading(true)
	defer d.Metrics.Leading(false)
	var wg sync.WaitGroup
	if d.Approver != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := d.Approver.Run(ctx); err != nil && ctx.Err() == nil {
				d.Log.Error("kubelet serving certificate approver stopped", zap.Error(err))
			}
		}()
	}
	d.keepWebhook(ctx)
	wg.Wait()
	d.Log.Info("certificate keeper term ended")
}

// keepWebhook runs webhook passes until ctx ends (see the package documentation for when).
func (d Deps) keepWebhook(ctx context.Context) {
	changed := make(chan struct{}, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		d.watchConfiguration(ctx, changed)
	}()
	defer wg.Wait()
	var last error
	for {
		start := time.Now()
		rep, err := d.Webhook.Check(ctx)
		if ctx.Err() != nil {
			return
		}
		d.Metrics.Pass(rep, err, time.Since(start))
		d.logPass(rep, err, last)
		last = err
		wait := nextPass(rep, err, time.Now())
		d.Log.Debug("next webhook check", zap.Duration("in", wait))
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		case <-changed:
			timer.Stop()
			// Drain a second event of the same change, then pause so that a burst of writes
			// (the keeper's own included) makes one pass, not many.
			pause := time.NewTimer(minPause)
			select {
			case <-ctx.Done():
				pause.Stop()
				return
			case <-pause.C:
			}
			select {
			case <-changed:
			default:
			}
		}
	}
}

// nextPass is how long to wait after a pass: the check period, or less when the next renewal is due
// sooner, or retryAfterFailure after a failure or while a CA rotation waits for the control-plane
// slot; never less than minPause.
func nextPass(rep install.KeepReport, err error, now time.Time) time.Duration {
	period := rep.Settings.CheckPeriod
	if period == 0 {
		period = install.DefaultCheckPeriod
	}
	wait := period
	if err != nil && !errors.Is(err, install.ErrNotInstalled) {
		wait = min(wait, retryAfterFailure)
	}
	switch due := rep.NextDue(); {
	case rep.RotationWaits != "":
		// The rotation is due but waits for the control-plane slot: the due time has passed.
		wait = min(wait, retryAfterFailure)
	case !due.IsZero():
		wait = min(wait, due.Sub(now))
	}
	return max(wait, minPause)
}

func (d Deps) logPass(rep install.KeepReport, err, last error) {
	fields := []zap.Field{zap.Strings("writes", rep.Writes), zap.Bool("leafRenewed", rep.LeafRenewed),
		zap.Bool("caRenewed", rep.CARenewed), zap.Bool("rotationDone", rep.RotationDone), zap.Bool("bundleRepaired", rep.BundleRepaired),
		zap.Time("leafExpiry", rep.Expiry.Leaf), zap.Time("caExpiry", rep.Expiry.CA), zap.Duration("checkPeriod", rep.Settings.CheckPeriod)}
	if rep.RotationWaits != "" {
		fields = append(fields, zap.String("rotationWaits", rep.RotationWaits))
	}
	switch {
	case errors.Is(err, install.ErrNotInstalled):
		// A cluster without the webhook: said once.
		if !errors.Is(last, install.ErrNotInstalled) {
			d.Log.Info("image-policy webhook not installed: nothing to keep", zap.Error(err))
		}
	case err != nil:
		d.Log.Warn("webhook trust chain check failed", append(fields, zap.Error(err))...)
	case len(rep.Writes) > 0:
		d.Log.Info("webhook trust chain renewed or repaired", fields...)
	default:
		d.Log.Debug("webhook trust chain checked", fields...)
	}
}

// watchConfiguration signals changed whenever the webhook configuration changes (an informer on it
// alone), until ctx ends.
func (d Deps) watchConfiguration(ctx context.Context, changed chan<- struct{}) {
	vwcs := d.Client.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	selector := fields.OneTermEqualSelector("metadata.name", webhookconfig.ConfigName).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = selector
			return vwcs.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = selector
			return vwcs.Watch(ctx, o)
		},
	}
	signal := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	// A resync re-delivers the cached object unchanged and is ignored; a period of
	// zero would park the informer on a channel shared process-wide (testing/synctest cannot tell
	// that goroutine is idle).
	inf := cache.NewSharedIndexInformer(lw, &admissionregistrationv1.ValidatingWebhookConfiguration{}, watchResync, cache.Indexers{})
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		// The initial list is the state the first pass sees; only later changes trigger.
		AddFunc: func(_ any, initial bool) {
			if !initial {
				signal()
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			if !equality.Semantic.DeepEqual(oldObj, newObj) {
				signal()
			}
		},
		DeleteFunc: func(any) { signal() },
	}); err != nil {
		d.Log.Error("watching the webhook configuration", zap.Error(err))
		return
	}
	inf.RunWithContext(ctx)
}

// Progress returns a writer that logs each line the webhook keeper prints as one debug entry; the
// outcome of every pass is logged at info level when it wrote something (logPass).
func Progress(log *zap.Logger) io.Writer { return progress{log} }

type progress struct{ log *zap.Logger }

func (p progress) Write(b []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if line != "" {
			p.log.Debug("webhook keeper", zap.String("step", line))
		}
	}
	return len(b), nil
}
