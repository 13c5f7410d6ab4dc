package cli

import (
	"errors"
	"fmt"

	"github.com/spf13/pflag"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// ErrNoKubeconfig is returned by a command that talks to a cluster when no kubeconfig names one:
// no --kubeconfig, no KUBECONFIG and no ~/.kube/config.
var ErrNoKubeconfig = errors.New("no kubeconfig: pass --kubeconfig FILE, set KUBECONFIG (for berth mini: export KUBECONFIG=/var/lib/berth-mini/admin.conf) or write ~/.kube/config")

// kubeOptions are the flags of every command that talks to a cluster. The kubeconfig is found as
// kubectl finds it (client-go's loading rules): --kubeconfig when given, else the files listed in
// KUBECONFIG (merged, the first file to set a value wins), else ~/.kube/config; --context picks a
// context other than the current-context.
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
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = k.kubeconfig
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: k.context})
	cfg, err := cc.ClientConfig()
	switch {
	case err == nil:
		return cfg, nil
	case clientcmd.IsEmptyConfig(err):
		return nil, &exitError{code: exitUsage, err: ErrNoKubeconfig}
	}
	return nil, &exitError{code: exitUsage, err: fmt.Errorf("loading kubeconfig: %w", err)}
}
