// Package version holds the build version stamped into every Berth binary by the linker.
package version

// Version is set with -ldflags "-X github.com/berth-k8s/berth/internal/version.Version=...".
var Version = "dev"
