package clusterconfig

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// The configuration in force is kept in a ConfigMap beside kubeadm's own kubeadm-config, as the
// versioned document: readers decode it with the same strict decoding as a file, and a later
// version of Berth converts it when it reads it.
const (
	// ConfigMapNamespace is the namespace of ConfigMapName.
	ConfigMapNamespace = joinconfig.ClusterConfigNamespace
	// ConfigMapName names the ConfigMap holding the configuration in force.
	ConfigMapName = joinconfig.ClusterConfigName
	// ConfigMapKey is the key of the versioned document in ConfigMapName.
	ConfigMapKey = "ClusterConfiguration"
)

// InCluster returns c without what only the operator's machine means: the init secret and the
// paths of the files `berth init` reads. It is what the cluster stores and what `berth config
// diff` compares.
func (c ClusterConfiguration) InCluster() ClusterConfiguration {
	c.InitSecret, c.InitSecretFile = "", ""
	c.Policies = Policies{}
	return c
}

// ConfigMap returns the ConfigMap that keeps c (as InCluster) in force.
func ConfigMap(c ClusterConfiguration) (*corev1.ConfigMap, error) {
	data, err := Marshal(c.InCluster())
	if err != nil {
		return nil, err
	}
	return &corev1.ConfigMap{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ConfigMapNamespace, Name: ConfigMapName,
			Labels: map[string]string{"app.kubernetes.io/part-of": "berth", "app.kubernetes.io/managed-by": "berth-bootstrapper"},
		},
		Data: map[string]string{ConfigMapKey: string(data)},
	}, nil
}

// FromConfigMap reads the configuration a ConfigMapName holds, strictly and validated.
func FromConfigMap(cm *corev1.ConfigMap) (ClusterConfiguration, error) {
	doc, ok := cm.Data[ConfigMapKey]
	if !ok {
		return ClusterConfiguration{}, fmt.Errorf("%w: ConfigMap %s/%s has no key %s", ErrInvalid, cm.Namespace, cm.Name, ConfigMapKey)
	}
	c, _, err := Parse([]byte(doc))
	return c, err
}
