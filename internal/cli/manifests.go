package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"path/filepath"
	"slices"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/attestation/policy/policyedit"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/initconfig"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/version"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// manifestsOptions are the flags of berth manifests: what the bootstrapper and berth init decide.
type manifestsOptions struct {
	configPath      string
	joinImage       string
	webhookImage    string
	imagePullPolicy string
	joinServiceEnv  map[string]string
	output          string
}

func newManifestsCmd() *cobra.Command {
	o := manifestsOptions{
		joinImage:       "berth.local/joinservice:" + version.Version,
		webhookImage:    "berth.local/berth-webhook:" + version.Version,
		imagePullPolicy: "IfNotPresent",
		output:          outputYAML,
	}
	cmd := &cobra.Command{
		Use:   "manifests",
		Short: "Print the Kubernetes objects Berth installs (berth-system and the image-policy webhook)",
		Long: `manifests prints every object the bootstrapper applies when berth init makes a cluster, as
the same code builds them: the berth-system namespace with its Pod Security labels, the RuntimeClass
of the joinservice and the admission policies that guard berth-system and that RuntimeClass, the join
configuration, the join ledger and Lease, the joinservice's ServiceAccount, Role, RoleBinding and
DaemonSet, then the image-policy webhook's namespace, ServiceAccounts, policy, Service, Deployment,
PodDisruptionBudget and ValidatingWebhookConfiguration. Nothing is sent anywhere: diff the output of
two Berth versions, or review it before an install.

Values the cluster makes at init are not shown: the Secret berth-cluster-secrets comes without its
data (the master secret and salt), the join configuration without the cluster ID, measurement salt
and API server endpoint, and the webhook configuration without its CA bundle (the webhook's CA and
TLS Secret are made in the cluster and never leave it). Each such gap is named on stderr.

--config reads berth init's config file for the Kubernetes version (which also pins the Pod
Security version), the attestation policy and the image policy; the image flags mirror the
bootstrapper's --joinservice-image and --webhook-image (--webhook-image "" leaves the webhook out, as
a bootstrapper without one does). The objects go to stdout as YAML documents (-o yaml, the default)
or one JSON List (-o json); both are what kubectl apply -f and kubectl diff -f read.`,
		Example: `  berth manifests > berth.yaml
  berth manifests --config init.yaml --joinservice-image berth.local/joinservice:dev \
    --webhook-image berth.local/berth-webhook:dev --image-pull-policy Never
  berth manifests -o json | jq -r '.items[] | .kind + "/" + .metadata.name'
  diff <(berth-v1 manifests) <(berth-v2 manifests)`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runManifests(cmd.OutOrStdout(), cmd.ErrOrStderr(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.configPath, "config", "", "berth init's config file (kubernetesVersion, policies.attestationPolicyFile, policies.imagePolicyFile)")
	f.StringVar(&o.joinImage, "joinservice-image", o.joinImage, "container image of the joinservice DaemonSet")
	f.StringVar(&o.webhookImage, "webhook-image", o.webhookImage, `container image of the image-policy webhook; "" leaves the webhook out`)
	f.StringVar(&o.imagePullPolicy, "image-pull-policy", o.imagePullPolicy, "pull policy of Berth's images: IfNotPresent, Never or Always")
	f.StringToStringVar(&o.joinServiceEnv, "joinservice-env", nil,
		"environment of the joinservice container, as the bootstrapper passes it (BERTH_ATTESTATION=tpm,BERTH_TPM=/dev/tpmrm0,...); BERTH_TPM also decides the host paths mounted")
	f.StringVarP(&o.output, "output", "o", o.output, "output format: yaml (documents) or json (one List)")
	return cmd
}

// runManifests prints the objects to out and what they leave out to errOut.
func runManifests(out, errOut io.Writer, o manifestsOptions) error {
	if o.output != outputYAML && o.output != outputJSON {
		return usageErr("unknown output format %q: want yaml or json", o.output)
	}
	if !slices.Contains([]string{"IfNotPresent", "Never", "Always"}, o.imagePullPolicy) {
		return usageErr("--image-pull-policy %q: want IfNotPresent, Never or Always", o.imagePullPolicy)
	}
	if o.joinImage == "" {
		return usageErr("--joinservice-image is empty")
	}
	cfg := clusterconfig.Default()
	var attestationPolicy, imagePolicy []byte
	if o.configPath != "" {
		var err error
		var warnings []string
		cfg, warnings, err = initconfig.Read(o.configPath)
		printWarnings(errOut, o.configPath, warnings)
		if err != nil {
			return usageErr("%w", err)
		}
		if attestationPolicy, err = readConfigFile(cfg.Policies.AttestationPolicyFile); err != nil {
			return err
		}
		if len(attestationPolicy) > 0 {
			policyFile := cfg.Policies.AttestationPolicyFile
			if attestationPolicy, err = policyedit.Inline(attestationPolicy, filepath.Dir(policyFile)); err != nil {
				return usageErr("%s: %w", policyFile, err)
			}
		}
		if imagePolicy, err = readConfigFile(cfg.Policies.ImagePolicyFile); err != nil {
			return err
		}
	}
	var guard []string
	if o.webhookImage != "" {
		guard = append(guard, o.webhookImage)
	}
	objs, err := berthsystem.Objects(berthsystem.Config{
		JoinServiceImage:     o.joinImage,
		ImagePullPolicy:      o.imagePullPolicy,
		JoinServiceEnv:       o.joinServiceEnv,
		JoinServiceHostPaths: berthsystem.TPMHostPaths(o.joinServiceEnv[joinconfig.EnvTPM]),
		GuardImages:          guard,
	}, berthsystem.Cluster{Join: joinconfig.Config{AttestationPolicy: attestationPolicy, KubernetesVersion: cfg.KubernetesVersion}})
	if err != nil {
		return err
	}
	for _, obj := range objs {
		leaveOutInitValues(errOut, obj)
	}
	if o.webhookImage != "" {
		webhookObjs, err := install.Objects(install.Config{Image: o.webhookImage, ImagePullPolicy: o.imagePullPolicy, Policy: imagePolicy}, nil)
		if err != nil {
			return err
		}
		objs = append(objs, webhookObjs...)
		_, _ = fmt.Fprintf(errOut, "note: ValidatingWebhookConfiguration %s without caBundle, and no Secret %s/%s: the webhook's CA and keys are made in the cluster\n",
			webhookconfig.ConfigName, joinconfig.Namespace, webhookconfig.TLSSecret)
	}
	return writeManifests(out, o.output, objs)
}

// leaveOutInitValues removes from obj what berth init makes (the cluster Secret's data, the join
// configuration's cluster values) and says so on errOut.
func leaveOutInitValues(errOut io.Writer, obj *unstructured.Unstructured) {
	switch {
	case obj.GetKind() == "Secret":
		unstructured.RemoveNestedField(obj.Object, "data")
		_, _ = fmt.Fprintf(errOut, "note: Secret %s/%s without its data: berth init makes the master secret and salt\n", obj.GetNamespace(), obj.GetName())
	case obj.GetKind() == "ConfigMap" && obj.GetName() == joinconfig.JoinConfigName:
		data, _, _ := unstructured.NestedStringMap(obj.Object, "data")
		var left []string
		for _, k := range slices.Sorted(maps.Keys(data)) {
			if data[k] == "" {
				delete(data, k)
				left = append(left, k)
			}
		}
		_ = unstructured.SetNestedStringMap(obj.Object, data, "data")
		if len(left) > 0 {
			_, _ = fmt.Fprintf(errOut, "note: ConfigMap %s/%s without %v: berth init decides them\n", obj.GetNamespace(), obj.GetName(), left)
		}
	}
}

// writeManifests writes objs as YAML documents or as one JSON List.
func writeManifests(out io.Writer, format string, objs []*unstructured.Unstructured) error {
	if format == outputJSON {
		items := make([]any, len(objs))
		for n, o := range objs {
			items[n] = o.Object
		}
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(map[string]any{"apiVersion": "v1", "kind": "List", "items": items}); err != nil {
			return fmt.Errorf("encoding JSON output: %w", err)
		}
		return nil
	}
	for _, o := range objs {
		data, err := yaml.Marshal(o.Object)
		if err != nil {
			return fmt.Errorf("encoding YAML output: %w", err)
		}
		if _, err := fmt.Fprintf(out, "---\n%s", data); err != nil {
			return fmt.Errorf("writing output: %w", err)
		}
	}
	return nil
}
