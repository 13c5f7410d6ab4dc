package podstop

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/berth-k8s/berth/bootstrapper/podstop/podstoptest"
)

func stopAll(t *testing.T, endpoint string) (int, *observer.ObservedLogs, error) {
	t.Helper()
	rt, closeConn, err := Dial(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = closeConn() }()
	core, logs := observer.New(zap.InfoLevel)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	n, err := StopAll(ctx, rt, zap.New(core))
	return n, logs, err
}

// TestStopAll stops and removes every sandbox a real gRPC CRI server lists, through Dial's client.
func TestStopAll(t *testing.T) {
	s := &podstoptest.Runtime{Sandboxes: []string{"a", "b", "c"}}
	n, logs, err := stopAll(t, podstoptest.Serve(t, s))
	if err != nil || n != 3 {
		t.Fatalf("StopAll = %d, %v; want 3, nil", n, err)
	}
	if left := s.Left(); len(left) != 0 {
		t.Errorf("sandboxes left: %v", left)
	}
	if got := logs.FilterMessage("pod sandbox stopped and removed").Len(); got != 3 {
		t.Errorf("%d sandboxes logged as removed, want 3", got)
	}
}

// TestStopAllRefused: a sandbox that refuses to stop is reported by ID, logged, not removed, and
// does not keep the others from being stopped and removed.
func TestStopAllRefused(t *testing.T) {
	s := &podstoptest.Runtime{Sandboxes: []string{"a", "stuck", "c"}, Refuse: map[string]bool{"stuck": true}}
	n, logs, err := stopAll(t, podstoptest.Serve(t, s))
	if err == nil {
		t.Fatal("StopAll reported no error for a sandbox that refused to stop")
	}
	if n != 2 || !strings.Contains(err.Error(), "stopping pod sandbox stuck") || !strings.Contains(err.Error(), "1 of 3") {
		t.Errorf("StopAll = %d, %v; want 2 and an error naming sandbox stuck", n, err)
	}
	if left := s.Left(); !slices.Equal(left, []string{"stuck"}) {
		t.Errorf("sandboxes left: %v, want [stuck]", left)
	}
	if logs.FilterMessage("stopping a pod sandbox failed").Len() != 1 {
		t.Errorf("the refusal was not logged: %v", logs.All())
	}
}

// TestStopAllNoRuntime: a runtime that does not answer is an error, not zero sandboxes.
func TestStopAllNoRuntime(t *testing.T) {
	_, _, err := stopAll(t, "unix://"+filepath.Join(t.TempDir(), "absent.sock"))
	if err == nil || !strings.Contains(err.Error(), "listing the pod sandboxes") {
		t.Fatalf("StopAll without a runtime = %v, want a listing error", err)
	}
}

func TestDialNotUnix(t *testing.T) {
	if _, _, err := Dial("tcp://127.0.0.1:1"); !errors.Is(err, ErrNotUnix) {
		t.Fatalf("Dial(tcp) = %v, want ErrNotUnix", err)
	}
}
