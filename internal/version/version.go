// Package version holds the build version, commit and date stamped into every Berth binary by the
// linker (the Makefile's LDFLAGS), with the Go toolchain's VCS stamp as the fallback.
package version

import (
	"runtime/debug"
	"time"
)

// Version is set with -ldflags "-X github.com/berth-k8s/berth/internal/version.Version=...".
var Version = "dev"

// GitCommit and BuildDate are set by the Makefile with -X like Version: the commit (with "-dirty"
// when the tree had changes) and the build's date, RFC 3339 in UTC. The build date is the source
// date of reproducible builds: SOURCE_DATE_EPOCH when set, else the commit's date, so that two
// builds of one commit are the same binary. Empty when the build did not set them.
var (
	GitCommit = ""
	BuildDate = ""
)

// Commit is the VCS revision the binary was built from, with "-dirty" when the tree had changes:
// GitCommit when the build set it, else the Go toolchain's VCS stamp, else "unknown" (go build
// -buildvcs=false, a build outside a checkout).
func Commit() string {
	if GitCommit != "" {
		return GitCommit
	}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	return commitOf(info.Settings)
}

// Date is the build date: BuildDate when the build set it, else the commit time of the Go
// toolchain's VCS stamp, else "unknown".
func Date() string {
	if BuildDate != "" {
		return BuildDate
	}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	return dateOf(info.Settings)
}

func commitOf(settings []debug.BuildSetting) string {
	var rev string
	var modified bool
	for _, s := range settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev == "" {
		return "unknown"
	}
	if modified {
		return rev + "-dirty"
	}
	return rev
}

func dateOf(settings []debug.BuildSetting) string {
	for _, s := range settings {
		if s.Key == "vcs.time" {
			if t, err := time.Parse(time.RFC3339, s.Value); err == nil {
				return t.UTC().Format(time.RFC3339)
			}
		}
	}
	return "unknown"
}
