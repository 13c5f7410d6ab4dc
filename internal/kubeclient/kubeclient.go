// Package kubeclient builds the configuration of a Kubernetes client the way each caller finds
// its cluster, always through client-go's loading rules (clientcmd's deferred loading):
//
//   - Load: as kubectl does (the operator CLI): an explicit file, else the files in KUBECONFIG,
//     else ~/.kube/config, with an optional context;
//   - FromFile: exactly one kubeconfig file (the daemons' admin.conf, the mini cluster's admin
//     kubeconfig);
//   - InClusterOrFile: the pod's ServiceAccount when no file is named, else that file (the
//     joinservice).
//
// Timeouts, QPS and Burst stay the caller's: it sets them on the returned rest.Config.
package kubeclient

import (
	"errors"
	"fmt"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// ErrNoConfig is Load's error when no kubeconfig names a cluster: no explicit file, no KUBECONFIG
// and no ~/.kube/config.
var ErrNoConfig = errors.New("no kubeconfig names a cluster")

// ErrNoPath is FromFile's error for an empty path.
var ErrNoPath = errors.New("no kubeconfig path given")

// Load returns the configuration kubectl would use: path when it is not empty, else the files
// listed in KUBECONFIG (merged, the first file to set a value wins), else ~/.kube/config;
// context, when not empty, picks a context other than the current-context. Without any
// kubeconfig it fails with ErrNoConfig; clientcmd's other errors (a missing file, an unknown
// context) are returned as they are.
func Load(path, context string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = path
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: context}).ClientConfig()
	if clientcmd.IsEmptyConfig(err) {
		return nil, ErrNoConfig
	}
	return cfg, err
}

// FromFile returns the configuration of the kubeconfig file at path and nothing else: neither
// KUBECONFIG nor ~/.kube/config is read. clientcmd's errors are returned as they are (they name
// the file); the caller says what it was loading.
func FromFile(path string) (*rest.Config, error) {
	if path == "" {
		return nil, ErrNoPath
	}
	rules := &clientcmd.ClientConfigLoadingRules{ExplicitPath: path}
	return clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
}

// InClusterOrFile returns the in-cluster configuration (the pod's ServiceAccount) when path is
// empty, else FromFile(path).
func InClusterOrFile(path string) (*rest.Config, error) {
	if path == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("loading in-cluster config: %w", err)
		}
		return cfg, nil
	}
	cfg, err := FromFile(path)
	if err != nil {
		return nil, fmt.Errorf("loading kubeconfig: %w", err)
	}
	return cfg, nil
}

// Clientset returns a typed client for cfg.
func Clientset(cfg *rest.Config) (*kubernetes.Clientset, error) {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating Kubernetes client: %w", err)
	}
	return cs, nil
}
