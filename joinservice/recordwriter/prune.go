package recordwriter

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"
)

// Retention of refusal records.
const (
	// DefaultRefusalRetention is how long a JoinRecord is kept after its latest refusal.
	DefaultRefusalRetention = 30 * 24 * time.Hour
	// PruneInterval is how often a replica looks for JoinRecords past their retention.
	PruneInterval = time.Hour
	// prunePage is how many JoinRecords one list request asks for.
	prunePage = 500
)

// PruneRefusals deletes the JoinRecords whose latest refusal is older than keep before now, and
// returns how many it deleted. Each delete carries the resourceVersion it judged, so a record that
// got a new refusal meanwhile stays; a record another replica deleted first is not an error.
// Machines are never pruned here: a removed machine's removal is what keeps it out.
func (w *Writer) PruneRefusals(ctx context.Context, now time.Time, keep time.Duration) (int, error) {
	cutoff := now.Add(-keep)
	deleted := 0
	opts := metav1.ListOptions{Limit: prunePage}
	for {
		w.requests.Add(1)
		list, err := w.client.RecordsV1alpha1().JoinRecords(w.namespace).List(ctx, opts)
		if err != nil {
			return deleted, fmt.Errorf("listing join records: %w", err)
		}
		for _, jr := range list.Items {
			if !jr.Status.Last.Time.Before(cutoff) {
				continue
			}
			rv := jr.ResourceVersion
			w.requests.Add(1)
			err := w.client.RecordsV1alpha1().JoinRecords(w.namespace).Delete(ctx, jr.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
			switch {
			case err == nil:
				deleted++
			case apierrors.IsNotFound(err), apierrors.IsConflict(err):
			default:
				return deleted, fmt.Errorf("deleting join record %s: %w", jr.Name, err)
			}
		}
		if list.Continue == "" {
			return deleted, nil
		}
		opts.Continue = list.Continue
	}
}

// RunPruning prunes JoinRecords past keep every interval, by clk, until ctx ends; keep 0 prunes
// nothing. It returns nil.
func (w *Writer) RunPruning(ctx context.Context, clk clock.WithTicker, keep, interval time.Duration) error {
	if keep <= 0 {
		return nil
	}
	t := clk.NewTicker(interval)
	defer t.Stop()
	for {
		n, err := w.PruneRefusals(ctx, clk.Now(), keep)
		switch {
		case err != nil && ctx.Err() == nil:
			w.log.Warn("pruning join records", zap.Error(err))
		case n > 0:
			w.log.Info("pruned join records past their retention", zap.Int("deleted", n), zap.Duration("retention", keep))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		}
	}
}
