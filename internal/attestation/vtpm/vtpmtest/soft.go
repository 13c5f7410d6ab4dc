package vtpmtest

import (
	"bytes"
	"context"
	"crypto"
	"crypto/aes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/asn1"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"sort"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

// ErrBadCredential means an activation challenge was not made for this SoftTPM's EK and AK, or was
// altered: the integrity check a TPM runs in TPM2_ActivateCredential failed.
var ErrBadCredential = errors.New("credential integrity check failed")

// Labels of the TPM 2.0 key derivations used by credential protection (Part 1, "Credential
// Protection" and "Protected Storage").
const (
	labelIdentity  = "IDENTITY"
	labelIntegrity = "INTEGRITY"
	labelStorage   = "STORAGE"
)

// softFirmwareVersion is what SoftTPM reports as TPMS_ATTEST.firmwareVersion; only plausibility matters.
const softFirmwareVersion = 0x2000_0001_0000_0000

// SoftTPM is a software stand-in for a TPM that produces TPM-format attestation documents, identities
// and credential activations that vtpm.Validator accepts like those of a real TPM whose EK certificate
// comes from the CA it was created with. It is meant for tests and load harnesses only: its EK and AK
// are ordinary software keys held in process memory, so its evidence proves nothing about a machine.
// It is safe for concurrent use.
type SoftTPM struct {
	ek       *rsa.PrivateKey
	ak       *ecdsa.PrivateKey
	akName   []byte // TPM2B_NAME contents of the AK (hash algorithm and digest)
	akQName  []byte // the AK's qualified name, the signer named in its attestations
	identity []byte // vtpm.MarshalIdentity of the EK public area and the AK name
	started  time.Time

	// doc holds the document fields that stay the same for every quote.
	doc vtpm.Document

	mu   sync.RWMutex
	pcrs map[uint32][]byte
}

// NewSoftTPM creates a SoftTPM with a fresh RSA-2048 EK, certified by ca like ProvisionEKCert
// certifies a TPM's EK, and a fresh ECDSA P-256 AK recorded as created under that EK. pcrs are the
// SHA-256 PCR values it quotes (indices 0..23, 32 bytes each); it keeps a copy.
func NewSoftTPM(ca *CA, pcrs map[uint32][]byte) (*SoftTPM, error) {
	if err := checkPCRs(pcrs); err != nil {
		return nil, err
	}
	ek, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, fmt.Errorf("generating EK: %w", err)
	}
	ekPub := tpm2.RSAEKTemplate
	ekPub.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgRSA, &tpm2.TPM2BPublicKeyRSA{Buffer: ek.N.FillBytes(make([]byte, 2048/8))})
	ekName, err := tpm2.ObjectName(&ekPub)
	if err != nil {
		return nil, fmt.Errorf("computing EK name: %w", err)
	}
	ekCert, err := issueEKCert(ca, &ek.PublicKey)
	if err != nil {
		return nil, err
	}
	return newSoftTPM(ek, ekPub, ekName, ekCert, pcrs)
}

// NewImpostor returns a SoftTPM that claims the EK whose public area (TPMT_PUBLIC) is ekPublic,
// another TPM's, without holding it: its documents name that EK, carry no EK certificate, and record
// a software AK as created under that EK (a record the AK signs itself, so anyone can write it). It
// cannot activate a credential made for that EK. Tests use it to show that trusting an EK, for
// example by a pin, does not extend to an AK until the AK proves it lives with the EK.
func NewImpostor(ekPublic []byte, pcrs map[uint32][]byte) (*SoftTPM, error) {
	if err := checkPCRs(pcrs); err != nil {
		return nil, err
	}
	ekPub, err := tpm2.Unmarshal[tpm2.TPMTPublic](ekPublic)
	if err != nil {
		return nil, fmt.Errorf("decoding EK public area: %w", err)
	}
	ekName, err := tpm2.ObjectName(ekPub)
	if err != nil {
		return nil, fmt.Errorf("computing EK name: %w", err)
	}
	return newSoftTPM(nil, *ekPub, ekName, nil, pcrs)
}

