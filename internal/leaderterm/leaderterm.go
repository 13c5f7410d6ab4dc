// Package leaderterm runs a replica's leader work while it holds a Lease, with client-go's leader
// election. client-go starts its OnStartedLeading callback in a goroutine it does not wait for; Run
// hands each term's context over to a goroutine of its own group instead, so that the work of a
// term has an owner and Run returns only after it ended. When a term ends (the Lease was lost or
// could not be renewed) Run campaigns again, until ctx ends.
package leaderterm

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sync/errgroup"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Config names the Lease and the campaign's timing.
type Config struct {
	// Client reads and writes the Lease.
	Client kubernetes.Interface
	// Namespace and Name of the Lease.
	Namespace, Name string
	// Identity is this replica's name in the Lease.
	Identity string
	// LeaseDuration, RenewDeadline and RetryPeriod are client-go's leader election timing
	// (LeaseDuration > RenewDeadline > RetryPeriod).
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// OnNewLeader, when set, is called with the identity of every new leader (this replica too).
	OnNewLeader func(identity string)
}

// Run campaigns for the Lease until ctx ends and runs lead for every term this replica holds it;
// lead must return when its context (the term) ends. Run returns nil when ctx ends and an error
// only for a configuration client-go refuses, before any term.
func Run(ctx context.Context, c Config, lead func(term context.Context)) error {
	if c.Client == nil || c.Name == "" || c.Namespace == "" || c.Identity == "" {
		return errors.New("leader election: client, Lease namespace and name, and identity are required")
	}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: c.Name, Namespace: c.Namespace},
		Client:     c.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: c.Identity},
	}
	terms := make(chan context.Context)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		for {
			select {
			case <-gctx.Done():
				return nil
			case term := <-terms:
				lead(term)
			}
		}
	})
	g.Go(func() error {
		for gctx.Err() == nil {
			le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
				Lock: lock, Name: c.Name, ReleaseOnCancel: true,
				LeaseDuration: c.LeaseDuration, RenewDeadline: c.RenewDeadline, RetryPeriod: c.RetryPeriod,
				Callbacks: leaderelection.LeaderCallbacks{
					OnStartedLeading: func(term context.Context) {
						select {
						case terms <- term:
						case <-term.Done():
						}
					},
					OnStoppedLeading: func() {},
					OnNewLeader:      c.OnNewLeader,
				},
			})
			if err != nil {
				return fmt.Errorf("configuring the leader election for Lease %s/%s: %w", c.Namespace, c.Name, err)
			}
			le.Run(gctx)
		}
		return nil
	})
	return g.Wait()
}
