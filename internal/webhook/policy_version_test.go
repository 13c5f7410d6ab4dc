package webhook

import (
	"errors"
	"strings"
	"testing"
)

// TestParsePolicyVersion: a versioned policy reads without a warning, the unversioned form of
// earlier releases with one, and another version or kind is refused.
func TestParsePolicyVersion(t *testing.T) {
	const rules = "rules: [{name: local, registries: [berth.local]}]\n"
	p, err := ParsePolicy([]byte("apiVersion: config.berth.dev/v1alpha1\nkind: ImagePolicy\n" + rules))
	if err != nil || len(p.Warnings) != 0 || len(p.Rules) != 1 {
		t.Errorf("versioned: %+v, %v", p, err)
	}
	p, err = ParsePolicy([]byte(rules))
	if err != nil || len(p.Warnings) != 1 || !strings.Contains(p.Warnings[0], "no apiVersion and kind") {
		t.Errorf("unversioned: %+v, %v", p, err)
	}
	if p, err := ParsePolicy([]byte(DefaultPolicy)); err != nil || len(p.Warnings) != 0 {
		t.Errorf("DefaultPolicy: %+v, %v", p, err)
	}
	for doc, want := range map[string]string{
		"apiVersion: config.berth.dev/v2\nkind: ImagePolicy\n" + rules:  `apiVersion "config.berth.dev/v2"`,
		"apiVersion: config.berth.dev/v1alpha1\nkind: Policy\n" + rules: `kind "Policy"`,
		"apiVersion: config.berth.dev/v1alpha1\n" + rules:               `kind ""`,
	} {
		if _, err := ParsePolicy([]byte(doc)); !errors.Is(err, ErrInvalidPolicy) || !strings.Contains(err.Error(), want) {
			t.Errorf("ParsePolicy(%q) = %v, want %q", doc, err, want)
		}
	}
}