// newSoftTPM makes the AK of a SoftTPM whose EK has the public area ekPub (and the private key ek,
// nil for an impostor) and certificate ekCert.
func newSoftTPM(ek *rsa.PrivateKey, ekPub tpm2.TPMTPublic, ekName *tpm2.TPM2BName, ekCert []byte, pcrs map[uint32][]byte) (*SoftTPM, error) {
	ak, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating AK: %w", err)
	}
	akPub, err := akPublicArea(ak)
	if err != nil {
		return nil, err
	}
	akName, err := tpm2.ObjectName(&akPub)
	if err != nil {
		return nil, fmt.Errorf("computing AK name: %w", err)
	}
	// Qualified names (Part 1, "Names"): a primary object's parent is its hierarchy, whose qualified
	// name is its handle.
	ekQName := qualifiedName(binary.BigEndian.AppendUint32(nil, uint32(tpm2.TPMRHEndorsement)), ekName.Buffer)
	akQName := qualifiedName(ekQName, akName.Buffer)

	s := &SoftTPM{
		ek:      ek,
		ak:      ak,
		akName:  akName.Buffer,
		akQName: akQName,
		started: time.Now(),
		pcrs:    copyPCRs(pcrs),
	}
	ekPublic := tpm2.Marshal(ekPub)
	s.identity = vtpm.MarshalIdentity(ekPublic, akName.Buffer)

	// The AK's creation record as TPM2_Create returns it for an AK under the EK without creation
	// PCRs, and TPM2_CertifyCreation's attestation of it, signed by the AK.
	creationData := tpm2.Marshal(tpm2.TPMSCreationData{
		PCRSelect:           tpm2.TPMLPCRSelection{},
		PCRDigest:           tpm2.TPM2BDigest{},
		Locality:            tpm2.TPMALocality{TPMLocZero: true},
		ParentNameAlg:       tpm2.TPMAlgSHA256,
		ParentName:          *ekName,
		ParentQualifiedName: tpm2.TPM2BName{Buffer: ekQName},
	})
	creationHash := sha256.Sum256(creationData)
	certifyInfo := s.attest(tpm2.TPMSTAttestCreation, nil, tpm2.NewTPMUAttest(tpm2.TPMSTAttestCreation, &tpm2.TPMSCreationInfo{
		ObjectName:   *akName,
		CreationHash: tpm2.TPM2BDigest{Buffer: creationHash[:]},
	}))
	certifySig, err := s.sign(certifyInfo)
	if err != nil {
		return nil, fmt.Errorf("certifying AK creation: %w", err)
	}
	s.doc = vtpm.Document{
		Variant:            vtpm.Variant,
		EKCert:             ekCert,
		EKPublic:           ekPublic,
		AKPublic:           tpm2.Marshal(akPub),
		AKCreationData:     creationData,
		AKCertifyInfo:      certifyInfo,
		AKCertifySignature: certifySig,
	}
	return s, nil
}

// issueEKCert certifies ek from ca with the key usage and extended key usage of an EK certificate.
func issueEKCert(ca *CA, ek *rsa.PublicKey) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generating EK certificate serial: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageKeyEncipherment,
		UnknownExtKeyUsage:    []asn1.ObjectIdentifier{oidTCGKpEKCertificate},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, ek, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("issuing EK certificate: %w", err)
	}
	return der, nil
}

// akPublicArea is the public area a TPM gives an AK created from the Issuer's template: a restricted
// ECDSA-SHA256 P-256 signing key bound to the TPM.
func akPublicArea(ak *ecdsa.PrivateKey) (tpm2.TPMTPublic, error) {
	point, err := ak.PublicKey.Bytes() // uncompressed: 0x04 || X || Y
	if err != nil {
		return tpm2.TPMTPublic{}, fmt.Errorf("encoding AK point: %w", err)
	}
	const coord = 32
	pub := vtpm.AKTemplate()
	pub.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
		X: tpm2.TPM2BECCParameter{Buffer: point[1 : 1+coord]},
		Y: tpm2.TPM2BECCParameter{Buffer: point[1+coord:]},
	})
	return pub, nil
}

// qualifiedName is the SHA-256 qualified name of an object with name under a parent with parentQName.
func qualifiedName(parentQName, name []byte) []byte {
	h := sha256.New()
	h.Write(parentQName)
	h.Write(name)
	return h.Sum(binary.BigEndian.AppendUint16(nil, uint16(tpm2.TPMAlgSHA256)))
}

