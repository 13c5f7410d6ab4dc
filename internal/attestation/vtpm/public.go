package vtpm

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"encoding/binary"
	"errors"
	"fmt"
	"math/big"

	"github.com/google/go-tpm/tpm2"

	"github.com/berth-k8s/berth/internal/attestation"
)

// The public areas (TPMT_PUBLIC) and the creation data (TPMS_CREATION_DATA) of a TPM identity are
// read when a validator meets the identity for the first time (the node validating the joinservice on
// every join does). go-tpm decodes them by reflection and computes an object's name by encoding it
// again, which was 40 % of such a validation; decodePublic and decodeCreationData read the forms
// TPMs make (RSA and ECC keys with the usual schemes, SHA-1/256/384/512 names) in one pass and hash the
// bytes as they came. Anything else is decoded by go-tpm as before: the hand decoders only decide
// faster, never differently (FuzzDecodePublic, FuzzDecodeCreationData compare them with go-tpm).

// Object attributes (TPMA_OBJECT) the validator checks.
const (
	attrFixedTPM            = 1 << 1
	attrFixedParent         = 1 << 4
	attrSensitiveDataOrigin = 1 << 5
	attrRestricted          = 1 << 16
	attrDecrypt             = 1 << 17
	attrSignEncrypt         = 1 << 18
)

// publicArea is what the validator reads of a TPMT_PUBLIC: its attributes, its key and its name.
// The key and the name can fail apart from the decoding (an unknown curve, an unknown name
// algorithm), as go-tpm's tpm2.Pub and tpm2.ObjectName do.
type publicArea struct {
	attrs   uint32
	key     crypto.PublicKey
	keyErr  error
	name    []byte // nameAlg || H_nameAlg(TPMT_PUBLIC)
	nameErr error
}

func (p publicArea) has(attrs uint32) bool { return p.attrs&attrs == attrs }

// parsePublic decodes a TPMT_PUBLIC: by hand in the usual forms, else with go-tpm. Its error is the
// decoding's (wrap it in attestation.ErrMalformed); the key's and the name's are in the result.
func parsePublic(raw []byte) (publicArea, error) {
	if p, ok := decodePublic(raw); ok {
		return p, nil
	}
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](raw)
	if err != nil {
		return publicArea{}, err
	}
	p := publicArea{attrs: binary.BigEndian.Uint32(tpm2.Marshal(pub.ObjectAttributes))}
	p.key, p.keyErr = tpm2.Pub(*pub)
	if name, err := tpm2.ObjectName(pub); err != nil {
		p.nameErr = err
	} else {
		p.name = name.Buffer
	}
	return p, nil
}

// nameHash is the hash of a name algorithm the hand decoder knows.
func nameHash(alg tpm2.TPMIAlgHash) (crypto.Hash, bool) {
	switch alg {
	case tpm2.TPMAlgSHA1:
		return crypto.SHA1, true
	case tpm2.TPMAlgSHA256:
		return crypto.SHA256, true
	case tpm2.TPMAlgSHA384:
		return crypto.SHA384, true
	case tpm2.TPMAlgSHA512:
		return crypto.SHA512, true
	}
	return 0, false
}

