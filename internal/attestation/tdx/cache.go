package tdx

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sync/singleflight"
)

// DefaultCollateralMaxAge bounds how long CachingGetter serves collateral before asking upstream again, even when
// Intel's nextUpdate lies further ahead, so that revocations reach verifiers within a day.
const DefaultCollateralMaxAge = 24 * time.Hour

// CachingGetter serves collateral from memory and, with a directory, from disk, and asks an upstream getter
// only for collateral it lacks or that is stale: older than MaxAge or past its earliest nextUpdate. When
// upstream fails, stale collateral is served (the verifier still rejects collateral that is past its
// nextUpdate). With a nil upstream it serves only what the directory holds, which is how an offline verifier
// runs on pre-fetched collateral. It is safe for concurrent use; concurrent misses for one request share a
// single upstream call.
type CachingGetter struct {
	upstream CollateralGetter
	dir      string
	maxAge   time.Duration
	now      func() time.Time
	log      *zap.Logger

	group singleflight.Group
	mu    sync.Mutex
	mem   map[CollateralRequest]cacheEntry
}

type cacheEntry struct {
	col        *Collateral
	fetched    time.Time
	nextUpdate time.Time
}

// CachingGetterConfig configures a CachingGetter.
type CachingGetterConfig struct {
	// Upstream provides collateral on a miss; nil means cache only.
	Upstream CollateralGetter
	// Dir persists collateral as one file per request; empty means memory only.
	Dir string
	// MaxAge bounds an entry's age; zero means DefaultCollateralMaxAge.
	MaxAge time.Duration
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
	// Log receives cache events; nil means no logging.
	Log *zap.Logger
}

// NewCachingGetter returns a CachingGetter for cfg.
func NewCachingGetter(cfg CachingGetterConfig) *CachingGetter {
	g := &CachingGetter{upstream: cfg.Upstream, dir: cfg.Dir, maxAge: cfg.MaxAge, now: cfg.Now, log: cfg.Log, mem: map[CollateralRequest]cacheEntry{}}
	if g.maxAge == 0 {
		g.maxAge = DefaultCollateralMaxAge
	}
	if g.now == nil {
		g.now = time.Now
	}
	if g.log == nil {
		g.log = zap.NewNop()
	}
	return g
}

// ErrCollateralNotCached: a cache-only getter has no collateral for the request.
var ErrCollateralNotCached = errors.New("collateral not cached")

var fmspcPattern = regexp.MustCompile(`^[0-9a-f]{12}$`)

// GetCollateral implements CollateralGetter.
func (g *CachingGetter) GetCollateral(ctx context.Context, req CollateralRequest) (*Collateral, error) {
	if (req.CA != PCKCAPlatform && req.CA != PCKCAProcessor) || !fmspcPattern.MatchString(req.FMSPC) {
		return nil, fmt.Errorf("getting collateral: invalid request CA %q FMSPC %q", req.CA, req.FMSPC)
	}
	entry, ok := g.lookup(req)
	now := g.now()
	if ok && now.Sub(entry.fetched) < g.maxAge && now.Before(entry.nextUpdate) {
		return entry.col, nil
	}
	if g.upstream == nil {
		if ok {
			return entry.col, nil
		}
		return nil, fmt.Errorf("getting collateral for %s/%s: %w", req.CA, req.FMSPC, ErrCollateralNotCached)
	}
	key := req.CA + "/" + req.FMSPC
	v, err, _ := g.group.Do(key, func() (any, error) {
		col, err := g.upstream.GetCollateral(ctx, req)
		if err != nil {
			return nil, err
		}
		if err := g.store(req, col); err != nil {
			return nil, err
		}
		return col, nil
	})
	if err != nil {
		if ok {
			g.log.Warn("refreshing TDX collateral failed, serving cached collateral", zap.String("fmspc", req.FMSPC), zap.Error(err))
			return entry.col, nil
		}
		return nil, fmt.Errorf("getting collateral for %s/%s: %w", req.CA, req.FMSPC, err)
	}
	return v.(*Collateral), nil
}

