package tdx_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/edgelesssys/go-tdx-qpl/blobs"
	"go.uber.org/goleak"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var testNow = time.Date(2026, 11, 21, 6, 0, 0, 0, time.UTC)

func newPlatform(t testing.TB, opts tdxtest.Options) *tdxtest.Platform {
	t.Helper()
	if opts.Now.IsZero() {
		opts.Now = testNow
	}
	p, err := tdxtest.New(opts)
	if err != nil {
		t.Fatalf("tdxtest.New() = %v", err)
	}
	return p
}

func newValidator(t testing.TB, p *tdxtest.Platform, now time.Time, accepted []string, policy tdx.MeasurementPolicy) *tdx.Validator {
	t.Helper()
	v, err := tdx.NewVerifier(tdx.VerifierConfig{
		Roots:               p.Roots(),
		Collateral:          tdx.StaticCollateral{Collateral: p.Collateral()},
		Now:                 func() time.Time { return now },
		AcceptedTCBStatuses: accepted,
	})
	if err != nil {
		t.Fatalf("NewVerifier() = %v", err)
	}
	val, err := tdx.NewValidator(v, policy, nil)
	if err != nil {
		t.Fatalf("NewValidator() = %v", err)
	}
	return val
}

func TestIssueValidate(t *testing.T) {
	mrtd := bytes.Repeat([]byte{0xab}, tdx.MeasurementSize)
	otherMRTD := bytes.Repeat([]byte{0xcd}, tdx.MeasurementSize)
	userData := []byte("sha-256 of the TLS public key")
	nonce := []byte("fresh nonce")

	testCases := map[string]struct {
		opts         tdxtest.Options
		verifierRoot *tdxtest.Platform // validate against another platform's root and collateral
		now          time.Time
		accepted     []string
		expected     map[uint32][]byte
		nonce        []byte
		tamper       func([]byte) []byte
		wantErr      error
		wantWarnings int
		wantInErr    []string
	}{
		"valid": {
			expected: map[uint32][]byte{0: mrtd},
		},
		"wrong nonce": {
			nonce:   []byte("replayed nonce"),
			wantErr: attestation.ErrNonceMismatch,
		},
		"other user data in document": {
			tamper: func(doc []byte) []byte {
				d, err := tdx.ParseDocument(doc)
				if err != nil {
					t.Fatal(err)
				}
				d.UserData = []byte("sha-256 of another TLS key")
				out, err := d.Marshal()
				if err != nil {
					t.Fatal(err)
				}
				return out
			},
			wantErr: attestation.ErrNonceMismatch,
		},
		"MRTD mismatch": {
			expected:  map[uint32][]byte{0: otherMRTD},
			wantErr:   attestation.ErrMeasurementMismatch,
			wantInErr: []string{"index 0", "expected cdcdcd", "actual ababab"},
		},
		"RTMR3 mismatch": {
			expected:  map[uint32][]byte{4: bytes.Repeat([]byte{1}, 48)},
			wantErr:   attestation.ErrMeasurementMismatch,
			wantInErr: []string{"index 4"},
		},
		"untrusted root": {
			verifierRoot: newPlatform(t, tdxtest.Options{}),
			wantErr:      attestation.ErrUntrustedRoot,
		},
		"PCK certificate revoked": {
			opts:    tdxtest.Options{RevokePCK: true},
			wantErr: tdx.ErrRevoked,
		},
		"PCK CA revoked by root CRL": {
			opts:    tdxtest.Options{RevokePCKCA: true},
			wantErr: tdx.ErrRevoked,
		},
		"TCB out of date": {
			opts:      tdxtest.Options{TCBStatus: tdx.TCBOutOfDate},
			wantErr:   tdx.ErrTCBStatus,
			wantInErr: []string{"OutOfDate"},
		},
		"TCB out of date accepted with warning": {
			opts:         tdxtest.Options{TCBStatus: tdx.TCBOutOfDate},
			accepted:     []string{tdx.TCBUpToDate, tdx.TCBOutOfDate},
			wantWarnings: 1,
		},
		"debug TD": {
			opts:    tdxtest.Options{Debug: true},
			wantErr: tdx.ErrDebugTD,
		},
		"collateral expired": {
			now:     testNow.Add(60 * 24 * time.Hour),
			wantErr: tdx.ErrCollateral,
		},
		"truncated document": {
			tamper:  func(doc []byte) []byte { return doc[:len(doc)/2] },
			wantErr: attestation.ErrMalformed,
		},
		"garbage document": {
			tamper:  func([]byte) []byte { return []byte("garbage garbage garbage") },
			wantErr: attestation.ErrMalformed,
		},
		"broken quote signature": {
			tamper: func(doc []byte) []byte {
				out := bytes.Clone(doc)
				quoteStart := 14 + len(userData)
				out[quoteStart+48+584+4+10] ^= 0xff // inside the quote's ECDSA signature
				return out
			},
			wantErr: attestation.ErrBadSignature,
		},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			tc.opts.MRTD = [48]byte(mrtd)
			p := newPlatform(t, tc.opts)
			ctx := context.Background()

			iss := tdx.NewIssuer(p.Open, nil)
			doc, err := iss.Issue(ctx, userData, nonce)
			if err != nil {
				t.Fatalf("Issue() = %v", err)
			}
			if tc.tamper != nil {
				doc = tc.tamper(doc)
			}
			verifierPlatform := p
			if tc.verifierRoot != nil {
				verifierPlatform = tc.verifierRoot
			}
			now := tc.now
			if now.IsZero() {
				now = testNow
			}
			expected := tc.expected
			if expected == nil {
				expected = map[uint32][]byte{}
			}
			val := newValidator(t, verifierPlatform, now, tc.accepted, tdx.ExpectMeasurements(expected))
			validateNonce := nonce
			if tc.nonce != nil {
				validateNonce = tc.nonce
			}

			res, err := val.Validate(ctx, doc, validateNonce)
			if tc.wantErr != nil {
				t.Logf("Validate() = %v", err)
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("Validate() = %v, want %v", err, tc.wantErr)
				}
				for _, s := range tc.wantInErr {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("Validate() error %q does not contain %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Validate() = %v", err)
			}
			if res.Variant != "tdx" || !bytes.Equal(res.UserData, userData) {
				t.Errorf("Validate() = variant %q user data %q, want tdx and %q", res.Variant, res.UserData, userData)
			}
			if !bytes.Equal(res.Measurements[0], mrtd) || len(res.Measurements) != 5 {
				t.Errorf("Validate() measurements = %x, want 5 with MRTD %x", res.Measurements, mrtd)
			}
			if len(res.Warnings) != tc.wantWarnings {
				t.Errorf("Validate() warnings = %q, want %d", res.Warnings, tc.wantWarnings)
			}
		})
	}
}