// decodePublic reads a TPMT_PUBLIC of an RSA or ECC key in one pass; ok is false for anything it
// does not know (go-tpm decides then).
func decodePublic(raw []byte) (p publicArea, ok bool) {
	r := tpmReader{b: raw}
	typ := tpm2.TPMIAlgPublic(r.u16())
	nameAlg := tpm2.TPMIAlgHash(r.u16())
	p.attrs = r.u32()
	r.sized() // authPolicy
	if !symmetricDef(&r) {
		return p, false
	}
	switch typ {
	case tpm2.TPMAlgRSA:
		switch scheme := tpm2.TPMIAlgRSAScheme(r.u16()); scheme {
		case tpm2.TPMAlgNull, tpm2.TPMAlgRSAES:
		case tpm2.TPMAlgRSASSA, tpm2.TPMAlgRSAPSS, tpm2.TPMAlgOAEP:
			r.u16() // hashAlg
		default:
			return p, false
		}
		r.u16() // keyBits
		e := r.u32()
		n := r.sized()
		if e == 0 {
			e = 65537 // the TPM's default exponent
		}
		p.key = &rsa.PublicKey{N: new(big.Int).SetBytes(n), E: int(e)}
	case tpm2.TPMAlgECC:
		switch scheme := tpm2.TPMIAlgECCScheme(r.u16()); scheme {
		case tpm2.TPMAlgNull:
		case tpm2.TPMAlgECDSA, tpm2.TPMAlgECDH, tpm2.TPMAlgECMQV:
			r.u16() // hashAlg
		case tpm2.TPMAlgECDAA:
			r.u16() // hashAlg
			r.u16() // count
		default:
			return p, false
		}
		curveID := tpm2.TPMECCCurve(r.u16())
		switch kdf := tpm2.TPMIAlgKDF(r.u16()); kdf {
		case tpm2.TPMAlgNull:
		case tpm2.TPMAlgMGF1, tpm2.TPMAlgKDF1SP80056A, tpm2.TPMAlgKDF2, tpm2.TPMAlgKDF1SP800108:
			r.u16() // hashAlg
		default:
			return p, false
		}
		x, y := r.sized(), r.sized()
		var curve elliptic.Curve
		switch curveID {
		case tpm2.TPMECCNistP256:
			curve = elliptic.P256()
		case tpm2.TPMECCNistP384:
			curve = elliptic.P384()
		case tpm2.TPMECCNistP521:
			curve = elliptic.P521()
		default:
			p.keyErr = fmt.Errorf("unknown curve: %v", curveID)
		}
		if curve != nil {
			// The key go-tpm's tpm2.Pub makes, the point unchecked: ecdsa.Verify refuses one off the curve.
			// ecdsa.ParseUncompressedPublicKey would refuse it here instead and no longer decode as go-tpm
			// does (FuzzDecodePublic compares the two), hence the deprecated fields.
			p.key = &ecdsa.PublicKey{Curve: curve, X: new(big.Int).SetBytes(x), Y: new(big.Int).SetBytes(y)} //nolint:staticcheck // SA1019, see above
		}
	default:
		return p, false
	}
	if r.done() != nil {
		return p, false
	}
	h, known := nameHash(nameAlg)
	if !known {
		return p, false
	}
	d := h.New()
	d.Write(raw)
	p.name = d.Sum(binary.BigEndian.AppendUint16(make([]byte, 0, 2+h.Size()), uint16(nameAlg)))
	return p, true
}

// symmetricDef reads a TPMT_SYM_DEF_OBJECT: NULL, or AES with its key size and mode; false
// for anything else.
func symmetricDef(r *tpmReader) bool {
	switch tpm2.TPMIAlgSymObject(r.u16()) {
	case tpm2.TPMAlgNull:
		return true
	case tpm2.TPMAlgAES:
		r.u16() // keyBits
		r.u16() // mode
		return true
	}
	return false
}

// errCreationData is the decoding error of creation data go-tpm would have to decode.
var errCreationData = errors.New("creation data in an unusual form")

// parentName returns the parent's name a TPMS_CREATION_DATA records: by hand in the usual form, else
// with go-tpm.
func parentName(raw []byte) ([]byte, error) {
	if name, err := decodeCreationData(raw); err == nil {
		return name, nil
	}
	cd, err := tpm2.Unmarshal[tpm2.TPMSCreationData](raw)
	if err != nil {
		return nil, fmt.Errorf("%w: decoding AK creation data: %w", attestation.ErrMalformed, err)
	}
	return cd.ParentName.Buffer, nil
}

// decodeCreationData reads a TPMS_CREATION_DATA in one pass and returns the parent's name.
func decodeCreationData(raw []byte) ([]byte, error) {
	r := tpmReader{b: raw}
	n := r.u32() // pcrSelect: count, then the selections
	if n > maxPCRBanks {
		return nil, errCreationData
	}
	for range n {
		r.u16()             // hash
		r.take(int(r.u8())) // bitmap
	}
	r.sized() // pcrDigest
	r.u8()    // locality
	r.u16()   // parentNameAlg
	name := r.sized()
	r.sized() // parentQualifiedName
	r.sized() // outsideInfo
	if err := r.done(); err != nil {
		return nil, err
	}
	return name, nil
}
