package policyedit

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	"go.yaml.in/yaml/v3"
)

// Inline returns the policy with every `trustRoots: - file: X` (and `akRoots: - file: X`)
// replaced by `pem: <contents>` and a `tdx: collateralBundle: file: X` by `json: <contents>`, so that
// the node (and the joinservice reading it from a ConfigMap) needs no file beside it. Relative files
// are resolved against baseDir. A document that is not a mapping is returned as it is: the policy's
// parser reports what is wrong with it.
func Inline(data []byte, baseDir string) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("parsing attestation policy: %w", err)
	}
	if len(doc.Content) == 0 || doc.Content[0].Kind != yaml.MappingNode {
		return data, nil
	}
	root := doc.Content[0]
	for i := 0; i+1 < len(root.Content); i += 2 {
		switch key, val := root.Content[i].Value, root.Content[i+1]; {
		case (key == "trustRoots" || key == "akRoots") && val.Kind == yaml.SequenceNode:
			for _, entry := range val.Content {
				if err := inlineFile(entry, "pem", baseDir); err != nil {
					return nil, fmt.Errorf("attestation policy %s: %w", key, err)
				}
			}
		case key == "tdx" && val.Kind == yaml.MappingNode:
			for j := 0; j+1 < len(val.Content); j += 2 {
				if val.Content[j].Value == "collateralBundle" {
					if err := inlineFile(val.Content[j+1], "json", baseDir); err != nil {
						return nil, fmt.Errorf("attestation policy TDX collateral bundle: %w", err)
					}
				}
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

// inlineFile replaces the `file: X` member of a mapping node with `<key>: <contents of X>`.
func inlineFile(entry *yaml.Node, key, baseDir string) error {
	if entry.Kind != yaml.MappingNode {
		return nil // the policy's parser reports what is wrong
	}
	for j := 0; j+1 < len(entry.Content); j += 2 {
		if entry.Content[j].Value != "file" {
			continue
		}
		path := entry.Content[j+1].Value
		if !filepath.IsAbs(path) {
			path = filepath.Join(baseDir, path)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		entry.Content[j].Value = key
		entry.Content[j+1] = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: string(data), Style: yaml.LiteralStyle}
	}
	return nil
}
