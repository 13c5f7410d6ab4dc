package policy

import (
	"errors"
	"strings"
	"testing"
)

// TestParseVersion: a versioned policy reads without a warning, the unversioned form of earlier
// releases with one, and another version or kind is refused.
func TestParseVersion(t *testing.T) {
	p, err := Parse([]byte("apiVersion: config.berth.dev/v1alpha1\nkind: AttestationPolicy\nvariant: tpm\n"), "p.yaml", nil)
	if err != nil || len(p.Warnings) != 0 {
		t.Errorf("versioned: %+v, %v", p, err)
	}
	p, err = Parse([]byte("variant: tpm\n"), "p.yaml", nil)
	if err != nil || len(p.Warnings) != 1 || !strings.Contains(p.Warnings[0], "p.yaml has no apiVersion and kind") {
		t.Errorf("unversioned: %+v, %v", p, err)
	}
	for doc, want := range map[string]string{
		"apiVersion: config.berth.dev/v2\nkind: AttestationPolicy\nvariant: tpm\n": `apiVersion "config.berth.dev/v2"`,
		"apiVersion: config.berth.dev/v1alpha1\nkind: ImagePolicy\nvariant: tpm\n": `kind "ImagePolicy"`,
		"kind: AttestationPolicy\nvariant: tpm\n":                                  `apiVersion ""`,
	} {
		if _, err := Parse([]byte(doc), "p.yaml", nil); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("Parse(%q) = %v, want %q", doc, err, want)
		}
	}
}
