package cli

import (
	"errors"
	"fmt"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/kubeclient"
	"github.com/berth-k8s/berth/internal/records/clientset"
)

// ErrNoKubeconfig is returned by a command that talks to a cluster when no kubeconfig names one:
// no --kubeconfig, no KUBECONFIG and no ~/.kube/config.
var ErrNoKubeconfig = errors.New("no kubeconfig: pass --kubeconfig FILE, set KUBECONFIG (for berth mini: export KUBECONFIG=/var/lib/berth-mini/admin.conf) or write ~/.kube/config")

// kubeOptions are the flags of every command that talks to a cluster. The kubeconfig is found as
// kubectl finds it (kubeclient.Load): --kubeconfig when given, else the files listed in KUBECONFIG
// (merged, the first file to set a value wins), else ~/.kube/config; --context picks a context
// other than the current-context.
type kubeOptions struct {
	kubeconfig string
	context    string
}

func (k *kubeOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&k.kubeconfig, clientcmd.RecommendedConfigPathFlag, "", "kubeconfig file (default: the files in $KUBECONFIG, else ~/.kube/config)")
	fs.StringVar(&k.context, "context", "", "kubeconfig context to use (default: the kubeconfig's current-context)")
}

// restConfig loads the kubeconfig. Every failure is one of the operator's input (exit code 2):
// nothing has been sent yet.
func (k *kubeOptions) restConfig() (*rest.Config, error) {
	cfg, err := kubeclient.Load(k.kubeconfig, k.context)
	switch {
	case err == nil:
		return cfg, nil
	case errors.Is(err, kubeclient.ErrNoConfig):
		return nil, &exitError{code: exitUsage, err: ErrNoKubeconfig}
	}
	return nil, &exitError{code: exitUsage, err: fmt.Errorf("loading kubeconfig: %w", err)}
}

// nodeClients returns a client for the kubeconfig the flags name, and a function returning one that
// impersonates a node's kubelet (system:node:NAME in system:nodes) with the same credentials.
func (k *kubeOptions) nodeClients() (kubernetes.Interface, func(node string) (kubernetes.Interface, error), error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, nil, err
	}
	client, err := kubeclient.Clientset(cfg)
	if err != nil {
		return nil, nil, err
	}
	asNode := func(node string) (kubernetes.Interface, error) {
		c := rest.CopyConfig(cfg)
		c.Impersonate = rest.ImpersonationConfig{UserName: berthsystem.NodeUserPrefix + node, Groups: []string{"system:nodes", "system:authenticated"}}
		return kubeclient.Clientset(c)
	}
	return client, asNode, nil
}

// client returns a Kubernetes client for the kubeconfig the flags name.
func (k *kubeOptions) client() (kubernetes.Interface, error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, err
	}
	return kubeclient.Clientset(cfg)
}

// clients returns a Kubernetes client and the record API's client for the kubeconfig the flags
// name.
func (k *kubeOptions) clients() (kubernetes.Interface, clientset.Interface, error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, nil, err
	}
	return clientsFor(cfg)
}

// clientsFor returns a Kubernetes client and the record API's client for cfg.
func clientsFor(cfg *rest.Config) (kubernetes.Interface, clientset.Interface, error) {
	client, err := kubeclient.Clientset(cfg)
	if err != nil {
		return nil, nil, err
	}
	rc, err := clientset.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("creating the record API's client: %w", err)
	}
	return client, rc, nil
}
