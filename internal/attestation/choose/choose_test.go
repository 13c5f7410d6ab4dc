package choose

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
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

// tdxPolicy is a policy for p's TD (MRTD zero, RTMRs zero) with p's root and the given tdx section.
func tdxPolicy(t *testing.T, p *tdxtest.Platform, tdxSection string) *policy.Policy {
	t.Helper()
	root := p.RootPEM()
	doc := "variant: tdx\nmeasurements:\n  0: {expected: '" + strings.Repeat("00", 48) + "'}\ntrustRoots:\n  - pem: |\n      " +
		strings.ReplaceAll(strings.TrimSpace(string(root)), "\n", "\n      ") + "\n" + tdxSection
	pol, err := policy.Parse([]byte(doc), "p.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	return pol
}

func validateTD(t *testing.T, p *tdxtest.Platform, pol *policy.Policy) error {
	t.Helper()
	v, err := NewValidator(pol, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	doc, err := tdx.NewIssuer(p.Open, nil).Issue(context.Background(), []byte("key"), []byte("nonce"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = v.Validate(context.Background(), doc, []byte("nonce"))
	return err
}

// TestTDXCollateralSources: a bundle in the policy serves the collateral; a PCS named by pcsURL is asked once
// and then served from the cache; an unreachable PCS fails with tdx.ErrCollateralUnavailable; a bad bundle
// fails the policy.
func TestTDXCollateralSources(t *testing.T) {
	p, err := tdxtest.New(tdxtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := p.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	inline := "tdx:\n  collateralBundle:\n    json: '" + strings.ReplaceAll(string(bundle), "\n", " ") + "'\n"
	if err := validateTD(t, p, tdxPolicy(t, p, inline)); err != nil {
		t.Fatalf("validation with the policy's bundle = %v", err)
	}
	other, err := tdxtest.New(tdxtest.Options{}) // same FMSPC, another PKI
	if err != nil {
		t.Fatal(err)
	}
	if err := validateTD(t, other, tdxPolicy(t, p, inline)); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("validation of another platform's TD = %v, want %v", err, attestation.ErrUntrustedRoot)
	}

	var requests atomic.Int32
	col := p.Collateral()
	chain := func(w http.ResponseWriter, header string, pemChain []byte) {
		w.Header().Set(header, strings.ReplaceAll(url.QueryEscape(string(pemChain)), "+", "%20"))
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /sgx/certification/v4/pckcrl", func(w http.ResponseWriter, _ *http.Request) {
		requests.Add(1)
		chain(w, "SGX-PCK-CRL-Issuer-Chain", col.PCKCRLIssuerChain)
		_, _ = w.Write(col.PCKCRL)
	})
	mux.HandleFunc("GET /tdx/certification/v4/tcb", func(w http.ResponseWriter, _ *http.Request) {
		chain(w, "TCB-Info-Issuer-Chain", col.TCBInfoIssuerChain)
		_, _ = w.Write(col.TCBInfo)
	})
	mux.HandleFunc("GET /tdx/certification/v4/qe/identity", func(w http.ResponseWriter, _ *http.Request) {
		chain(w, "SGX-Enclave-Identity-Issuer-Chain", col.QEIdentityIssuerChain)
		_, _ = w.Write(col.QEIdentity)
	})
	pcs := httptest.NewServer(mux)
	defer pcs.Close()
	v, err := NewValidator(tdxPolicy(t, p, "tdx:\n  pcsURL: "+pcs.URL+"\n"), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		doc, err := tdx.NewIssuer(p.Open, nil).Issue(context.Background(), nil, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Validate(context.Background(), doc, []byte("n")); err != nil {
			t.Fatalf("validation %d with collateral from the PCS = %v", i, err)
		}
	}
	if n := requests.Load(); n != 1 {
		t.Fatalf("the PCS was asked %d times for two quotes, want once", n)
	}

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + lis.Addr().String()
	lis.Close()
	if err := validateTD(t, p, tdxPolicy(t, p, "tdx:\n  pcsURL: "+closed+"\n")); !errors.Is(err, tdx.ErrCollateralUnavailable) {
		t.Fatalf("validation with an unreachable PCS = %v, want %v", err, tdx.ErrCollateralUnavailable)
	}

	if _, err := NewValidator(tdxPolicy(t, p, "tdx:\n  collateralBundle: {json: '{\"version\": 2}'}\n"), zap.NewNop()); !errors.Is(err, tdx.ErrBadCollateralBundle) {
		t.Fatalf("NewValidator() with a bad bundle = %v, want %v", err, tdx.ErrBadCollateralBundle)
	}
}