// attest marshals a TPMS_ATTEST of type typ signed (later) by the AK.
func (s *SoftTPM) attest(typ tpm2.TPMST, extraData []byte, attested tpm2.TPMUAttest) []byte {
	return tpm2.Marshal(tpm2.TPMSAttest{
		Magic:           tpm2.TPMGeneratedValue,
		Type:            typ,
		QualifiedSigner: tpm2.TPM2BName{Buffer: s.akQName},
		ExtraData:       tpm2.TPM2BData{Buffer: extraData},
		ClockInfo: tpm2.TPMSClockInfo{
			Clock:      uint64(time.Since(s.started).Milliseconds()),
			ResetCount: 1,
			Safe:       true,
		},
		FirmwareVersion: softFirmwareVersion,
		Attested:        attested,
	})
}

// sign returns the AK's TPMT_SIGNATURE (ECDSA, SHA-256) over SHA-256(msg), as TPM2_Quote and
// TPM2_CertifyCreation sign their attestations.
func (s *SoftTPM) sign(msg []byte) ([]byte, error) {
	digest := sha256.Sum256(msg)
	r, ss, err := ecdsa.Sign(rand.Reader, s.ak, digest[:])
	if err != nil {
		return nil, fmt.Errorf("signing with AK: %w", err)
	}
	const coord = 32
	return tpm2.Marshal(tpm2.TPMTSignature{
		SigAlg: tpm2.TPMAlgECDSA,
		Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgECDSA, &tpm2.TPMSSignatureECC{
			Hash:       tpm2.TPMAlgSHA256,
			SignatureR: tpm2.TPM2BECCParameter{Buffer: r.FillBytes(make([]byte, coord))},
			SignatureS: tpm2.TPM2BECCParameter{Buffer: ss.FillBytes(make([]byte, coord))},
		}),
	}), nil
}

// Variant returns vtpm.Variant.
func (s *SoftTPM) Variant() string { return vtpm.Variant }

// Issue returns a JSON vtpm.Document with a freshly signed quote of the current PCR values whose
// qualifying data binds userData and nonce. It carries no event log.
func (s *SoftTPM) Issue(_ context.Context, userData, nonce []byte) ([]byte, error) {
	pcrs := s.snapshot()
	idx := make([]uint, 0, len(pcrs))
	for i := range pcrs {
		idx = append(idx, uint(i))
	}
	sort.Slice(idx, func(a, b int) bool { return idx[a] < idx[b] })
	h := sha256.New()
	for _, i := range idx {
		h.Write(pcrs[uint32(i)])
	}
	quote := s.attest(tpm2.TPMSTAttestQuote, vtpm.QualifyingData(userData, nonce), tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, &tpm2.TPMSQuoteInfo{
		PCRSelect: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
			Hash:      tpm2.TPMAlgSHA256,
			PCRSelect: tpm2.PCClientCompatible.PCRs(idx...),
		}}},
		PCRDigest: tpm2.TPM2BDigest{Buffer: h.Sum(nil)},
	}))
	sig, err := s.sign(quote)
	if err != nil {
		return nil, fmt.Errorf("quoting PCRs: %w", err)
	}
	doc := s.doc
	doc.UserData = userData
	doc.Quote = quote
	doc.QuoteSignature = sig
	doc.PCRs = pcrs
	out, err := json.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("encoding attestation document: %w", err)
	}
	return out, nil
}

// Identity returns the activation identity, encoded as vtpm.Issuer.Identity encodes it.
func (s *SoftTPM) Identity(context.Context) ([]byte, error) {
	return bytes.Clone(s.identity), nil
}

