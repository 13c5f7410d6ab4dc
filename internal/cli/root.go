// Package cli implements the berth command line: one file per command, wired together by NewRootCmd.
package cli

import (
	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/logging"
	"github.com/berth-k8s/berth/internal/version"
)

// defaultDiagnostics is how the CLI logs (--log-level, --log-format) to stderr: client-go's and
// gRPC's lines and the mini cluster's progress. What a command reports goes to stdout.
var defaultDiagnostics = logging.Config{Level: "info", Format: logging.FormatConsole}

// NewRootCmd builds the berth command tree.
func NewRootCmd() *cobra.Command {
	diagnostics := defaultDiagnostics // each tree its own: flags of one run never leak into the next
	root := &cobra.Command{
		Use:   "berth",
		Short: "Attested node bootstrapping for Kubernetes",
		Long: `berth is the operator's tool for Berth clusters.

Every node runs the bootstrapper daemon. berth init checks the first node's attestation and
sends it the secrets it needs to run kubeadm init; every later node proves itself to the
cluster's joinservice and joins on its own.

Commands that talk to a cluster (status) find it as kubectl does: --kubeconfig, else the files
in KUBECONFIG, else ~/.kube/config; --context picks a context. Commands that print state (status,
verify, policy check, version) take -o json|yaml for scripts. Data goes to stdout; progress,
warnings and errors go to stderr.

` + exitCodesHelp,
		Example: `  sudo ./scripts/mini-up.sh                  # a local attested cluster, then:
  export KUBECONFIG=/var/lib/berth-mini/admin.conf
  berth status
  berth verify --endpoint 198.51.100.10:9000 --policy policy.yaml -o json
  berth version`,
		Version:       version.Version,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if _, err := logging.New(diagnostics, cmd.ErrOrStderr()); err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			return nil
		},
	}
	diagnostics.AddFlags(root.PersistentFlags())
	root.AddCommand(
		newInitCmd(), newRestoreCmd(), newRecoverCmd(), newKubeconfigCmd(),
		newMiniCmd(),
		newVerifyCmd(), newPolicyCmd(),
		newStatusCmd(), newNodeCmd(), newUpgradeCmd(), newMetadataCmd(), newSecretsCmd(), newBackupCmd(),
		newManifestsCmd(), newConfigCmd(), newExplainCmd(), newSupportCmd(),
		newVersionCmd(),
	)
	return root
}
