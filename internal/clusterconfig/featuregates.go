package clusterconfig

import (
	_ "embed"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/util/version"
)

// featureGatesTable lists the feature gates the Kubernetes components of the pinned
// k8s.io/kubernetes module know (its own, the API server's, apiextensions', client-go's and the
// logging gates every component adds), one a line: the name, a tab, the minor that introduced it.
// It is generated from that module (TestReferenceCurrent; `make clusterconfig-docs`), so that
// Berth's binaries check gate names without importing the module's feature registry, whose import
// would rewire client-go's own feature gates.
//
//go:embed featuregates.tsv
var featureGatesTable string

// knownGates is featureGatesTable by name.
var knownGates = sync.OnceValue(func() map[string]*version.Version {
	gates := map[string]*version.Version{}
	for _, line := range strings.Split(featureGatesTable, "\n") {
		name, since, ok := strings.Cut(line, "\t")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		gates[name] = version.MustParseGeneric(since)
	}
	return gates
})

// gateKnown says whether Kubernetes at kubernetesVersion (v1.MINOR.PATCH) knows the feature gate
// name: a gate of the pinned module introduced in that minor or before. A gate the pinned module
// no longer lists is unknown, also for an older minor that still had it.
func gateKnown(name, kubernetesVersion string) bool {
	since, ok := knownGates()[name]
	if !ok {
		return false
	}
	v, err := version.ParseGeneric(kubernetesVersion)
	if err != nil {
		return true // kubernetesVersion's own error says what is wrong
	}
	return !version.MajorMinor(v.Major(), v.Minor()).LessThan(since)
}
