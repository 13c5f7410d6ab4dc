package webhook

import (
	"errors"
	"fmt"
	"regexp"
	"strings"

	"sigs.k8s.io/yaml"
)

// DefaultRuleName names the implicit last rule: an image no rule allows is denied by it.
const DefaultRuleName = "default-deny"

// DefaultPolicy is the policy of the mini cluster: the registries its own images come from are
// allowed, everything else is denied.
const DefaultPolicy = `# Image policy of the berth-webhook admission webhook.
# An image is allowed by the first rule that lists its registry; an image no rule allows is denied
# by the implicit rule "default-deny". requireDigest: true also demands a pinned @sha256 digest.
apiVersion: config.berth.dev/v1alpha1
kind: ImagePolicy
rules:
- name: kubernetes-images
  registries: ["registry.k8s.io"]
- name: berth-images
  registries: ["berth.local"]
`

// Policy is the image policy: an ordered list of rules. It is immutable once parsed.
type Policy struct {
	// APIVersion and Kind version the file (PolicyAPIVersion, PolicyKind); a file without both is
	// the unversioned form of earlier releases, read with a warning.
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`
	Rules      []Rule `json:"rules"`
	// Warnings say what the operator should change in the file (an unversioned file).
	Warnings []string `json:"-"`
}

// The image policy file's version.
const (
	PolicyAPIVersion = "config.berth.dev/v1alpha1"
	PolicyKind       = "ImagePolicy"
)

// Rule allows the images of some registries.
type Rule struct {
	// Name appears in every decision the rule makes.
	Name string `json:"name"`
	// Registries are registry hosts (with port, if any) whose images the rule allows.
	Registries []string `json:"registries"`
	// RequireDigest makes the rule deny images not pinned to a sha256 digest.
	RequireDigest bool `json:"requireDigest,omitempty"`
}

// ErrInvalidPolicy is returned for a policy that does not parse or is inconsistent.
var ErrInvalidPolicy = errors.New("invalid image policy")

var ruleName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// ParsePolicy parses and checks a policy document (YAML or JSON).
func ParsePolicy(data []byte) (*Policy, error) {
	var p Policy
	if err := yaml.UnmarshalStrict(data, &p); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPolicy, err)
	}
	switch {
	case p.APIVersion == "" && p.Kind == "":
		p.Warnings = append(p.Warnings, fmt.Sprintf("the image policy has no apiVersion and kind: read as the unversioned policy of earlier releases; add apiVersion: %s and kind: %s", PolicyAPIVersion, PolicyKind))
	case p.APIVersion != PolicyAPIVersion:
		return nil, fmt.Errorf("%w: apiVersion %q is not %s", ErrInvalidPolicy, p.APIVersion, PolicyAPIVersion)
	case p.Kind != PolicyKind:
		return nil, fmt.Errorf("%w: kind %q is not %s", ErrInvalidPolicy, p.Kind, PolicyKind)
	}
	seen := map[string]bool{DefaultRuleName: true}
	for n, r := range p.Rules {
		if !ruleName.MatchString(r.Name) {
			return nil, fmt.Errorf("%w: rule %d: name %q is not a lower-case DNS label", ErrInvalidPolicy, n, r.Name)
		}
		if seen[r.Name] {
			return nil, fmt.Errorf("%w: rule %d: name %q is used twice or reserved", ErrInvalidPolicy, n, r.Name)
		}
		seen[r.Name] = true
		if len(r.Registries) == 0 {
			return nil, fmt.Errorf("%w: rule %q lists no registries", ErrInvalidPolicy, r.Name)
		}
		for _, reg := range r.Registries {
			if reg == "" || strings.ContainsAny(reg, "/@ ") {
				return nil, fmt.Errorf("%w: rule %q: %q is not a registry host", ErrInvalidPolicy, r.Name, reg)
			}
		}
	}
	return &p, nil
}

// Verdict is the policy's decision on one image.
type Verdict struct {
	Allowed bool
	// Rule names the rule that decided.
	Rule string
	// Reason says why, for a denial.
	Reason string
}

var digestSuffix = regexp.MustCompile(`@sha256:[0-9a-f]{64}$`)

// Check decides on one image reference.
func (p *Policy) Check(image string) Verdict {
	registry := registryOf(image)
	for _, r := range p.Rules {
		for _, reg := range r.Registries {
			if reg != registry {
				continue
			}
			if r.RequireDigest && !digestSuffix.MatchString(image) {
				return Verdict{Rule: r.Name, Reason: "the rule requires a pinned @sha256 digest"}
			}
			return Verdict{Allowed: true, Rule: r.Name}
		}
	}
	if registry == "" {
		return Verdict{Rule: DefaultRuleName, Reason: "the image names no registry host; name it in full"}
	}
	return Verdict{Rule: DefaultRuleName, Reason: fmt.Sprintf("no rule allows registry %q", registry)}
}

// registryOf returns the registry host of an image reference, or "" when the reference names none
// (the first path component is a registry only if it has a dot or a port, or is localhost).
func registryOf(image string) string {
	first, _, found := strings.Cut(image, "/")
	if !found {
		return ""
	}
	if strings.ContainsAny(first, ".:") || first == "localhost" {
		return first
	}
	return ""
}
