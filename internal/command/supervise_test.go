package command

import (
	"context"
	"errors"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

// superviseGaps runs a Supervise in a synctest bubble whose child runs for runFor(i) (in the bubble's
// time) on its i-th start and then exits with an error, until the child was started n times. It
// returns the gaps between the end of one run and the next start, and the waits Restarting was
// told.
func superviseGaps(t *testing.T, n int, runFor func(i int) time.Duration) (gaps, told []time.Duration) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		var ended time.Time
		i := 0
		err := Supervise(ctx, Supervised{
			Run: func(ctx context.Context) error {
				if i > 0 {
					gaps = append(gaps, time.Since(ended))
				}
				if i++; i == n {
					cancel()
					return nil
				}
				select {
				case <-ctx.Done():
				case <-time.After(runFor(i - 1)):
				}
				ended = time.Now()
				return errors.New("exit status 1")
			},
			Restarting: func(_ error, wait time.Duration) { told = append(told, wait) },
		})
		if err != nil {
			t.Fatalf("Supervise() = %v, want nil once ctx ended", err)
		}
	})
	return gaps, told
}

func TestSuperviseRestartWaits(t *testing.T) {
	gaps, told := superviseGaps(t, 7, func(int) time.Duration { return 0 })
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second, 10 * time.Second}
	if !slices.Equal(gaps, want) {
		t.Errorf("waits between restarts = %v, want %v", gaps, want)
	}
	if !slices.Equal(told, want) {
		t.Errorf("Restarting was told %v, want %v", told, want)
	}
}

func TestSuperviseStartsOverAfterALongRun(t *testing.T) {
	// Three quick exits, a run of a minute (not longer: no reset), one of a minute and a second
	// (reset), then quick exits again.
	runs := []time.Duration{0, 0, 0, time.Minute, 0, time.Minute + time.Second, 0, 0}
	gaps, _ := superviseGaps(t, len(runs)+1, func(i int) time.Duration { return runs[i] })
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second,
		time.Second, 2 * time.Second, 4 * time.Second}
	if !slices.Equal(gaps, want) {
		t.Errorf("waits between restarts = %v, want %v", gaps, want)
	}
}

func TestSupervisePermanentStops(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		errStart := errors.New("no such binary")
		runs := 0
		err := Supervise(t.Context(), Supervised{Run: func(context.Context) error {
			if runs++; runs < 3 {
				return errors.New("exit status 1")
			}
			return Permanent(errStart)
		}})
		var perm *PermanentError
		if !errors.Is(err, errStart) || errors.As(err, &perm) {
			t.Fatalf("Supervise() = %#v, want %v itself", err, errStart)
		}
		if runs != 3 {
			t.Fatalf("child ran %d times, want 3", runs)
		}
	})
	if Permanent(nil) != nil {
		t.Error("Permanent(nil) != nil")
	}
	var perm *PermanentError
	if err := Permanent(context.Canceled); !errors.As(err, &perm) || !errors.Is(err, context.Canceled) {
		t.Errorf("Permanent(err) = %#v, want a *PermanentError that wraps err", err)
	}
}

func TestSuperviseStopsWhenCtxEnds(t *testing.T) {
	t.Run("while waiting to restart", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			runs := 0
			go func() {
				done <- Supervise(ctx, Supervised{Run: func(context.Context) error {
					runs++
					return errors.New("exit status 1")
				}})
			}()
			synctest.Wait() // the child exited once and Supervise waits to restart it
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Supervise() = %v, want nil", err)
			}
			if runs != 1 {
				t.Fatalf("child ran %d times, want 1", runs)
			}
		})
	})
	t.Run("a run's error after ctx ended counts as a stop", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			err := Supervise(ctx, Supervised{Run: func(context.Context) error {
				cancel()
				return Permanent(errors.New("killed"))
			}})
			if err != nil {
				t.Fatalf("Supervise() = %v, want nil", err)
			}
		})
	})
}

func TestSuperviseReady(t *testing.T) {
	t.Run("its time is not run time", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var told []time.Duration
			readies, runs := 0, 0
			err := Supervise(ctx, Supervised{
				Ready: func(ctx context.Context) error {
					readies++
					select { // the child's files come only after two minutes each time
					case <-ctx.Done():
					case <-time.After(2 * time.Minute):
					}
					return ctx.Err()
				},
				Run: func(context.Context) error {
					if runs++; runs == 4 {
						cancel()
					}
					return errors.New("exit status 1")
				},
				Restarting: func(_ error, wait time.Duration) { told = append(told, wait) },
			})
			if err != nil {
				t.Fatalf("Supervise() = %v, want nil", err)
			}
			if readies != 4 || runs != 4 {
				t.Fatalf("Ready called %d times and Run %d times, want 4 each", readies, runs)
			}
			if want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second}; !slices.Equal(told, want) {
				t.Fatalf("restart waits = %v, want %v (waiting in Ready is no healthy run)", told, want)
			}
		})
	})
	t.Run("its error ends Supervise", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			errConfig := errors.New("unreadable config")
			err := Supervise(t.Context(), Supervised{
				Ready: func(context.Context) error { return errConfig },
				Run:   func(context.Context) error { t.Fatal("Run called although Ready failed"); return nil },
			})
			if !errors.Is(err, errConfig) {
				t.Fatalf("Supervise() = %v, want %v", err, errConfig)
			}
		})
	})
	t.Run("ctx ending in it is a stop", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			err := Supervise(ctx, Supervised{
				Ready: func(ctx context.Context) error { return ctx.Err() },
				Run:   func(context.Context) error { t.Fatal("Run called although ctx ended"); return nil },
			})
			if err != nil {
				t.Fatalf("Supervise() = %v, want nil", err)
			}
		})
	})
}
