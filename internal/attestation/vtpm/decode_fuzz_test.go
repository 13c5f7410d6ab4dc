package vtpm

import (
	"bytes"
	"slices"
	"testing"

	"github.com/google/go-tpm/tpm2"
)

// The validator decodes quotes, creation certifications and signatures by hand (decode.go). These
// targets check it against go-tpm's reflective decoder on arbitrary bytes: whatever the hand decoder
// accepts, go-tpm decodes to the same values, so the speed-up cannot widen what a validation accepts.

func seedAttest(typ tpm2.TPMST) []byte {
	a := tpm2.TPMSAttest{
		Magic: tpm2.TPMGeneratedValue, Type: typ,
		QualifiedSigner: tpm2.TPM2BName{Buffer: bytes.Repeat([]byte{1}, 34)},
		ExtraData:       tpm2.TPM2BData{Buffer: bytes.Repeat([]byte{2}, 32)},
		ClockInfo:       tpm2.TPMSClockInfo{Clock: 1000, ResetCount: 1, RestartCount: 2, Safe: true},
		FirmwareVersion: 7,
	}
	if typ == tpm2.TPMSTAttestQuote {
		a.Attested = tpm2.NewTPMUAttest(typ, &tpm2.TPMSQuoteInfo{
			PCRSelect: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: []byte{0xff, 0xff, 0xff}}}},
			PCRDigest: tpm2.TPM2BDigest{Buffer: bytes.Repeat([]byte{3}, 32)},
		})
	} else {
		a.Attested = tpm2.NewTPMUAttest(typ, &tpm2.TPMSCreationInfo{
			ObjectName: tpm2.TPM2BName{Buffer: bytes.Repeat([]byte{4}, 34)}, CreationHash: tpm2.TPM2BDigest{Buffer: bytes.Repeat([]byte{5}, 32)},
		})
	}
	return tpm2.Marshal(a)
}

func FuzzDecodeAttest(f *testing.F) {
	f.Add(seedAttest(tpm2.TPMSTAttestQuote))
	f.Add(seedAttest(tpm2.TPMSTAttestCreation))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeAttest(b)
		if err != nil {
			return
		}
		want, err := tpm2.Unmarshal[tpm2.TPMSAttest](b)
		if err != nil {
			t.Fatalf("decodeAttest accepted what go-tpm refuses: %v", err)
		}
		if want.Magic != tpm2.TPMGeneratedValue || want.Type != got.typ || !bytes.Equal(want.ExtraData.Buffer, got.extraData) {
			t.Fatalf("header: go-tpm %#x %v %x, decodeAttest %v %x", want.Magic, want.Type, want.ExtraData.Buffer, got.typ, got.extraData)
		}
		if got.typ == tpm2.TPMSTAttestQuote {
			q, err := want.Attested.Quote()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(q.PCRDigest.Buffer, got.pcrDigest) || len(q.PCRSelect.PCRSelections) != len(got.pcrBanks) {
				t.Fatalf("quote: go-tpm %+v, decodeAttest %+v", q, got)
			}
			for i, s := range q.PCRSelect.PCRSelections {
				if s.Hash != got.pcrBanks[i].hash || !slices.Equal(s.PCRSelect, got.pcrBanks[i].bitmap) {
					t.Fatalf("PCR selection %d: go-tpm %v %x, decodeAttest %v %x", i, s.Hash, s.PCRSelect, got.pcrBanks[i].hash, got.pcrBanks[i].bitmap)
				}
			}
			return
		}
		c, err := want.Attested.Creation()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(c.ObjectName.Buffer, got.objectName) || !bytes.Equal(c.CreationHash.Buffer, got.creationHash) {
			t.Fatalf("creation: go-tpm %x %x, decodeAttest %x %x", c.ObjectName.Buffer, c.CreationHash.Buffer, got.objectName, got.creationHash)
		}
	})
}

func FuzzDecodeSignature(f *testing.F) {
	f.Add(tpm2.Marshal(tpm2.TPMTSignature{SigAlg: tpm2.TPMAlgECDSA, Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgECDSA, &tpm2.TPMSSignatureECC{
		Hash: tpm2.TPMAlgSHA256, SignatureR: tpm2.TPM2BECCParameter{Buffer: bytes.Repeat([]byte{1}, 32)}, SignatureS: tpm2.TPM2BECCParameter{Buffer: bytes.Repeat([]byte{2}, 32)},
	})}))
	f.Add(tpm2.Marshal(tpm2.TPMTSignature{SigAlg: tpm2.TPMAlgRSASSA, Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgRSASSA, &tpm2.TPMSSignatureRSA{
		Hash: tpm2.TPMAlgSHA256, Sig: tpm2.TPM2BPublicKeyRSA{Buffer: bytes.Repeat([]byte{3}, 256)},
	})}))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeSignature(b)
		if err != nil {
			return
		}
		want, err := tpm2.Unmarshal[tpm2.TPMTSignature](b)
		if err != nil {
			t.Fatalf("decodeSignature accepted what go-tpm refuses: %v", err)
		}
		if want.SigAlg != got.alg {
			t.Fatalf("algorithm: go-tpm %v, decodeSignature %v", want.SigAlg, got.alg)
		}
		switch got.alg {
		case tpm2.TPMAlgECDSA:
			e, err := want.Signature.ECDSA()
			if err != nil || e.Hash != got.hash || !bytes.Equal(e.SignatureR.Buffer, got.r) || !bytes.Equal(e.SignatureS.Buffer, got.s) {
				t.Fatalf("ECDSA: go-tpm %+v (%v), decodeSignature %+v", e, err, got)
			}
		case tpm2.TPMAlgRSASSA:
			r, err := want.Signature.RSASSA()
			if err != nil || r.Hash != got.hash || !bytes.Equal(r.Sig.Buffer, got.rsa) {
				t.Fatalf("RSASSA: go-tpm %+v (%v), decodeSignature %+v", r, err, got)
			}
		}
	})
}