func TestVariant(t *testing.T) {
	p := newPlatform(t, tdxtest.Options{})
	if got := tdx.NewIssuer(p.Open, nil).Variant(); got != "tdx" {
		t.Errorf("Issuer.Variant() = %q", got)
	}
	if got := newValidator(t, p, testNow, nil, tdx.ExpectMeasurements(nil)).Variant(); got != "tdx" {
		t.Errorf("Validator.Variant() = %q", got)
	}
}

func TestNewValidatorRequiresPolicy(t *testing.T) {
	p := newPlatform(t, tdxtest.Options{})
	v, err := tdx.NewVerifier(tdx.VerifierConfig{Roots: p.Roots(), Collateral: tdx.StaticCollateral{Collateral: p.Collateral()}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tdx.NewValidator(v, nil, nil); err == nil {
		t.Error("NewValidator(nil policy) = nil error")
	}
	if _, err := tdx.NewVerifier(tdx.VerifierConfig{Collateral: tdx.StaticCollateral{}}); err == nil {
		t.Error("NewVerifier(no roots) = nil error")
	}
}

func TestIssueErrors(t *testing.T) {
	p := newPlatform(t, tdxtest.Options{})
	iss := tdx.NewIssuer(p.Open, nil)
	if _, err := iss.Issue(context.Background(), make([]byte, tdx.MaxUserDataSize+1), nil); err == nil {
		t.Error("Issue(oversized user data) = nil error")
	}
	failing := tdx.NewIssuer(func() (tdx.Device, error) { return nil, tdx.ErrNoDevice }, nil)
	if _, err := failing.Issue(context.Background(), nil, nil); !errors.Is(err, tdx.ErrNoDevice) {
		t.Errorf("Issue() without device = %v, want %v", err, tdx.ErrNoDevice)
	}
	stale := tdx.NewIssuer(func() (tdx.Device, error) { return sampleDevice{quote: blobs.TDXQuote(), keep: true}, nil }, nil)
	if _, err := stale.Issue(context.Background(), nil, nil); err == nil {
		t.Error("Issue() with a device that returns a quote over other report data = nil error")
	}
	garbage := tdx.NewIssuer(func() (tdx.Device, error) { return sampleDevice{quote: []byte("x"), keep: true}, nil }, nil)
	if _, err := garbage.Issue(context.Background(), nil, nil); err == nil {
		t.Error("Issue() with a device that returns garbage = nil error")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := iss.Issue(ctx, nil, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("Issue(cancelled) = %v, want %v", err, context.Canceled)
	}
}

func TestLockRegister(t *testing.T) {
	p := newPlatform(t, tdxtest.Options{})
	ctx := context.Background()
	lock, err := tdx.NewLockRegister(p.Open, tdx.DefaultLockRTMR)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := lock.Bootstrapped(ctx); err != nil || ok {
		t.Fatalf("fresh Bootstrapped() = %v, %v; want false, nil", ok, err)
	}
	clusterID := []byte("cluster-1")
	if err := lock.MarkBootstrapped(ctx, clusterID); err != nil {
		t.Fatalf("MarkBootstrapped() = %v", err)
	}
	if ok, err := lock.Bootstrapped(ctx); err != nil || !ok {
		t.Fatalf("Bootstrapped() after mark = %v, %v; want true, nil", ok, err)
	}

	// A verifier can require the peer to be locked into its own cluster through the RTMR3 expectation.
	doc, err := tdx.NewIssuer(p.Open, nil).Issue(ctx, nil, []byte("n"))
	if err != nil {
		t.Fatal(err)
	}
	idx := uint32(tdx.DefaultLockRTMR + 1)
	if _, err := newValidator(t, p, testNow, nil, tdx.ExpectMeasurements(map[uint32][]byte{idx: tdx.ExpectedLockRTMR(clusterID)})).Validate(ctx, doc, []byte("n")); err != nil {
		t.Errorf("Validate(expect own cluster lock) = %v", err)
	}
	_, err = newValidator(t, p, testNow, nil, tdx.ExpectMeasurements(map[uint32][]byte{idx: tdx.ExpectedLockRTMR([]byte("cluster-2"))})).Validate(ctx, doc, []byte("n"))
	if !errors.Is(err, attestation.ErrMeasurementMismatch) {
		t.Errorf("Validate(expect other cluster lock) = %v, want %v", err, attestation.ErrMeasurementMismatch)
	}

	if _, err := tdx.NewLockRegister(p.Open, 4); err == nil {
		t.Error("NewLockRegister(4) = nil error")
	}
}
