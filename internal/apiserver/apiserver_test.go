package apiserver

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestWaitReadyNamesTheLastError(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	err := Waiter{Interval: 10 * time.Millisecond}.WaitReady(ctx, filepath.Join(t.TempDir(), "missing.conf"))
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "loading kubeconfig") {
		t.Fatalf("WaitReady() = %v, want the deadline and the last error", err)
	}
}
