// Package version holds the build version stamped into every Berth binary by the linker, and the
// commit the Go toolchain stamped into it.
package version

import "runtime/debug"

// Version is set with -ldflags "-X github.com/berth-k8s/berth/internal/version.Version=...".
var Version = "dev"

// Commit is the VCS revision the binary was built from, with "-dirty" when the tree had changes,
// or "unknown" when the build recorded none (go build -buildvcs=false, a build outside a checkout).
func Commit() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	return commitOf(info.Settings)
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
