package nodelock

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/spf13/afero"
)

type countingMarker struct {
	marks atomic.Int32
	err   error
}

func (c *countingMarker) MarkBootstrapped(context.Context, []byte) error {
	c.marks.Add(1)
	return c.err
}

func (c *countingMarker) Bootstrapped(context.Context) (bool, error) { return c.marks.Load() > 0, nil }

func TestTryLockOnceExactlyOneWinner(t *testing.T) {
	const lockers = 64
	counter := &countingMarker{}
	fsys := afero.NewMemMapFs()
	file := NewFileMarker(fsys, "/var/lib/berth/bootstrapped")
	lock := New(counter, file)

	var wins atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range lockers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			owner := "join"
			if i%2 == 0 {
				owner = "init"
			}
			err := lock.TryLockOnce(context.Background(), owner, []byte{0xca, 0xfe})
			switch {
			case err == nil:
				wins.Add(1)
			case !errors.Is(err, ErrLocked):
				t.Errorf("TryLockOnce() = %v, want nil or ErrLocked", err)
			}
		}()
	}
	close(start)
	wg.Wait()

	if got := wins.Load(); got != 1 {
		t.Fatalf("winners = %d, want 1", got)
	}
	if got := counter.marks.Load(); got != 1 {
		t.Fatalf("marker calls = %d, want 1", got)
	}
	id, err := file.ClusterID()
	if err != nil {
		t.Fatalf("ClusterID() = %v", err)
	}
	if string(id) != "\xca\xfe" {
		t.Fatalf("ClusterID() = %x, want cafe", id)
	}
	if locked, _ := lock.Locked(); !locked {
		t.Fatal("Locked() = false after a win")
	}
}

func TestBootstrappedSurvivesRestart(t *testing.T) {
	fsys := afero.NewMemMapFs()
	first := New(NewFileMarker(fsys, "/state/bootstrapped"))
	ctx := context.Background()
	if ok, err := first.Bootstrapped(ctx); err != nil || ok {
		t.Fatalf("fresh Bootstrapped() = %v, %v; want false, nil", ok, err)
	}
	if err := first.TryLockOnce(ctx, "init", []byte("id")); err != nil {
		t.Fatalf("TryLockOnce() = %v", err)
	}
	// A new process on the same disk.
	second := New(NewFileMarker(fsys, "/state/bootstrapped"))
	if ok, err := second.Bootstrapped(ctx); err != nil || !ok {
		t.Fatalf("Bootstrapped() after restart = %v, %v; want true, nil", ok, err)
	}
	// The marker refuses to be written twice, even by a new lock.
	if err := second.TryLockOnce(ctx, "join", []byte("other")); err == nil {
		t.Fatal("second TryLockOnce() on a marked node succeeded")
	}
}

func TestMarkerFailureKeepsLockTaken(t *testing.T) {
	lock := New(&countingMarker{err: errors.New("tpm gone")})
	ctx := context.Background()
	if err := lock.TryLockOnce(ctx, "init", []byte("id")); err == nil {
		t.Fatal("TryLockOnce() with failing marker = nil")
	}
	if err := lock.TryLockOnce(ctx, "join", []byte("id")); !errors.Is(err, ErrLocked) {
		t.Fatalf("TryLockOnce() after failed mark = %v, want ErrLocked", err)
	}
}

func TestFileMarkerReadOnlyDisk(t *testing.T) {
	m := NewFileMarker(afero.NewReadOnlyFs(afero.NewMemMapFs()), "/state/bootstrapped")
	if err := m.MarkBootstrapped(context.Background(), []byte("id")); err == nil {
		t.Fatal("MarkBootstrapped() on read-only disk = nil")
	}
}
