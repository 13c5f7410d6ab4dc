// Package k8sversion owns the table of Kubernetes versions Berth builds and runs: for each supported
// minor, the exact Kubernetes release and the etcd, CoreDNS and pause versions that release's kubeadm
// names itself. The table is versions.tsv beside this file; scripts/build-k8s.sh reads the same file,
// so the build, the mini cluster and the CLI agree on what "supported" means.
package k8sversion

import (
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

//go:embed versions.tsv
var table string

// ErrUnsupported is returned for a Kubernetes version Berth does not build.
var ErrUnsupported = errors.New("unsupported Kubernetes version")

// Release is one supported Kubernetes release with the component versions its kubeadm names.
type Release struct {
	// Kubernetes is the exact version, "v1.37.2".
	Kubernetes string
	// Etcd is etcd's version without the "v" and without the image's "-0" revision, "3.7.0".
	Etcd string
	// CoreDNS is CoreDNS's tag, "v1.14.6".
	CoreDNS string
	// Pause is the pause image's tag, "3.10.2".
	Pause string
}

// Minor is the release's minor version, "v1.37" for "v1.37.2".
func (r Release) Minor() string {
	return r.Kubernetes[:strings.LastIndexByte(r.Kubernetes, '.')]
}

// Images are the image references kubeadm uses for a release (registry.k8s.io, its default).
type Images struct {
	Pause, Etcd, CoreDNS                                           string
	KubeAPIServer, KubeControllerManager, KubeScheduler, KubeProxy string
}

// Images returns the image references the release's kubeadm names.
func (r Release) Images() Images {
	const reg = "registry.k8s.io/"
	return Images{
		Pause:                 reg + "pause:" + r.Pause,
		Etcd:                  reg + "etcd:" + r.Etcd + "-0",
		CoreDNS:               reg + "coredns/coredns:" + r.CoreDNS,
		KubeAPIServer:         reg + "kube-apiserver:" + r.Kubernetes,
		KubeControllerManager: reg + "kube-controller-manager:" + r.Kubernetes,
		KubeScheduler:         reg + "kube-scheduler:" + r.Kubernetes,
		KubeProxy:             reg + "kube-proxy:" + r.Kubernetes,
	}
}

// releases is the parsed table, the default first.
var releases = mustParse(table)

// Supported returns the supported releases, the default first, newest minor first.
func Supported() []Release {
	return append([]Release(nil), releases...)
}

// Default returns the release Berth runs when no version is asked for.
func Default() Release { return releases[0] }

// Lookup returns the supported release v names: its exact version ("v1.36.3") or its minor
// ("v1.36"). "" is the default. Anything else is ErrUnsupported, with the supported versions named.
func Lookup(v string) (Release, error) {
	if v == "" {
		return Default(), nil
	}
	for _, r := range releases {
		if v == r.Kubernetes || v == r.Minor() {
			return r, nil
		}
	}
	return Release{}, fmt.Errorf("kubernetes version %q; supported: %s (or their minors %s): %w",
		v, strings.Join(names(Release.String), ", "), strings.Join(names(Release.Minor), ", "), ErrUnsupported)
}

// String is the release's exact Kubernetes version.
func (r Release) String() string { return r.Kubernetes }

// SupportedList is the supported versions for help text, "v1.37.2 (default), v1.36.3".
func SupportedList() string {
	l := names(Release.String)
	l[0] += " (default)"
	return strings.Join(l, ", ")
}

func names(f func(Release) string) []string {
	var out []string
	for _, r := range releases {
		out = append(out, f(r))
	}
	return out
}

// mustParse parses the table; the table is part of the binary, so an error in it is a bug that
// every test of this package catches.
func mustParse(s string) []Release {
	rs, err := parse(s)
	if err != nil {
		panic(err)
	}
	return rs
}

// parse reads the table: comment lines start with "#", every other non-empty line is
// "kubernetes<TAB>etcd<TAB>coredns<TAB>pause". Versions must be well-formed and minors unique.
func parse(s string) ([]Release, error) {
	var rs []Release
	seen := map[string]bool{}
	for i, line := range strings.Split(s, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Split(line, "\t")
		if len(f) != 4 {
			return nil, fmt.Errorf("versions.tsv line %d: want 4 tab-separated fields, got %d", i+1, len(f))
		}
		r := Release{Kubernetes: f[0], Etcd: f[1], CoreDNS: f[2], Pause: f[3]}
		for _, c := range []struct {
			name, v string
			prefix  string
			parts   int
		}{{"kubernetes", r.Kubernetes, "v1.", 2}, {"etcd", r.Etcd, "", 3}, {"coredns", r.CoreDNS, "v", 3}, {"pause", r.Pause, "", 2}} {
			if !wellFormed(c.v, c.prefix, c.parts) {
				return nil, fmt.Errorf("versions.tsv line %d: malformed %s version %q", i+1, c.name, c.v)
			}
		}
		if seen[r.Minor()] {
			return nil, fmt.Errorf("versions.tsv line %d: a second row for %s", i+1, r.Minor())
		}
		seen[r.Minor()] = true
		rs = append(rs, r)
	}
	if len(rs) == 0 {
		return nil, errors.New("versions.tsv: no release")
	}
	return rs, nil
}

// wellFormed reports whether v is prefix followed by at least parts dot-separated decimal numbers
// (and at most three numbers in all).
func wellFormed(v, prefix string, parts int) bool {
	rest, ok := strings.CutPrefix(v, prefix)
	if !ok {
		return false
	}
	nums := strings.Split(rest, ".")
	if len(nums) < parts || len(nums)+strings.Count(prefix, ".") > 3 {
		return false
	}
	for _, n := range nums {
		if _, err := strconv.ParseUint(n, 10, 16); err != nil || n == "" || (len(n) > 1 && n[0] == '0') {
			return false
		}
	}
	return true
}
