package clusterconfig

import (
	"sync"

	"k8s.io/apimachinery/pkg/util/version"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"

	// The Kubernetes components' feature gates: importing the package registers them (and the API
	// server's, apiextensions' and client-go's) in utilfeature's gate.
	_ "k8s.io/kubernetes/pkg/features"
)

// knownGates are the feature gates the Kubernetes components of the pinned k8s.io/kubernetes
// module know (the list kube-apiserver, the kubelet and the others check their --feature-gates
// against), with the specs that say from which version each exists.
var knownGates = sync.OnceValue(func() map[featuregate.Feature]featuregate.VersionedSpecs {
	gates := utilfeature.DefaultMutableFeatureGate.GetAllVersioned()
	// The logging gates every component adds in its main.
	logs := featuregate.NewFeatureGate()
	if err := logsapi.AddFeatureGates(logs); err == nil {
		for name, specs := range logs.GetAllVersioned() {
			gates[name] = specs
		}
	}
	return gates
})

// gateKnown says whether Kubernetes at kubernetesVersion (v1.MINOR.PATCH) knows the feature gate
// name: a gate of the pinned module whose first spec is not newer than that minor. A gate the
// pinned module no longer lists is unknown, also for an older minor that still had it.
func gateKnown(name, kubernetesVersion string) bool {
	specs, ok := knownGates()[featuregate.Feature(name)]
	if !ok {
		return false
	}
	v, err := version.ParseGeneric(kubernetesVersion)
	if err != nil || len(specs) == 0 || specs[0].Version == nil {
		return true
	}
	first := specs[0].Version
	for _, s := range specs {
		if s.Version != nil && s.Version.LessThan(first) {
			first = s.Version
		}
	}
	minor := version.MajorMinor(v.Major(), v.Minor())
	return first.LessThan(minor) || first.EqualTo(minor)
}
