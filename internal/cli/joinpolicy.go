package cli

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/policy/policyedit"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/workspace"
)

// loadJoinPolicy reads the join policy at path (what a joining node demands of the joinservice),
// with its files inlined, and checks that a node could use it. It returns nil for "" (the config
// names none).
func loadJoinPolicy(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usageErr("reading join policy: %w", err)
	}
	if data, err = policyedit.Inline(data, filepath.Dir(path)); err != nil {
		return nil, usageErr("join policy %s: %w", path, err)
	}
	if err := checkJoinPolicy(data, path); err != nil {
		return nil, err
	}
	return data, nil
}

// checkJoinPolicy checks that a node could build its validator from data.
func checkJoinPolicy(data []byte, origin string) error {
	p, err := policy.Parse(data, origin, nil)
	if err != nil {
		return usageErr("join policy: %w", err)
	}
	if _, err := choose.NewValidator(p, zap.NewNop()); err != nil {
		return usageErr("join policy %s: %w", origin, err)
	}
	return nil
}

// clusterJoinPolicy returns the join policy nodes of this cluster get: the operator's (inlined) with,
// for the TPM variant, the cluster's attestation-key CA (vtpm.ClusterAKCA, derived from the master
// secret) added to akRoots. A node holding it accepts the joinservices' certified keys and session
// proofs, so its join costs their TPMs nothing; a node without it activates their keys as before.
// The CA certificate is public; adding it twice leaves one entry.
func clusterJoinPolicy(data []byte, keys *clusterkeys.Keys) ([]byte, error) {
	ca, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		return nil, err
	}
	return policyedit.AddAKRoot(data, ca.PEM(), fmt.Sprintf("cluster %x: its attestation-key CA (berth init)", keys.ClusterID()))
}

func newPolicyJoinCmd() *cobra.Command {
	var policyPath, dir string
	cmd := &cobra.Command{
		Use:   "join --policy FILE --workspace DIR",
		Short: "Print a cluster's join policy: a join policy with the cluster's attestation-key CA",
		Long: `berth policy join prints the join policy --policy (what joining nodes demand of the
joinservice: the image's measurements, a set lock register, the EK CAs) self-contained and with
the attestation-key CA of the cluster whose master secret is in the workspace (berth init's
master-secret.json) added to akRoots: what berth init writes to the workspace's join-policy.yaml
when its config names joinPolicyFile. Use it for a cluster initialized without joinPolicyFile, or
for a new image's join policy. Nodes holding it accept the cluster's joinservices by their
certified key and session proof, so their joins cost the joinservices' TPMs nothing. The output
holds nothing secret; it reads the master secret only to derive the CA.`,
		Example: `  berth policy join --policy image-join-policy.yaml --workspace ./my-cluster > join-policy.yaml`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if policyPath == "" || dir == "" {
				return usageErr("policy join needs --policy and --workspace")
			}
			data, err := loadJoinPolicy(policyPath)
			if err != nil {
				return err
			}
			master, salt, ok, err := workspace.ReadSecret(dir)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			if !ok {
				return usageErr("workspace %s holds no %s", dir, workspace.MasterSecret)
			}
			keys, err := clusterkeys.New(master, salt)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			if data, err = clusterJoinPolicy(data, keys); err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			_, err = cmd.OutOrStdout().Write(data)
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&policyPath, "policy", "", "join policy file (YAML)")
	f.StringVar(&dir, "workspace", "", "berth init's workspace (its master-secret.json)")
	return cmd
}
