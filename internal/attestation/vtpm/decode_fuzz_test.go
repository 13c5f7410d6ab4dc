package vtpm

import (
	"bytes"
	"encoding/binary"
	"reflect"
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

func seedPublics() [][]byte {
	rsaEK := tpm2.RSAEKTemplate
	rsaEK.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgRSA, &tpm2.TPM2BPublicKeyRSA{Buffer: bytes.Repeat([]byte{0xc5}, 256)})
	eccAK := tpm2.TPMTPublic{
		Type: tpm2.TPMAlgECC, NameAlg: tpm2.TPMAlgSHA256,
		ObjectAttributes: tpm2.TPMAObject{FixedTPM: true, FixedParent: true, SensitiveDataOrigin: true, UserWithAuth: true, Restricted: true, SignEncrypt: true},
		Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
			CurveID: tpm2.TPMECCNistP256,
			Scheme: tpm2.TPMTECCScheme{Scheme: tpm2.TPMAlgECDSA, Details: tpm2.NewTPMUAsymScheme(tpm2.TPMAlgECDSA,
				&tpm2.TPMSSigSchemeECDSA{HashAlg: tpm2.TPMAlgSHA256})},
		}),
		Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{X: tpm2.TPM2BECCParameter{Buffer: bytes.Repeat([]byte{1}, 32)},
			Y: tpm2.TPM2BECCParameter{Buffer: bytes.Repeat([]byte{2}, 32)}}),
	}
	return [][]byte{tpm2.Marshal(rsaEK), tpm2.Marshal(eccAK), tpm2.Marshal(tpm2.ECCEKTemplate)}
}

// FuzzDecodePublic: whatever decodePublic accepts, go-tpm decodes to the same attributes, key (or key
// error) and name.
func FuzzDecodePublic(f *testing.F) {
	for _, s := range seedPublics() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, ok := decodePublic(b)
		if !ok {
			return
		}
		want, err := tpm2.Unmarshal[tpm2.TPMTPublic](b)
		if err != nil {
			t.Fatalf("decodePublic accepted what go-tpm refuses: %v", err)
		}
		if attrs := tpm2.Marshal(want.ObjectAttributes); !bytes.Equal(attrs, binary.BigEndian.AppendUint32(nil, got.attrs)) {
			t.Fatalf("attributes: go-tpm %x, decodePublic %#x", attrs, got.attrs)
		}
		key, keyErr := tpm2.Pub(*want)
		if (keyErr != nil) != (got.keyErr != nil) {
			t.Fatalf("key errors: go-tpm %v, decodePublic %v", keyErr, got.keyErr)
		}
		if keyErr == nil && !reflect.DeepEqual(key, got.key) {
			t.Fatalf("keys: go-tpm %+v, decodePublic %+v", key, got.key)
		}
		name, err := tpm2.ObjectName(want)
		if err != nil || !bytes.Equal(name.Buffer, got.name) {
			t.Fatalf("names: go-tpm %x (%v), decodePublic %x", name, err, got.name)
		}
	})
}

// FuzzDecodeCreationData: whatever decodeCreationData accepts, go-tpm decodes to the same parent
// name.
func FuzzDecodeCreationData(f *testing.F) {
	f.Add(tpm2.Marshal(tpm2.TPMSCreationData{
		PCRSelect:           tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: []byte{0, 0, 0}}}},
		PCRDigest:           tpm2.TPM2BDigest{Buffer: bytes.Repeat([]byte{1}, 32)},
		Locality:            tpm2.TPMALocality{TPMLocZero: true},
		ParentNameAlg:       tpm2.TPMAlgSHA256,
		ParentName:          tpm2.TPM2BName{Buffer: bytes.Repeat([]byte{2}, 34)},
		ParentQualifiedName: tpm2.TPM2BName{Buffer: bytes.Repeat([]byte{3}, 34)},
		OutsideInfo:         tpm2.TPM2BData{Buffer: []byte("outside")},
	}))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeCreationData(b)
		if err != nil {
			return
		}
		want, err := tpm2.Unmarshal[tpm2.TPMSCreationData](b)
		if err != nil {
			t.Fatalf("decodeCreationData accepted what go-tpm refuses: %v", err)
		}
		if !bytes.Equal(want.ParentName.Buffer, got) {
			t.Fatalf("parent name: go-tpm %x, decodeCreationData %x", want.ParentName.Buffer, got)
		}
	})
}

// TestDecodePublicTakesTPMForms: the EK and AK public areas TPMs make (the TCG RSA and ECC EK
// templates, an ECDSA AK) and their creation data take the hand decoders, not go-tpm's.
func TestDecodePublicTakesTPMForms(t *testing.T) {
	for i, raw := range seedPublics() {
		if _, ok := decodePublic(raw); !ok {
			t.Errorf("public area %d: not decoded by hand", i)
		}
	}
	cd := tpm2.Marshal(tpm2.TPMSCreationData{
		PCRSelect:     tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: []byte{0, 0, 0}}}},
		ParentNameAlg: tpm2.TPMAlgSHA256, ParentName: tpm2.TPM2BName{Buffer: []byte{0, 0xb, 1}},
	})
	if name, err := decodeCreationData(cd); err != nil || !bytes.Equal(name, []byte{0, 0xb, 1}) {
		t.Errorf("creation data: %x, %v", name, err)
	}
}