// Activate answers an activation challenge from vtpm.Validator.Challenge like TPM2_ActivateCredential
// with the AK as the activated object and the EK as the decryption key: it recovers the seed with
// RSA-OAEP, checks the credential's integrity HMAC over the encrypted credential and the AK's name,
// and decrypts the credential. A challenge for another EK or AK, or an altered one, fails with an
// error wrapping ErrBadCredential or attestation.ErrMalformed.
func (s *SoftTPM) Activate(_ context.Context, challenge []byte) ([]byte, error) {
	blob, encSeed, err := vtpm.ParseChallenge(challenge)
	if err != nil {
		return nil, err
	}
	if s.ek == nil {
		return nil, fmt.Errorf("decrypting credential seed: %w: this impostor does not hold the EK", ErrBadCredential)
	}
	// The seed is encrypted to the EK with OAEP over its name algorithm and the label "IDENTITY".
	seed, err := rsa.DecryptOAEP(sha256.New(), nil, s.ek, encSeed, []byte(labelIdentity+"\x00"))
	if err != nil {
		return nil, fmt.Errorf("decrypting credential seed: %w: %w", ErrBadCredential, err)
	}
	// TPMS_ID_OBJECT: a TPM2B integrity HMAC followed by the encrypted credential.
	if len(blob) < 2 {
		return nil, fmt.Errorf("%w: credential blob of %d bytes", attestation.ErrMalformed, len(blob))
	}
	macLen := int(binary.BigEndian.Uint16(blob))
	if macLen != sha256.Size || len(blob) < 2+macLen {
		return nil, fmt.Errorf("%w: credential integrity of %d bytes", attestation.ErrMalformed, macLen)
	}
	outerMAC, encIdentity := blob[2:2+macLen], blob[2+macLen:]
	mac := hmac.New(sha256.New, tpm2.KDFa(crypto.SHA256, seed, labelIntegrity, nil, nil, sha256.Size*8))
	mac.Write(encIdentity)
	mac.Write(s.akName)
	if !hmac.Equal(mac.Sum(nil), outerMAC) {
		return nil, fmt.Errorf("checking credential: %w", ErrBadCredential)
	}
	// The EK's symmetric parameters: AES-128 in CFB mode, zero IV, key bound to the AK's name.
	plain, err := cfbDecrypt(tpm2.KDFa(crypto.SHA256, seed, labelStorage, s.akName, nil, 128), encIdentity)
	if err != nil {
		return nil, err
	}
	// The plaintext is the credential as a TPM2B_DIGEST.
	if len(plain) < 2 || int(binary.BigEndian.Uint16(plain)) != len(plain)-2 || len(plain)-2 > sha256.Size {
		return nil, fmt.Errorf("%w: decrypted credential", attestation.ErrMalformed)
	}
	return plain[2:], nil
}

// cfbDecrypt decrypts ciphertext with AES in full-block CFB mode and a zero IV, the TPM's parameter
// encryption for credentials: each keystream block is the encryption of the previous ciphertext
// block.
func cfbDecrypt(key, ciphertext []byte) ([]byte, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("creating credential cipher: %w", err)
	}
	out := make([]byte, len(ciphertext))
	feedback := make([]byte, aes.BlockSize)
	stream := make([]byte, aes.BlockSize)
	for off := 0; off < len(ciphertext); off += aes.BlockSize {
		block.Encrypt(stream, feedback)
		end := min(off+aes.BlockSize, len(ciphertext))
		for i := off; i < end; i++ {
			out[i] = ciphertext[i] ^ stream[i-off]
		}
		copy(feedback, ciphertext[off:end])
	}
	return out, nil
}

// Claims returns a copy of the PCR values it quotes.
func (s *SoftTPM) Claims(context.Context) (attestation.Measurements, error) {
	return attestation.Measurements(s.snapshot()), nil
}

// SetPCRs replaces the PCR values it quotes from now on with a copy of pcrs. Like a test helper it
// panics on values a TPM cannot hold (an index above 23 or a value that is not 32 bytes).
func (s *SoftTPM) SetPCRs(pcrs map[uint32][]byte) {
	if err := checkPCRs(pcrs); err != nil {
		panic(err)
	}
	c := copyPCRs(pcrs)
	s.mu.Lock()
	s.pcrs = c
	s.mu.Unlock()
}

// snapshot returns a copy of the current PCR values.
func (s *SoftTPM) snapshot() map[uint32][]byte {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return copyPCRs(s.pcrs)
}

// checkPCRs rejects values a TPM's SHA-256 bank of 24 PCRs cannot hold.
func checkPCRs(pcrs map[uint32][]byte) error {
	for idx, v := range pcrs {
		if idx > 23 || len(v) != sha256.Size {
			return fmt.Errorf("invalid PCR value: PCR %d with %d bytes is not a SHA-256 PCR 0..23", idx, len(v))
		}
	}
	return nil
}

func copyPCRs(pcrs map[uint32][]byte) map[uint32][]byte {
	out := make(map[uint32][]byte, len(pcrs))
	for idx, v := range pcrs {
		out[idx] = bytes.Clone(v)
	}
	return out
}
