package policyedit

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"go.yaml.in/yaml/v3"
)

// variantTPM is the variant whose policies take akRoots: vtpm.Variant, named here so that editing a
// document needs no TPM code (TestVariantTPM holds the two together).
const variantTPM = "tpm"

// AddAKRoot returns the join policy data with caPEM, an attestation-key CA certificate, added to
// akRoots under the comment; a policy of another variant than tpm has no attestation keys and is
// returned as it is, and so is one that lists the certificate already (adding it twice leaves one
// entry). Errors name the join policy, the one document it is used on.
func AddAKRoot(data, caPEM []byte, comment string) ([]byte, error) {
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
	if variant != variantTPM {
		return data, nil // no attestation keys to certify (TDX)
	}
	ca := string(caPEM)
	if roots == nil {
		roots = &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		root.Content = append(root.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: "akRoots"}, roots)
	}
	if roots.Kind != yaml.SequenceNode {
		return nil, errors.New("join policy: akRoots is not a list")
	}
	for _, e := range roots.Content {
		for j := 0; e.Kind == yaml.MappingNode && j+1 < len(e.Content); j += 2 {
			if e.Content[j].Value == "pem" && strings.TrimSpace(e.Content[j+1].Value) == strings.TrimSpace(ca) {
				return data, nil
			}
		}
	}
	roots.Content = append(roots.Content, &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map",
		HeadComment: comment,
		Content: []*yaml.Node{
			{Kind: yaml.ScalarNode, Tag: "!!str", Value: "pem"},
			{Kind: yaml.ScalarNode, Tag: "!!str", Value: ca, Style: yaml.LiteralStyle},
		}})
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, fmt.Errorf("encoding join policy: %w", err)
	}
	return out.Bytes(), nil
}
