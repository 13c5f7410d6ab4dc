// Package policyedit edits attestation policy documents (the format of package policy) as YAML, so
// that what an operator wrote by hand (comments, order, other indices) survives: inline the files a
// policy names, merge an image's expected measurements into a cluster policy, render predicted PCR
// values as a policy, and add an attestation-key CA to akRoots. `berth init`, `berth manifests` and
// `berth policy measure/merge/join` are its callers; it reads files only where a policy names them.
package policyedit

import (
	"bytes"
	"fmt"

	"go.yaml.in/yaml/v3"
)

// encode writes a document with two-space indentation, as policy files are written by hand.
func encode(doc *yaml.Node) ([]byte, error) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(doc); err != nil {
		return nil, fmt.Errorf("encoding YAML: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encoding YAML: %w", err)
	}
	return buf.Bytes(), nil
}

func scalar(v string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Value: v} }
