package tdx_test

import (
	"context"
	"testing"
	"time"

	"github.com/edgelesssys/go-tdx-qpl/blobs"

	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
)

// sampleDevice returns the recorded sample quote with the requested report data patched in (so its signature no
// longer holds, which Issue does not check): Issue's own cost without quote signing.
type sampleDevice struct {
	quote []byte
	keep  bool // return the quote unchanged, with its original report data
}

func (d sampleDevice) Quote(_ context.Context, rd [tdx.ReportDataSize]byte) ([]byte, error) {
	q := append([]byte{}, d.quote...)
	if !d.keep {
		copy(q[48+520:], rd[:])
	}
	return q, nil
}
func (sampleDevice) ExtendRTMR(context.Context, int, []byte) error { return nil }
func (sampleDevice) Measurements(context.Context) ([5][tdx.MeasurementSize]byte, error) {
	return [5][tdx.MeasurementSize]byte{}, nil
}
func (sampleDevice) Close() error { return nil }

func BenchmarkIssue(b *testing.B) {
	userData, nonce := make([]byte, 32), make([]byte, 32)
	b.Run("recorded-quote-device", func(b *testing.B) {
		dev := sampleDevice{quote: blobs.TDXQuote()}
		iss := tdx.NewIssuer(func() (tdx.Device, error) { return dev, nil }, nil)
		for b.Loop() {
			if _, err := iss.Issue(context.Background(), userData, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("software-TD-signing", func(b *testing.B) {
		p := newPlatform(b, tdxtest.Options{})
		iss := tdx.NewIssuer(p.Open, nil)
		for b.Loop() {
			if _, err := iss.Issue(context.Background(), userData, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The joinservice's path: configfs-tsm (a report directory, inblob written, outblob read, the generation
	// checked), served by the software TD over FUSE. A real TD's time adds the host's quoting service and the
	// kernel's polling for its answer.
	b.Run("software-TD-configfs-tsm", func(b *testing.B) {
		p := newPlatform(b, tdxtest.Options{})
		root := b.TempDir()
		tdxtest.ServeTSM(b, p.NewTD(), root)
		iss := tdx.NewIssuer(tdx.OpenAutoUnder(root), nil)
		for b.Loop() {
			if _, err := iss.Issue(context.Background(), userData, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkVerifySampleQuote(b *testing.B) {
	quote := blobs.TDXQuote()
	col := sampleCollateralExternal()
	v, err := tdx.NewVerifier(tdx.VerifierConfig{
		Roots: tdx.IntelSGXRootCA(), Collateral: tdx.StaticCollateral{Collateral: col}, Now: func() time.Time { return blobs.PCSIssueDate },
	})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := v.VerifyQuote(context.Background(), quote); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkValidate(b *testing.B) {
	p := newPlatform(b, tdxtest.Options{})
	nonce := []byte("nonce")
	doc, err := tdx.NewIssuer(p.Open, nil).Issue(context.Background(), []byte("user data"), nonce)
	if err != nil {
		b.Fatal(err)
	}
	val := newValidator(b, p, testNow, nil, tdx.ExpectMeasurements(map[uint32][]byte{0: make([]byte, 48)}))
	b.Run("accepted", func(b *testing.B) {
		for b.Loop() {
			if _, err := val.Validate(context.Background(), doc, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("rejected-nonce", func(b *testing.B) {
		for b.Loop() {
			if _, err := val.Validate(context.Background(), doc, []byte("other")); err == nil {
				b.Fatal("accepted")
			}
		}
	})
	b.Run("rejected-garbage", func(b *testing.B) {
		for b.Loop() {
			if _, err := val.Validate(context.Background(), []byte("garbage"), nonce); err == nil {
				b.Fatal("accepted")
			}
		}
	})
}

func sampleCollateralExternal() *tdx.Collateral {
	withRoot := func(pemCert []byte) []byte { return append(append([]byte{}, pemCert...), tdx.IntelSGXRootCAPEM...) }
	return &tdx.Collateral{
		PCKCRL: blobs.PCKCRLDER(), PCKCRLIssuerChain: withRoot(blobs.CRLSigningCertPEM),
		TCBInfo: blobs.TCBInfoJSON, TCBInfoIssuerChain: withRoot(blobs.TCBSigningCertPEM),
		QEIdentity: blobs.QEIdentityJSON, QEIdentityIssuerChain: withRoot(blobs.TCBSigningCertPEM),
	}
}
