package tdx

import (
	"bytes"
	"errors"
	"testing"

	"github.com/edgelesssys/go-tdx-qpl/blobs"

	"github.com/berth-k8s/berth/internal/pemcerts"
)

func TestDocumentRoundTrip(t *testing.T) {
	for name, d := range map[string]Document{
		"empty":         {},
		"sample quote":  {UserData: []byte("user data"), Quote: blobs.TDXQuote()},
		"max user data": {UserData: bytes.Repeat([]byte{7}, MaxUserDataSize), Quote: []byte{1}},
	} {
		t.Run(name, func(t *testing.T) {
			b, err := d.Marshal()
			if err != nil {
				t.Fatalf("Marshal() = %v", err)
			}
			got, err := ParseDocument(b)
			if err != nil {
				t.Fatalf("ParseDocument() = %v", err)
			}
			if !bytes.Equal(got.UserData, d.UserData) || !bytes.Equal(got.Quote, d.Quote) {
				t.Errorf("ParseDocument(Marshal(d)) = %+v, want %+v", got, d)
			}
		})
	}
}

func TestParseDocumentRejects(t *testing.T) {
	good, err := (&Document{UserData: []byte("u"), Quote: []byte("quote")}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	withVersion := func(v byte) []byte { b := bytes.Clone(good); b[5] = v; return b }
	for name, b := range map[string][]byte{
		"nil":               nil,
		"magic only":        []byte("BTDX"),
		"wrong magic":       append([]byte("XTDX"), good[4:]...),
		"unknown version":   withVersion(2),
		"truncated":         good[:len(good)-1],
		"trailing bytes":    append(bytes.Clone(good), 0),
		"huge user data":    append([]byte("BTDX\x00\x01\xff\xff\xff\xff"), make([]byte, 16)...),
		"no quote length":   good[:11],
		"user data too big": append([]byte("BTDX\x00\x01\x00\x00\x10\x01"), make([]byte, 4097+4)...),
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := ParseDocument(b); !errors.Is(err, errDocument) {
				t.Errorf("ParseDocument() = %v, want %v", err, errDocument)
			}
		})
	}
	if _, err := (&Document{UserData: make([]byte, MaxUserDataSize+1)}).Marshal(); err == nil {
		t.Error("Marshal(oversized user data) = nil error")
	}
}

func TestReportDataIsInjective(t *testing.T) {
	// Moving bytes between user data and nonce must change the report data.
	a := ReportData([]byte("ab"), []byte("c"))
	b := ReportData([]byte("a"), []byte("bc"))
	c := ReportData([]byte("ab"), []byte("c"))
	if a == b {
		t.Error("ReportData(ab, c) == ReportData(a, bc)")
	}
	if a != c {
		t.Error("ReportData is not deterministic")
	}
}

// FuzzParseDocument feeds arbitrary bytes through everything a validator runs on an untrusted document before any
// signature check: the envelope, the quote and the PCK chain's extensions. None of it may panic, and whatever
// parses must round-trip.
func FuzzParseDocument(f *testing.F) {
	sample, err := (&Document{UserData: []byte("user"), Quote: blobs.TDXQuote()}).Marshal()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(sample)
	f.Add([]byte("BTDX\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := ParseDocument(b)
		if err != nil {
			return
		}
		again, err := d.Marshal()
		if err != nil {
			t.Fatalf("Marshal() of a parsed document = %v", err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("Marshal(ParseDocument(b)) != b")
		}
		q, err := ParseQuote(d.Quote)
		if err != nil {
			return
		}
		_ = q.Measurements()
		certs, err := pemcerts.Parse(q.PCKChainPEM)
		if err != nil {
			return
		}
		_, _ = parsePCKExtensions(certs[0])
	})
}

// FuzzParseQuote mutates the sample quote directly, which reaches deeper into the quote layout than mutating a
// whole document. It stays with the layout (no PEM or X.509 parsing, FuzzPCKChain does that), so that an
// execution costs microseconds.
func FuzzParseQuote(f *testing.F) {
	f.Add(blobs.TDXQuote())
	f.Fuzz(func(t *testing.T, b []byte) {
		q, err := ParseQuote(b)
		if err != nil {
			return
		}
		if len(q.SignedBytes) != signedQuoteSize || len(q.RawQEReport) != enclaveReportSize {
			t.Fatalf("parsed quote with %d signed bytes and a %d-byte QE report", len(q.SignedBytes), len(q.RawQEReport))
		}
		if m := q.Measurements(); m[0] != q.Body.MRTD || m[4] != q.Body.RTMR[3] {
			t.Fatal("Measurements() does not return MRTD and RTMR0..3 in order")
		}
	})
}

// FuzzPCKChain parses a quote's PEM PCK certificate chain and the SGX extensions of its leaf, the untrusted
// certificate content a verifier reads before it checks the chain.
func FuzzPCKChain(f *testing.F) {
	q, err := ParseQuote(blobs.TDXQuote())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(q.PCKChainPEM)
	f.Fuzz(func(t *testing.T, b []byte) {
		certs, err := pemcerts.Parse(b)
		if err != nil || len(certs) == 0 {
			return
		}
		_, _ = parsePCKExtensions(certs[0])
	})
}

// FuzzCollateral decodes arbitrary TCB info and QE identity bodies, the untrusted part of collateral an upstream
// or a cache file supplies, with the same code the verifier uses, and matches the sample quote's platform, TDX
// module and quoting enclave against what decoded: the TCB level search, module identities and masks run on
// fuzzed collateral. The fixed parts of the collateral (CRLs, certificate chains) are not parsed per execution.
func FuzzCollateral(f *testing.F) {
	q, err := ParseQuote(blobs.TDXQuote())
	if err != nil {
		f.Fatal(err)
	}
	certs, err := pemcerts.Parse(q.PCKChainPEM)
	if err != nil {
		f.Fatal(err)
	}
	ext, err := parsePCKExtensions(certs[0])
	if err != nil {
		f.Fatal(err)
	}
	f.Add(blobs.TCBInfoJSON, blobs.QEIdentityJSON)
	f.Add([]byte(`{"tcbInfo":{},"signature":"00"}`), []byte(`{}`))
	f.Fuzz(func(t *testing.T, tcb, qe []byte) {
		var ti tcbInfo
		if _, err := parseSignedJSON(tcb, "tcbInfo", &ti); err == nil {
			if level, _, err := checkTCB(&ti, ext, &q.Body); err == nil && (level == nil || !bytes.Equal(ti.FMSPC, ext.FMSPC[:])) {
				t.Fatalf("checkTCB() matched TCB info for FMSPC %x (level %v) to the platform %x", []byte(ti.FMSPC), level, ext.FMSPC)
			}
		}
		var id qeIdentity
		if _, err := parseSignedJSON(qe, "enclaveIdentity", &id); err == nil {
			if _, err := checkQEIdentity(&id, &q.QEReport); err == nil && !bytes.Equal(id.MRSIGNER, q.QEReport.MRSIGNER[:]) {
				t.Fatalf("checkQEIdentity() matched a QE identity for MRSIGNER %x to the report's %x", []byte(id.MRSIGNER), q.QEReport.MRSIGNER)
			}
		}
	})
}
