// Package s3test runs a real S3-compatible object store for tests: versitygw (Apache-2.0) with its
// posix backend in the test's temporary directory, on loopback, from the build that
// `scripts/build-k8s.sh versitygw` caches under /var/cache/berth (or BERTH_VERSITYGW_BIN).
package s3test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/prereq"
	"github.com/berth-k8s/berth/internal/proctest"
)

// dirGlob matches the cached build's directory.
const dirGlob = "versitygw-v1.8.0-*"

// Binary returns the versitygw binary, or why there is none.
func Binary() (string, error) {
	if dir := os.Getenv("BERTH_VERSITYGW_BIN"); dir != "" {
		return filepath.Join(dir, "versitygw"), nil
	}
	cache := os.Getenv("BERTH_CACHE")
	if cache == "" {
		cache = "/var/cache/berth"
	}
	dirs, _ := filepath.Glob(filepath.Join(cache, dirGlob))
	var newest string
	var newestMod time.Time
	for _, d := range dirs {
		st, err := os.Stat(filepath.Join(d, "stamp"))
		if err == nil && (newest == "" || st.ModTime().After(newestMod)) {
			newest, newestMod = filepath.Join(d, "bin", "versitygw"), st.ModTime()
		}
	}
	if newest == "" {
		return "", errors.New("versitygw is not built: run `scripts/build-k8s.sh versitygw` or set BERTH_VERSITYGW_BIN")
	}
	return newest, nil
}

// Start starts an object store for t (stopped in its cleanup) and returns the configuration of a new
// empty bucket in it. Without the binary it ends t through prereq.Missing.
func Start(t testing.TB) backup.S3Config {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		prereq.Missing(t, "%v", err)
	}
	root := t.TempDir()
	gw, sidecar := filepath.Join(root, "gw"), filepath.Join(root, "meta")
	const bucket = "berth-backups"
	for _, d := range []string{filepath.Join(gw, bucket), sidecar} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	cfg := backup.S3Config{Region: "us-east-1", Bucket: bucket, PathStyle: true,
		AccessKey: "berth-test", SecretKey: rand.Text()}
	addr := proctest.FreeAddr(t)
	cfg.Endpoint = "http://" + addr
	p := proctest.Start(t, proctest.Cmd{Name: "versitygw", Path: bin, Grace: 5 * time.Second,
		Args: []string{"--port", addr, "--quiet", "posix", "--sidecar", sidecar, gw},
		Env:  []string{"ROOT_ACCESS_KEY=" + cfg.AccessKey, "ROOT_SECRET_KEY=" + cfg.SecretKey}})
	store, err := backup.NewS3(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := proctest.WaitReady(ctx, 50*time.Millisecond, time.Minute, func(ctx context.Context) error {
		_, err := store.List(ctx)
		return err
	}, p); err != nil {
		t.Fatal(fmt.Errorf("object store: %w", err))
	}
	return cfg
}
