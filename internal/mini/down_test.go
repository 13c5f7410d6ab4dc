package mini

import (
	"errors"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

// The retries run in a synctest bubble: their delays pass in the bubble's time.
func TestRmdirRetry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		calls := 0
		busyTwice := func(string) error {
			if calls++; calls <= 2 {
				return syscall.EBUSY
			}
			return nil
		}
		start := time.Now()
		if err := rmdirRetry(busyTwice, "/cg/node-1"); err != nil || calls != 3 {
			t.Fatalf("rmdirRetry = %v after %d calls, want nil after 3", err, calls)
		}
		if took := time.Since(start); took != 2*rmdirDelay {
			t.Fatalf("two retries took %s, want %s", took, 2*rmdirDelay)
		}

		calls = 0
		alwaysBusy := func(string) error { calls++; return syscall.EBUSY }
		if err := rmdirRetry(alwaysBusy, "/cg/node-1"); !errors.Is(err, syscall.EBUSY) || calls != rmdirTries {
			t.Fatalf("rmdirRetry = %v after %d calls, want EBUSY after %d", err, calls, rmdirTries)
		}
	})
}
