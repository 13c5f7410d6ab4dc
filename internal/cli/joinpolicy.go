package cli

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.yaml.in/yaml/v3"

	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// fileJoinPolicy is the workspace's join policy for nodes that join the cluster (berth init writes it
// when the config names joinPolicyFile).
const fileJoinPolicy = "join-policy.yaml"

// loadJoinPolicy reads the join policy the config names (what a joining node demands of the
// joinservice), with its files inlined, and checks that a node could use it. It returns nil when the
// config names none.
func loadJoinPolicy(configPath, file string) ([]byte, error) {
	if file == "" {
		return nil, nil
	}
	path := resolve(configPath, file)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, usageErr("reading join policy: %w", err)
	}
	if data, err = inlinePolicy(data, filepath.Dir(path)); err != nil {
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
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("parsing join policy: %w", err)
	}
	if len(doc.Content) == 0 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, errors.New("parsing join policy: not a YAML mapping")
	}
	root := doc.Content[0]
	variant := ""
	var roots *yaml.Node
	for i := 0; i+1 < len(root.Content); i += 2 {
		switch root.Content[i].Value {
		case "variant":
			variant = root.Content[i+1].Value
		case "akRoots":
			roots = root.Content[i+1]
		}
	}
	if variant != vtpm.Variant {
		return data, nil // no attestation keys to certify (TDX)
	}
	ca, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		return nil, err
	}
	caPEM := string(ca.PEM())
	if roots == nil {
		roots = &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		root.Content = append(root.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: "akRoots"}, roots)
	}
	if roots.Kind != yaml.SequenceNode {
		return nil, errors.New("join policy: akRoots is not a list")
	}
	for _, e := range roots.Content {
		for j := 0; e.Kind == yaml.MappingNode && j+1 < len(e.Content); j += 2 {
			if e.Content[j].Value == "pem" && strings.TrimSpace(e.Content[j+1].Value) == strings.TrimSpace(caPEM) {
				return data, nil
			}
		}
	}
	roots.Content = append(roots.Content, &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map",
		HeadComment: fmt.Sprintf("cluster %x: its attestation-key CA (berth init)", keys.ClusterID()),
		Content: []*yaml.Node{
			{Kind: yaml.ScalarNode, Tag: "!!str", Value: "pem"},
			{Kind: yaml.ScalarNode, Tag: "!!str", Value: caPEM, Style: yaml.LiteralStyle},
		}})
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, fmt.Errorf("encoding join policy: %w", err)
	}
	return out.Bytes(), nil
}

// writeJoinPolicy writes the cluster's join policy into the workspace (public data: mode 0644),
// replacing the file whole, so that a node reading it meanwhile sees the old or the new one.
func writeJoinPolicy(dir string, data []byte) (string, error) {
	path := filepath.Join(dir, fileJoinPolicy)
	tmp, err := os.CreateTemp(dir, fileJoinPolicy+".*")
	if err != nil {
		return "", fmt.Errorf("writing join policy: %w", err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := tmp.Write(data); err != nil {
		_ = tmp.Close()
		return "", fmt.Errorf("writing join policy: %w", err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		_ = tmp.Close()
		return "", fmt.Errorf("writing join policy: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("writing join policy: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", fmt.Errorf("writing join policy: %w", err)
	}
	return path, nil
}

func newPolicyJoinCmd() *cobra.Command {
	var policyPath, workspace string
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
			if policyPath == "" || workspace == "" {
				return usageErr("policy join needs --policy and --workspace")
			}
			data, err := loadJoinPolicy(policyPath, filepath.Base(policyPath))
			if err != nil {
				return err
			}
			master, salt, ok, err := readWorkspaceSecret(workspace)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			if !ok {
				return usageErr("workspace %s holds no %s", workspace, fileMasterSecret)
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
	f.StringVar(&workspace, "workspace", "", "berth init's workspace (its master-secret.json)")
	return cmd
}
