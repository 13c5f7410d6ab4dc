// Package prereq ends a test whose prerequisite is missing (a binary, root, a device, a kernel
// feature, the Kubernetes binaries): it skips and says what is missing, except under CI=true, where
// nothing may skip silently and the test fails instead. Every test harness routes its missing
// prerequisites through Missing; skips that select tests (a load test run by its own make target)
// are not prerequisites and stay plain skips, which scripts/test.sh lists at the end of a run.
package prereq

import (
	"fmt"
	"os"
	"testing"
)

// CIEnv is the environment variable that makes a missing prerequisite fail: CI=true, as CI sets it.
const CIEnv = "CI"

// Strict reports whether a missing prerequisite fails the test (CI=true) instead of skipping it.
func Strict() bool { return os.Getenv(CIEnv) == "true" }

// Missing ends tb because a prerequisite is missing, described by format and args: tb.Skip, or
// tb.Fatal under CI=true.
func Missing(tb testing.TB, format string, args ...any) {
	tb.Helper()
	msg := fmt.Sprintf(format, args...)
	if Strict() {
		tb.Fatalf("prerequisite missing, and CI=true fails instead of skipping: %s", msg)
	}
	tb.Skip(msg)
}
