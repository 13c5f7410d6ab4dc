package tdxtest_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestServeTSM quotes through the FUSE configfs-tsm with the production backend (tdx.OpenAutoUnder): the quote
// verifies against the platform's bundle, binds the report data, carries the TD's own RTMRs (not another TD's on
// the same platform), and every report directory is gone afterwards.
func TestServeTSM(t *testing.T) {
	ctx := context.Background()
	p, err := tdxtest.New(tdxtest.Options{MRTD: [48]byte{1, 2, 3}})
	if err != nil {
		t.Fatal(err)
	}
	served, other := p.NewTD(), p.NewTD()
	lock, err := tdx.NewLockRegister(served.Open, tdx.DefaultLockRTMR)
	if err != nil {
		t.Fatal(err)
	}
	if err := lock.MarkBootstrapped(ctx, []byte("cluster")); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	tdxtest.ServeTSM(t, served, root)

	bundle, err := p.Bundle()
	if err != nil {
		t.Fatal(err)
	}
	b, err := tdx.ParseCollateralBundle(bundle)
	if err != nil {
		t.Fatal(err)
	}
	verifier, err := tdx.NewVerifier(tdx.VerifierConfig{Roots: p.Roots(), Collateral: b})
	if err != nil {
		t.Fatal(err)
	}
	wantLock := tdx.ExpectedLockRTMR([]byte("cluster"))
	validator, err := tdx.NewValidator(verifier, tdx.ExpectMeasurements(map[uint32][]byte{0: append([]byte{1, 2, 3}, make([]byte, 45)...), 4: wantLock}), nil)
	if err != nil {
		t.Fatal(err)
	}

	issuer := tdx.NewIssuer(tdx.OpenAutoUnder(root), nil)
	for i := range 3 { // each quote is a report directory of its own
		doc, err := issuer.Issue(ctx, []byte("key"), []byte{byte(i)})
		if err != nil {
			t.Fatalf("Issue() through configfs-tsm: %v", err)
		}
		res, err := validator.Validate(ctx, doc, []byte{byte(i)})
		if err != nil {
			t.Fatalf("Validate() = %v", err)
		}
		if string(res.UserData) != "key" {
			t.Fatalf("user data %q", res.UserData)
		}
		if _, err := validator.Validate(ctx, doc, []byte("another nonce")); !errors.Is(err, attestation.ErrNonceMismatch) {
			t.Fatalf("Validate(another nonce) = %v, want %v", err, attestation.ErrNonceMismatch)
		}
	}
	entries, err := os.ReadDir(filepath.Join(root, tdx.TSMReportDir))
	if err != nil || len(entries) != 0 {
		t.Fatalf("report directory after the quotes: %v, %v; want empty", entries, err)
	}

	// The other TD on the platform has a fresh lock RTMR: its quotes fail the expectation.
	doc, err := tdx.NewIssuer(other.Open, nil).Issue(ctx, nil, []byte("n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validator.Validate(ctx, doc, []byte("n")); !errors.Is(err, attestation.ErrMeasurementMismatch) {
		t.Fatalf("Validate(other TD) = %v, want %v", err, attestation.ErrMeasurementMismatch)
	}

	// Attributes refuse what configfs refuses: writing a read-only one, reading inblob.
	dir := filepath.Join(root, tdx.TSMReportDir, "r")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(dir)
	if err := os.WriteFile(filepath.Join(dir, "outblob"), []byte("x"), 0); err == nil {
		t.Error("writing outblob succeeded")
	}
	if _, err := os.ReadFile(filepath.Join(dir, "inblob")); err == nil {
		t.Error("reading inblob succeeded")
	}
	if err := os.WriteFile(filepath.Join(dir, "inblob"), make([]byte, tdx.ReportDataSize+1), 0); err == nil {
		t.Error("writing 65 bytes of report data succeeded")
	}
}
