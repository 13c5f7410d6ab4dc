package tdx_test

import (
	"context"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/tdx/tdxtest"
)

// FuzzVerifyQuote runs the whole verifier on quotes whose signed parts the fuzzer writes: the header and TD quote
// body, and the quoting enclave's report. A software platform (tdxtest) signs them as a real QE would, so every
// mutation passes the signatures and reaches what comes after them: the header checks, QE identity matching, the
// TCB level and TDX module search, the debug attribute and the status policy. The PCK chain and collateral are
// checked once and then taken from the verifier's caches, so an execution costs two signatures and two
// verifications. Whatever the verifier accepts must carry the body it was given.
func FuzzVerifyQuote(f *testing.F) {
	p, err := tdxtest.New(tdxtest.Options{Now: testNow})
	if err != nil {
		f.Fatal(err)
	}
	v, err := tdx.NewVerifier(tdx.VerifierConfig{
		Roots: p.Roots(), Collateral: tdx.StaticCollateral{Collateral: p.Collateral()},
		AcceptedTCBStatuses: []string{tdx.TCBUpToDate, tdx.TCBSWHardeningNeeded, tdx.TCBOutOfDate},
		Now:                 func() time.Time { return testNow },
	})
	if err != nil {
		f.Fatal(err)
	}
	genuine, err := p.Quote([tdx.ReportDataSize]byte{1, 2, 3})
	if err != nil {
		f.Fatal(err)
	}
	q, err := tdx.ParseQuote(genuine)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(q.SignedBytes, q.RawQEReport)
	f.Fuzz(func(t *testing.T, signed, qeReport []byte) {
		signed = fit(signed, tdxtest.SignedQuoteSize)
		qeReport = fit(qeReport, tdxtest.QEReportSize)
		raw, err := p.SignQuote(signed, qeReport)
		if err != nil {
			t.Fatal(err)
		}
		vq, err := v.VerifyQuote(context.Background(), raw)
		if err != nil {
			return
		}
		if string(vq.SignedBytes) != string(signed) || vq.TCBStatus == "" {
			t.Fatalf("accepted quote does not carry the signed body it was given (TCB status %q)", vq.TCBStatus)
		}
	})
}

// fit pads b with zeros or cuts it to n bytes.
func fit(b []byte, n int) []byte {
	out := make([]byte, n)
	copy(out, b)
	return out
}
