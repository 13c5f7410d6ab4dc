package cli

import (
	"context"
	"fmt"
	"io"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/clusterconfig"
)

// clusterConfigReport is the cluster configuration section of berth status: the version of the
// document the cluster keeps, as it says, so that a version this CLI cannot read still shows.
type clusterConfigReport struct {
	ConfigMap         string `json:"configMap"`
	APIVersion        string `json:"apiVersion"`
	Kind              string `json:"kind"`
	KubernetesVersion string `json:"kubernetesVersion"`
}

// readClusterConfigVersion reads the apiVersion and kind of the configuration the cluster keeps;
// nil when it keeps none.
func readClusterConfigVersion(ctx context.Context, client kubernetes.Interface) (*clusterConfigReport, error) {
	cm, err := client.CoreV1().ConfigMaps(clusterconfig.ConfigMapNamespace).Get(ctx, clusterconfig.ConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the cluster's configuration: %w", err)
	}
	var head struct {
		APIVersion        string `json:"apiVersion"`
		Kind              string `json:"kind"`
		KubernetesVersion string `json:"kubernetesVersion"`
	}
	if err := yaml.Unmarshal([]byte(cm.Data[clusterconfig.ConfigMapKey]), &head); err != nil {
		return nil, fmt.Errorf("reading the cluster's configuration: %w", err)
	}
	return &clusterConfigReport{
		ConfigMap:  clusterconfig.ConfigMapNamespace + "/" + clusterconfig.ConfigMapName,
		APIVersion: head.APIVersion, Kind: head.Kind, KubernetesVersion: head.KubernetesVersion,
	}, nil
}

func printClusterConfig(out io.Writer, r *clusterConfigReport, err error) {
	switch {
	case err != nil:
		_, _ = fmt.Fprintf(out, "\nCluster configuration: %s\n", printable(err.Error()))
	case r == nil:
		_, _ = fmt.Fprintf(out, "\nCluster configuration: none kept (no ConfigMap %s/%s: initialized by an older berth)\n",
			clusterconfig.ConfigMapNamespace, clusterconfig.ConfigMapName)
	default:
		_, _ = fmt.Fprintf(out, "\nCluster configuration: %s %s, Kubernetes %s (ConfigMap %s; berth config show)\n",
			printable(r.APIVersion), printable(r.Kind), printable(r.KubernetesVersion), r.ConfigMap)
	}
}
