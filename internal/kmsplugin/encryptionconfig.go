package kmsplugin

import (
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"sigs.k8s.io/yaml"
)

// EncryptedResources are the resources the API server encrypts through the plugin. Secrets hold
// every credential of the cluster, Berth's cluster Secret (the master secret) among them. None of
// Berth's ConfigMaps holds a key (the join configuration is public, the ledger holds join attempts,
// berth-kms only generation numbers), so ConfigMaps stay unencrypted.
var EncryptedResources = []string{"secrets"}

// requestTimeout is the API server's timeout for each call to the plugin.
const requestTimeout = 3 * time.Second

// EncryptionConfig renders the API server's EncryptionConfiguration: EncryptedResources through the
// KMS v2 provider ProviderName at socket, and no other provider. There is no identity provider to
// read unencrypted values: encryption is on from the API server's first start, so a plaintext Secret
// in etcd was put there by something other than the API server and is refused.
func EncryptionConfig(socket string) ([]byte, error) {
	cfg := apiserverv1.EncryptionConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: apiserverv1.SchemeGroupVersion.String(), Kind: "EncryptionConfiguration"},
		Resources: []apiserverv1.ResourceConfiguration{{
			Resources: EncryptedResources,
			Providers: []apiserverv1.ProviderConfiguration{{KMS: &apiserverv1.KMSConfiguration{
				APIVersion: "v2",
				Name:       ProviderName,
				Endpoint:   "unix://" + socket,
				Timeout:    &metav1.Duration{Duration: requestTimeout},
			}}},
		}},
	}
	out, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("encoding the encryption configuration: %w", err)
	}
	return out, nil
}
