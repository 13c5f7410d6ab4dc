package tdx_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
)

// validateWith issues a document on p's TD and validates it with collateral from getter.
func validateWith(t *testing.T, p *tdxtest.Platform, getter tdx.CollateralGetter) error {
	t.Helper()
	ctx := context.Background()
	verifier, err := tdx.NewVerifier(tdx.VerifierConfig{Roots: p.Roots(), Collateral: getter})
	if err != nil {
		t.Fatal(err)
	}
	v, err := tdx.NewValidator(verifier, tdx.ExpectMeasurements(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := tdx.NewIssuer(p.Open, nil).Issue(ctx, []byte("key"), []byte("nonce"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = v.Validate(ctx, doc, []byte("nonce"))
	return err
}

func TestCollateralBundle(t *testing.T) {
	now := time.Now()
	p, err := tdxtest.New(tdxtest.Options{Now: now})
	if err != nil {
		t.Fatal(err)
	}
	data, err := p.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	b, err := tdx.ParseCollateralBundle(data)
	if err != nil {
		t.Fatalf("ParseCollateralBundle(Bundle()) = %v", err)
	}
	col, err := b.GetCollateral(context.Background(), p.CollateralRequest())
	if err != nil || !bytes.Equal(col.TCBInfo, p.Collateral().TCBInfo) || !bytes.Equal(col.PCKCRL, p.Collateral().PCKCRL) {
		t.Fatalf("GetCollateral() = %v; want the platform's collateral byte for byte", err)
	}
	if want := now.UTC().Truncate(time.Second).Add(30 * 24 * time.Hour); !b.NextUpdate().Equal(want) {
		t.Errorf("NextUpdate() = %s, want %s", b.NextUpdate(), want)
	}
	if err := validateWith(t, p, b); err != nil {
		t.Fatalf("validation with the bundle = %v", err)
	}

	// A bundle for another platform family has nothing for this one: a named error, never a fetch.
	other := p.CollateralRequest()
	other.FMSPC = "00906ed50000"
	data, err = tdx.MarshalCollateralBundle(map[tdx.CollateralRequest]*tdx.Collateral{other: p.Collateral()})
	if err != nil {
		t.Fatal(err)
	}
	if b, err = tdx.ParseCollateralBundle(data); err != nil {
		t.Fatal(err)
	}
	err = validateWith(t, p, b)
	if !errors.Is(err, tdx.ErrCollateralUnavailable) || !errors.Is(err, attestation.ErrUntrustedRoot) || !strings.Contains(err.Error(), "00806f050000") {
		t.Fatalf("validation with a bundle for another FMSPC = %v, want %v naming the FMSPC", err, tdx.ErrCollateralUnavailable)
	}
}

func TestParseCollateralBundleRejects(t *testing.T) {
	p, err := tdxtest.New(tdxtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	good, err := p.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	entry := string(good[strings.Index(string(good), `"collateral": [`)+len(`"collateral": [`) : strings.LastIndex(string(good), "]")])
	testCases := map[string]string{
		"not JSON":          "collateral: yes",
		"other version":     strings.Replace(string(good), `"version": 1`, `"version": 2`, 1),
		"no collateral":     `{"version": 1, "collateral": []}`,
		"bad CA":            strings.Replace(string(good), `"ca": "platform"`, `"ca": "root"`, 1),
		"bad FMSPC":         strings.Replace(string(good), `"fmspc": "00806f050000"`, `"fmspc": "00806F050000"`, 1),
		"entry twice":       `{"version": 1, "collateral": [` + entry + `,` + entry + `]}`,
		"unparsable TCB":    strings.Replace(string(good), `"tcbInfo": "`, `"tcbInfo": "AAAA`, 1),
		"no collateral set": `{"version": 1, "collateral": [{"ca": "platform", "fmspc": "00806f050000"}]}`,
		"unknown field":     strings.Replace(string(good), `"version": 1`, `"version": 1, "url": "x"`, 1),
		"trailing data":     string(good) + "{}",
		"oversized":         string(good) + strings.Repeat(" ", tdx.MaxBundleSize),
	}
	for name, data := range testCases {
		t.Run(name, func(t *testing.T) {
			if data == string(good) {
				t.Fatal("the case does not change the bundle")
			}
			if _, err := tdx.ParseCollateralBundle([]byte(data)); !errors.Is(err, tdx.ErrBadCollateralBundle) {
				t.Fatalf("ParseCollateralBundle() = %v, want %v", err, tdx.ErrBadCollateralBundle)
			}
		})
	}
	if _, err := tdx.MarshalCollateralBundle(map[tdx.CollateralRequest]*tdx.Collateral{{CA: "root", FMSPC: "00806f050000"}: p.Collateral()}); err == nil {
		t.Error("MarshalCollateralBundle() with a bad CA = nil error")
	}
}

// With neither a bundle nor a cache, an unreachable PCS makes the quote fail with the named error.
func TestPCSUnreachable(t *testing.T) {
	p, err := tdxtest.New(tdxtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + lis.Addr().String()
	lis.Close()
	getter := tdx.NewCachingGetter(tdx.CachingGetterConfig{Upstream: &tdx.PCSGetter{BaseURL: closed}})
	err = validateWith(t, p, getter)
	if !errors.Is(err, tdx.ErrCollateralUnavailable) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("validation with an unreachable PCS = %v, want %v saying why", err, tdx.ErrCollateralUnavailable)
	}
}
