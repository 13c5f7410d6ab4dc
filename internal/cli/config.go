package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/pmezard/go-difflib/difflib"
	"github.com/spf13/cobra"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/initconfig"
)

// ErrNoStoredConfig is returned when the cluster keeps no configuration (initialized by a Berth
// that did not store it).
var ErrNoStoredConfig = errors.New("the cluster keeps no configuration (ConfigMap " +
	clusterconfig.ConfigMapNamespace + "/" + clusterconfig.ConfigMapName + "): it was initialized by an older berth")

// ErrConfigDiffers is returned by berth config diff when the file and the cluster's configuration
// differ (exit code 1, as diff(1)).
var ErrConfigDiffers = errors.New("the file and the cluster's configuration differ")

func newConfigCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Validate, show and compare cluster configurations (" + clusterconfig.APIVersion + ")",
		Long: `config works with the cluster configuration berth init reads: a ` + clusterconfig.APIVersion + ` ` + clusterconfig.Kind + `.
Every field is in internal/clusterconfig/REFERENCE.md; berth config schema prints the JSON schema
for editors. A file without apiVersion and kind is the unversioned init config of earlier
releases: it is still read, with a warning, and berth config show prints it in the versioned form.`,
		Example: `  berth config validate cluster.yaml
  berth config show cluster.yaml
  berth config diff cluster.yaml --kubeconfig admin.conf`,
		Args: cobra.NoArgs,
		RunE: groupHelp,
	}
	cmd.AddCommand(newConfigValidateCmd(), newConfigShowCmd(), newConfigDiffCmd(), newConfigSchemaCmd())
	return cmd
}

func newConfigValidateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "validate FILE",
		Short: "Check a cluster configuration: fields, types, values and the files it names",
		Long: `validate reads FILE as berth init does and reports every problem with the field's path: an
unknown field, a value of the wrong type, an invalid value, an override of what Berth keeps
(PodSecurity's configuration, its admission plugins, the flags it sets). It also checks that the
files the configuration names (init secret, policies) can be read. Exit code 2 when invalid.`,
		Example: `  berth config validate cluster.yaml`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg, warnings, err := initconfig.Read(args[0])
			printWarnings(cmd.ErrOrStderr(), args[0], warnings)
			if err != nil {
				return usageErr("%w", err)
			}
			for _, f := range []struct{ field, path string }{
				{"initSecretFile", cfg.InitSecretFile},
				{"policies.attestationPolicyFile", cfg.Policies.AttestationPolicyFile},
				{"policies.imagePolicyFile", cfg.Policies.ImagePolicyFile},
				{"policies.joinPolicyFile", cfg.Policies.JoinPolicyFile},
			} {
				if _, err := initconfig.ReadFile(f.path); err != nil {
					return usageErr("config %s: %s: %w", args[0], f.field, err)
				}
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "%s: a valid %s %s\n", args[0], clusterconfig.APIVersion, clusterconfig.Kind)
			return nil
		},
	}
}

func newConfigShowCmd() *cobra.Command {
	var kube kubeOptions
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "show [FILE]",
		Short: "Print the effective configuration, defaults filled in: of FILE, or the one the cluster keeps",
		Long: `show prints the configuration in force with every default filled in, in the versioned form:
of FILE when given (as berth init would use it), else the one the cluster keeps in the ConfigMap ` +
			clusterconfig.ConfigMapNamespace + "/" + clusterconfig.ConfigMapName + `.`,
		Example: `  berth config show cluster.yaml
  berth config show --kubeconfig admin.conf`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var cfg clusterconfig.ClusterConfiguration
			if len(args) == 1 {
				var err error
				if cfg, err = readConfigAsWritten(args[0], cmd.ErrOrStderr()); err != nil {
					return err
				}
			} else {
				client, err := kube.client()
				if err != nil {
					return err
				}
				ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
				defer cancel()
				if cfg, err = storedConfig(ctx, client); err != nil {
					return err
				}
			}
			data, err := clusterconfig.Marshal(cfg)
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(data)
			return err
		},
	}
	kube.addFlags(cmd.Flags())
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

