package choose

import (
	"errors"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
)

func TestNewValidator(t *testing.T) {
	testCases := map[string]struct {
		doc     string
		variant string
		wantErr error
	}{
		"tdx with default roots": {doc: "variant: tdx\nmeasurements:\n  0: {expected: '00'}\n", variant: "tdx"},
		"tpm without EK CA":      {doc: "variant: tpm\n", wantErr: policy.ErrInvalid},
		"unknown variant":        {doc: "variant: sev-snp\n", wantErr: attestation.ErrUnknownVariant},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			p, err := policy.Parse([]byte(tc.doc), "p.yaml", nil)
			if err != nil {
				t.Fatal(err)
			}
			v, err := NewValidator(p, zap.NewNop())
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || v != nil {
					t.Fatalf("got %v, %v; want nil, %v", v, err, tc.wantErr)
				}
				return
			}
			if err != nil || v.Variant() != tc.variant {
				t.Fatalf("got %v, %v; want a %s validator", v, err, tc.variant)
			}
		})
	}
}