// lookup returns the entry from memory, or from disk into memory.
func (g *CachingGetter) lookup(req CollateralRequest) (cacheEntry, bool) {
	g.mu.Lock()
	entry, ok := g.mem[req]
	g.mu.Unlock()
	if ok || g.dir == "" {
		return entry, ok
	}
	entry, err := g.readFile(req)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			g.log.Warn("reading cached TDX collateral failed", zap.String("fmspc", req.FMSPC), zap.Error(err))
		}
		return cacheEntry{}, false
	}
	g.mu.Lock()
	g.mem[req] = entry
	g.mu.Unlock()
	return entry, true
}

// store parses col (refusing collateral that does not even parse) and keeps it in memory and on disk.
func (g *CachingGetter) store(req CollateralRequest, col *Collateral) error {
	parsed, err := col.parse()
	if err != nil {
		return fmt.Errorf("parsing fetched collateral: %w", err)
	}
	entry := cacheEntry{col: col, fetched: g.now(), nextUpdate: parsed.nextUpdate()}
	g.mu.Lock()
	g.mem[req] = entry
	g.mu.Unlock()
	if g.dir != "" {
		if err := g.writeFile(req, entry); err != nil {
			g.log.Warn("persisting TDX collateral failed", zap.String("fmspc", req.FMSPC), zap.Error(err))
		}
	}
	return nil
}

// cacheFile is the on-disk form of one entry, format version 1.
type cacheFile struct {
	Version    int         `json:"version"`
	Fetched    time.Time   `json:"fetched"`
	Collateral *Collateral `json:"collateral"`
}

func (g *CachingGetter) path(req CollateralRequest) string {
	return filepath.Join(g.dir, fmt.Sprintf("tdx-collateral-%s-%s.json", req.CA, req.FMSPC))
}

func (g *CachingGetter) readFile(req CollateralRequest) (cacheEntry, error) {
	b, err := os.ReadFile(g.path(req))
	if err != nil {
		return cacheEntry{}, err
	}
	var f cacheFile
	if err := json.Unmarshal(b, &f); err != nil {
		return cacheEntry{}, fmt.Errorf("decoding collateral cache file: %w", err)
	}
	if f.Version != 1 || f.Collateral == nil {
		return cacheEntry{}, fmt.Errorf("decoding collateral cache file: unsupported version %d", f.Version)
	}
	parsed, err := f.Collateral.parse()
	if err != nil {
		return cacheEntry{}, fmt.Errorf("parsing cached collateral: %w", err)
	}
	return cacheEntry{col: f.Collateral, fetched: f.Fetched, nextUpdate: parsed.nextUpdate()}, nil
}

// writeFile replaces the entry's file atomically.
func (g *CachingGetter) writeFile(req CollateralRequest, e cacheEntry) error {
	b, err := json.Marshal(cacheFile{Version: 1, Fetched: e.fetched, Collateral: e.col})
	if err != nil {
		return fmt.Errorf("encoding collateral: %w", err)
	}
	if err := os.MkdirAll(g.dir, 0o755); err != nil {
		return fmt.Errorf("creating collateral cache directory: %w", err)
	}
	tmp, err := os.CreateTemp(g.dir, ".tdx-collateral-*")
	if err != nil {
		return fmt.Errorf("creating collateral cache file: %w", err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // nothing left to remove once renamed into place
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("writing collateral cache file: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		_ = tmp.Close()
		return fmt.Errorf("syncing collateral cache file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("closing collateral cache file: %w", err)
	}
	if err := os.Rename(tmp.Name(), g.path(req)); err != nil {
		return fmt.Errorf("renaming collateral cache file: %w", err)
	}
	return nil
}

// StoreCollateral writes pre-fetched collateral into a cache directory, for seeding an offline verifier.
func StoreCollateral(dir string, req CollateralRequest, col *Collateral, fetched time.Time) error {
	parsed, err := col.parse()
	if err != nil {
		return fmt.Errorf("storing collateral: %w", err)
	}
	g := NewCachingGetter(CachingGetterConfig{Dir: dir})
	return g.writeFile(req, cacheEntry{col: col, fetched: fetched, nextUpdate: parsed.nextUpdate()})
}