func newConfigDiffCmd() *cobra.Command {
	var kube kubeOptions
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "diff FILE",
		Short: "Compare a configuration file with the one the cluster keeps",
		Long: `diff prints a unified diff from the configuration the cluster keeps (ConfigMap ` +
			clusterconfig.ConfigMapNamespace + "/" + clusterconfig.ConfigMapName + `) to FILE, both
with defaults filled in and without what only the operator's machine knows (the init secret and
policy file paths). Exit code 0 when they are the same, 1 when they differ, 2 when FILE is invalid.`,
		Example: `  berth config diff cluster.yaml --kubeconfig admin.conf`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			file, err := readConfigAsWritten(args[0], cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			client, err := kube.client()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			stored, err := storedConfig(ctx, client)
			if err != nil {
				return err
			}
			return diffConfigs(cmd.OutOrStdout(), stored, file, args[0])
		},
	}
	kube.addFlags(cmd.Flags())
	cmd.Flags().DurationVar(&timeout, "timeout", 30*time.Second, "how long to wait for the API server")
	return cmd
}

func newConfigSchemaCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "schema",
		Short: "Print the configuration's JSON schema, for editors",
		Example: `  berth config schema > clusterconfig.schema.json
  # then, first line of cluster.yaml: # yaml-language-server: $schema=clusterconfig.schema.json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			data, err := clusterconfig.Schema()
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(data)
			return err
		},
	}
}

// readConfigAsWritten reads a configuration file, defaulted and validated, with the paths it names
// as written; its errors are usage errors.
func readConfigAsWritten(path string, errOut io.Writer) (clusterconfig.ClusterConfiguration, error) {
	data, err := initconfig.ReadFile(path)
	if err != nil {
		return clusterconfig.ClusterConfiguration{}, usageErr("%w", err)
	}
	cfg, warnings, err := clusterconfig.Parse(data)
	printWarnings(errOut, path, warnings)
	if err != nil {
		return cfg, usageErr("config %s: %w", path, err)
	}
	return cfg, nil
}

// storedConfig reads the configuration the cluster keeps.
func storedConfig(ctx context.Context, client kubernetes.Interface) (clusterconfig.ClusterConfiguration, error) {
	cm, err := client.CoreV1().ConfigMaps(clusterconfig.ConfigMapNamespace).Get(ctx, clusterconfig.ConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return clusterconfig.ClusterConfiguration{}, ErrNoStoredConfig
	}
	if err != nil {
		return clusterconfig.ClusterConfiguration{}, fmt.Errorf("reading the cluster's configuration: %w", err)
	}
	return clusterconfig.FromConfigMap(cm)
}

// diffConfigs prints the unified diff from stored to file (both as the cluster keeps them) and
// returns ErrConfigDiffers (exit code 1) when there is one.
func diffConfigs(out io.Writer, stored, file clusterconfig.ClusterConfiguration, fileName string) error {
	a, err := clusterconfig.Marshal(stored.InCluster())
	if err != nil {
		return err
	}
	b, err := clusterconfig.Marshal(file.InCluster())
	if err != nil {
		return err
	}
	diff, err := difflib.GetUnifiedDiffString(difflib.UnifiedDiff{
		A: difflib.SplitLines(string(a)), B: difflib.SplitLines(string(b)),
		FromFile: "cluster:" + clusterconfig.ConfigMapNamespace + "/" + clusterconfig.ConfigMapName, ToFile: fileName, Context: 3,
	})
	if err != nil {
		return fmt.Errorf("comparing the configurations: %w", err)
	}
	if diff == "" {
		return nil
	}
	_, _ = io.WriteString(out, diff)
	return &exitError{code: exitFailure, err: ErrConfigDiffers}
}
