// Package cplease serializes control-plane joins across joinservice replicas with a
// coordination.k8s.io Lease (berth-control-plane-join in the joinservice's namespace).
//
// A join takes the Lease by writing its own holder identity (replica/node/random) with optimistic
// concurrency: create when absent, update (with the read resourceVersion) when it is free or expired.
// It holds it while the ticket is made (control-plane files and bootstrap token) and clears the holder
// when the ticket is issued or refused. A replica that dies while holding it leaves a Lease that
// expires after TTL (default 30 s) and is then taken over. A join that finds the Lease held polls every
// 100-200 ms for up to MaxWait (default 10 s), then gives up with server.ErrControlPlaneBusy and the
// node retries. Expiry is judged by the waiting replica's clock against the holder's renewTime, so
// control-plane clocks must agree to well within TTL.
package cplease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/joinservice/server"
)

// LeaseName is the Lease that serializes control-plane joins.
const LeaseName = joinconfig.ControlPlaneJoinLease

// Defaults.
const (
	DefaultTTL     = 30 * time.Second
	DefaultMaxWait = 10 * time.Second
)

// pollInterval is the wait between attempts on a held Lease; each wait adds up to pollJitter of it.
const (
	pollInterval = 100 * time.Millisecond
	pollJitter   = 1.0
)

// Lock implements server.ControlPlaneLock with a Lease.
type Lock struct {
	client    kubernetes.Interface
	namespace string
	replica   string
	log       *zap.Logger
	// TTL is how long a held Lease counts as held without being released.
	TTL time.Duration
	// MaxWait bounds how long Lock waits for another holder.
	MaxWait time.Duration
}

var _ server.ControlPlaneLock = (*Lock)(nil)

// New returns a Lock on the Lease in namespace for replica.
func New(client kubernetes.Interface, namespace, replica string, log *zap.Logger) *Lock {
	if log == nil {
		log = zap.NewNop()
	}
	return &Lock{client: client, namespace: namespace, replica: replica, log: log, TTL: DefaultTTL, MaxWait: DefaultMaxWait}
}

// Lock takes the Lease for holder (the joining node's name) or returns server.ErrControlPlaneBusy
// when it stays held for MaxWait or ctx ends; other API errors are returned as they are.
func (l *Lock) Lock(ctx context.Context, holder string) (func(), error) {
	suffix := make([]byte, 4)
	if _, err := rand.Read(suffix); err != nil {
		return nil, fmt.Errorf("generating lease holder identity: %w", err)
	}
	id := l.replica + "/" + holder + "/" + hex.EncodeToString(suffix)
	ctx, cancel := context.WithTimeout(ctx, l.MaxWait)
	defer cancel()
	poll := wait.Backoff{Duration: pollInterval, Jitter: pollJitter, Steps: math.MaxInt32}
	err := wait.ExponentialBackoffWithContext(ctx, poll, func(ctx context.Context) (bool, error) {
		return l.tryAcquire(ctx, id)
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil, server.ErrControlPlaneBusy
		}
		return nil, err
	}
	return func() { l.release(ctx, id) }, nil
}

// tryAcquire makes one attempt: true when id now holds the Lease.
func (l *Lock) tryAcquire(ctx context.Context, id string) (bool, error) {
	leases := l.client.CoordinationV1().Leases(l.namespace)
	now := metav1.NewMicroTime(time.Now())
	secs := int32(l.TTL / time.Second)
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		zero := int32(0)
		_, err := leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: LeaseName, Namespace: l.namespace},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity: &id, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now, LeaseTransitions: &zero,
			},
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("creating lease: %w", err)
		}
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("reading lease: %w", err)
	}
	if l.held(lease) {
		return false, nil
	}
	transitions := int32(1)
	if lease.Spec.LeaseTransitions != nil {
		transitions = *lease.Spec.LeaseTransitions + 1
	}
	lease.Spec = coordinationv1.LeaseSpec{
		HolderIdentity: &id, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now, LeaseTransitions: &transitions,
	}
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("taking lease: %w", err)
	}
	return true, nil
}

// held reports whether someone holds lease and it has not expired.
func (l *Lock) held(lease *coordinationv1.Lease) bool {
	s := lease.Spec
	if s.HolderIdentity == nil || *s.HolderIdentity == "" {
		return false
	}
	if s.RenewTime == nil || s.LeaseDurationSeconds == nil {
		return false
	}
	expires := s.RenewTime.Add(time.Duration(*s.LeaseDurationSeconds) * time.Second)
	return time.Now().Before(expires)
}

// release clears the holder if it is still id. Failures only delay the next join until the TTL.
func (l *Lock) release(ctx context.Context, id string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	leases := l.client.CoordinationV1().Leases(l.namespace)
	for range 5 {
		lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
		if err != nil {
			l.log.Warn("releasing control-plane join lease", zap.Error(err))
			return
		}
		if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity != id {
			return // expired and taken over
		}
		lease.Spec.HolderIdentity = nil
		lease.Spec.RenewTime = nil
		lease.Spec.AcquireTime = nil
		_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
		if err == nil {
			return
		}
		if !apierrors.IsConflict(err) {
			l.log.Warn("releasing control-plane join lease", zap.Error(err))
			return
		}
	}
}
