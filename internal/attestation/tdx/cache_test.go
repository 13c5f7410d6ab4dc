package tdx

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/edgelesssys/go-tdx-qpl/blobs"
)

// countingGetter counts upstream calls and can fail.
type countingGetter struct {
	calls atomic.Int32
	col   *Collateral
	err   error
}

func (c *countingGetter) GetCollateral(context.Context, CollateralRequest) (*Collateral, error) {
	c.calls.Add(1)
	return c.col, c.err
}

var sampleRequest = CollateralRequest{CA: PCKCAPlatform, FMSPC: "00806f050000"}

func TestCachingGetter(t *testing.T) {
	ctx := context.Background()
	now := sampleNow
	clock := func() time.Time { return now }
	up := &countingGetter{col: sampleCollateral()}
	dir := t.TempDir()
	g := NewCachingGetter(CachingGetterConfig{Upstream: up, Dir: dir, MaxAge: time.Hour, Now: clock})

	if _, err := g.GetCollateral(ctx, sampleRequest); err != nil {
		t.Fatalf("GetCollateral() = %v", err)
	}
	if _, err := g.GetCollateral(ctx, sampleRequest); err != nil {
		t.Fatal(err)
	}
	if n := up.calls.Load(); n != 1 {
		t.Errorf("upstream calls after two gets = %d, want 1", n)
	}

	// Older than MaxAge: refetched.
	now = now.Add(2 * time.Hour)
	if _, err := g.GetCollateral(ctx, sampleRequest); err != nil {
		t.Fatal(err)
	}
	if n := up.calls.Load(); n != 2 {
		t.Errorf("upstream calls after expiry = %d, want 2", n)
	}

	// Upstream down: the stale entry is served.
	now = now.Add(2 * time.Hour)
	up.err = errors.New("unreachable")
	if col, err := g.GetCollateral(ctx, sampleRequest); err != nil || col == nil {
		t.Errorf("GetCollateral() with upstream down = %v, want the cached collateral", err)
	}

	// A cache-only getter on the same directory serves offline, and a verifier accepts what it serves.
	offline := NewCachingGetter(CachingGetterConfig{Dir: dir, Now: clock})
	v, err := NewVerifier(VerifierConfig{Roots: IntelSGXRootCA(), Collateral: offline, Now: func() time.Time { return sampleNow }})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.VerifyQuote(ctx, blobs.TDXQuote()); err != nil {
		t.Errorf("VerifyQuote() with collateral from the disk cache = %v", err)
	}
	other := CollateralRequest{CA: PCKCAProcessor, FMSPC: "00806f050000"}
	if _, err := offline.GetCollateral(ctx, other); !errors.Is(err, ErrCollateralNotCached) {
		t.Errorf("GetCollateral(uncached) offline = %v, want %v", err, ErrCollateralNotCached)
	}
	if _, err := g.GetCollateral(ctx, CollateralRequest{CA: "platform", FMSPC: "../../etc"}); err == nil {
		t.Error("GetCollateral(path-like FMSPC) = nil error")
	}
}

func TestCachingGetterRejectsUnparsableUpstream(t *testing.T) {
	bad := sampleCollateral()
	bad.TCBInfo = []byte("not json")
	g := NewCachingGetter(CachingGetterConfig{Upstream: &countingGetter{col: bad}, Dir: t.TempDir()})
	if _, err := g.GetCollateral(context.Background(), sampleRequest); err == nil {
		t.Fatal("GetCollateral() of unparsable collateral = nil error")
	}
}

func TestCachingGetterConcurrentMisses(t *testing.T) {
	up := &countingGetter{col: sampleCollateral()}
	g := NewCachingGetter(CachingGetterConfig{Upstream: up, Now: func() time.Time { return sampleNow }})
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := g.GetCollateral(context.Background(), sampleRequest); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := up.calls.Load(); n < 1 || n > 8 {
		t.Errorf("upstream calls = %d", n)
	}
}

func TestStoreCollateral(t *testing.T) {
	dir := t.TempDir()
	if err := StoreCollateral(dir, sampleRequest, sampleCollateral(), sampleNow); err != nil {
		t.Fatalf("StoreCollateral() = %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "tdx-collateral-platform-00806f050000.json")); err != nil {
		t.Fatalf("cache file: %v", err)
	}
	g := NewCachingGetter(CachingGetterConfig{Dir: dir, Now: func() time.Time { return sampleNow }})
	if _, err := g.GetCollateral(context.Background(), sampleRequest); err != nil {
		t.Errorf("GetCollateral() from seeded cache = %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tdx-collateral-processor-00806f050000.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := g.GetCollateral(context.Background(), CollateralRequest{CA: PCKCAProcessor, FMSPC: "00806f050000"}); !errors.Is(err, ErrCollateralNotCached) {
		t.Errorf("GetCollateral() of a corrupt cache file = %v, want %v", err, ErrCollateralNotCached)
	}
}
