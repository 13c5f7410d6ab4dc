package cli

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	"go.yaml.in/yaml/v3"
)

// inlinePolicy returns the policy with every `trustRoots: - file: X` replaced by `pem: <contents>`,
// so that the node (and the joinservice reading it from a ConfigMap) needs no file beside it.
// Relative files are resolved against baseDir.
func inlinePolicy(data []byte, baseDir string) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("parsing attestation policy: %w", err)
	}
	if len(doc.Content) == 0 || doc.Content[0].Kind != yaml.MappingNode {
		return data, nil // the node's parser reports what is wrong
	}
	root := doc.Content[0]
	for i := 0; i+1 < len(root.Content); i += 2 {
		if root.Content[i].Value != "trustRoots" || root.Content[i+1].Kind != yaml.SequenceNode {
			continue
		}
		for _, entry := range root.Content[i+1].Content {
			if entry.Kind != yaml.MappingNode {
				continue
			}
			for j := 0; j+1 < len(entry.Content); j += 2 {
				if entry.Content[j].Value != "file" {
					continue
				}
				path := entry.Content[j+1].Value
				if !filepath.IsAbs(path) {
					path = filepath.Join(baseDir, path)
				}
				pemData, err := os.ReadFile(path)
				if err != nil {
					return nil, fmt.Errorf("attestation policy trust root: %w", err)
				}
				entry.Content[j].Value = "pem"
				entry.Content[j+1] = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: string(pemData), Style: yaml.LiteralStyle}
			}
		}
	}
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, fmt.Errorf("encoding attestation policy: %w", err)
	}
	return out.Bytes(), nil
}
