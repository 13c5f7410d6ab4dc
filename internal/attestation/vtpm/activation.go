package vtpm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Credential activation proves that the AK lives in the same TPM as the certified EK: the validator
// encrypts a fresh secret to the EK, bound to the AK's name (TPM2_MakeCredential in software); only a
// TPM holding both keys recovers it (TPM2_ActivateCredential). Attested TLS carries the attester's
// identity and the challenge in the handshake and mixes the secret into the nonce of the quote, so a
// document from an attester that could not recover the secret fails the nonce check.

// DefaultEKHandle is where the Issuer keeps the EK persistent for activations (the TCG-recommended
// EK handle); the RSA EK from the default template is the same key whenever it is created.
const DefaultEKHandle = 0x81010001

// maxIdentity bounds identities and challenges.
const maxIdentity = 4096

// maxActivated bounds the validator's memory of activated keys; when full, new keys are still
// activated, just not remembered.
const maxActivated = 8192

// identity is what a validator needs to build a challenge: the EK's public area and the AK's name.
type identity struct {
	ekPublic []byte
	akName   []byte
}

func (id identity) marshal() []byte {
	return appendSized(appendSized(nil, id.ekPublic), id.akName)
}

// MarshalIdentity encodes an attester identity as Issuer.Identity returns it and Validator.Challenge
// takes it: the EK's public area (TPMT_PUBLIC) and the AK's name.
func MarshalIdentity(ekPublic, akName []byte) []byte {
	return identity{ekPublic: ekPublic, akName: akName}.marshal()
}

// ParseChallenge splits an activation challenge from Validator.Challenge into the credential blob
// (TPM2B_ID_OBJECT contents) and the encrypted seed (TPM2B_ENCRYPTED_SECRET contents), the inputs of
// TPM2_ActivateCredential.
func ParseChallenge(challenge []byte) (credentialBlob, encryptedSecret []byte, err error) {
	if len(challenge) > maxIdentity {
		return nil, nil, fmt.Errorf("%w: challenge of %d bytes", attestation.ErrMalformed, len(challenge))
	}
	idObject, rest, ok := cutSized(challenge)
	encSecret, rest2, ok2 := cutSized(rest)
	if !ok || !ok2 || len(rest2) != 0 {
		return nil, nil, fmt.Errorf("%w: activation challenge", attestation.ErrMalformed)
	}
	return idObject, encSecret, nil
}

func parseIdentity(b []byte) (identity, error) {
	if len(b) > maxIdentity {
		return identity{}, fmt.Errorf("%w: identity of %d bytes", attestation.ErrMalformed, len(b))
	}
	ek, rest, ok := cutSized(b)
	ak, rest2, ok2 := cutSized(rest)
	if !ok || !ok2 || len(rest2) != 0 || len(ek) == 0 || len(ak) == 0 {
		return identity{}, fmt.Errorf("%w: identity", attestation.ErrMalformed)
	}
	return identity{ekPublic: ek, akName: ak}, nil
}

func appendSized(b, v []byte) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(v)))
	return append(b, v...)
}

func cutSized(b []byte) (v, rest []byte, ok bool) {
	if len(b) < 2 {
		return nil, nil, false
	}
	n := int(binary.BigEndian.Uint16(b))
	if len(b) < 2+n {
		return nil, nil, false
	}
	return b[2 : 2+n], b[2+n:], true
}

// Identity returns the attester's identity for activation challenges, creating the AK if needed.
func (i *Issuer) Identity(ctx context.Context) ([]byte, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.ak == nil {
		c, err := openTPM(ctx, i.open)
		if err != nil {
			return nil, err
		}
		defer func() { _ = c.Close() }() // best effort: the commands already answered
		if err := i.ensureAK(c); err != nil {
			return nil, err
		}
	}
	return identity{ekPublic: i.ak.ekPublic, akName: i.ak.name.Buffer}.marshal(), nil
}

// Activate answers an activation challenge with TPM2_ActivateCredential and returns the secret.
func (i *Issuer) Activate(ctx context.Context, challenge []byte) ([]byte, error) {
	idObject, encSecret, err := ParseChallenge(challenge)
	if err != nil {
		return nil, err
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	c, err := openTPM(ctx, i.open)
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	if err := i.ensureAK(c); err != nil {
		return nil, err
	}
	return i.activate(c, idObject, encSecret)
}

// activate runs TPM2_ActivateCredential for the AK with the EK. Callers hold i.mu and ensured the AK.
func (i *Issuer) activate(c *conn, idObject, encSecret []byte) ([]byte, error) {
	rsp, err := tpm2.ActivateCredential{
		ActivateHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(i.akHandle), Name: i.ak.name, Auth: tpm2.PasswordAuth(nil)},
		KeyHandle:      tpm2.AuthHandle{Handle: tpm2.TPMHandle(DefaultEKHandle), Name: i.ak.ekName, Auth: endorsementPolicy()},
		CredentialBlob: tpm2.TPM2BIDObject{Buffer: idObject},
		Secret:         tpm2.TPM2BEncryptedSecret{Buffer: encSecret},
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("activating credential: %w", err)
	}
	return rsp.CertInfo.Buffer, nil
}

// Challenge builds an activation challenge for an attester identity. The attester must quote over a
// nonce that mixes in secret; validate checks such a document and that it comes from the challenged
// EK and AK. For a key pair this validator saw activated before (the AK is fixedTPM, so it stays
// with that EK), challenge and secret are nil: no activation, the plain nonce, the same identity check.
func (v *Validator) Challenge(rawIdentity []byte) (challenge, secret []byte, validate func(ctx context.Context, doc, nonce []byte) (attestation.Result, error), err error) {
	id, err := parseIdentity(rawIdentity)
	if err != nil {
		return nil, nil, nil, err
	}
	key := string(id.marshal())
	if v.isActivated(key) {
		return nil, nil, v.identityBound(id, key, false), nil
	}
	ekPub, err := tpm2.Unmarshal[tpm2.TPMTPublic](id.ekPublic)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: identity EK: %w", attestation.ErrMalformed, err)
	}
	ekKey, err := tpm2.ImportEncapsulationKey(ekPub)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: identity EK: %w", attestation.ErrMalformed, err)
	}
	secret = make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return nil, nil, nil, fmt.Errorf("generating activation secret: %w", err)
	}
	idObject, encSecret, err := tpm2.CreateCredential(rand.Reader, ekKey, id.akName, secret)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: making credential: %w", attestation.ErrMalformed, err)
	}
	challenge = appendSized(appendSized(nil, idObject), encSecret)
	return challenge, secret, v.identityBound(id, key, true), nil
}

// identityBound validates a document that must come from id's EK and AK, and remembers the pair as
// activated when it passes. challenged says whether this handshake carried a challenge: only then can
// a nonce mismatch mean a failed activation; for a remembered pair it is a replay.
func (v *Validator) identityBound(id identity, key string, challenged bool) func(ctx context.Context, doc, nonce []byte) (attestation.Result, error) {
	return func(ctx context.Context, raw, nonce []byte) (attestation.Result, error) {
		doc, err := ParseDocument(raw)
		if err != nil {
			return attestation.Result{}, err
		}
		akName, err := v.akName(doc)
		if err != nil {
			return attestation.Result{}, err
		}
		if !bytes.Equal(akName, id.akName) || !bytes.Equal(doc.EKPublic, id.ekPublic) {
			return attestation.Result{}, fmt.Errorf("%w: document is not from the challenged EK and AK", attestation.ErrUntrustedRoot)
		}
		res, _, err := v.validate(doc, nonce, false)
		if challenged && errors.Is(err, attestation.ErrNonceMismatch) {
			// Either a replay, or the attester could not recover the secret: its AK does not live with the EK.
			return res, fmt.Errorf("%w: AK activation not proven: %w", attestation.ErrUntrustedRoot, err)
		}
		if err == nil || errors.Is(err, attestation.ErrMeasurementMismatch) {
			// The quote verified under the mixed nonce: the key pair is activated, whatever the PCRs say.
			v.remember(key)
		}
		return res, err
	}
}

// akName is the name of the document's AK: remembered for an identity that verified before, else
// computed from its public area.
func (v *Validator) akName(doc *Document) ([]byte, error) {
	if known := v.knownIdentity(identityKey(doc)); known != nil {
		return known.akName, nil
	}
	akPub, err := parsePublic(doc.AKPublic)
	if err != nil {
		return nil, fmt.Errorf("%w: decoding AK public area: %w", attestation.ErrMalformed, err)
	}
	if akPub.nameErr != nil {
		return nil, fmt.Errorf("%w: AK name: %w", attestation.ErrMalformed, akPub.nameErr)
	}
	return akPub.name, nil
}

func (v *Validator) isActivated(key string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	_, ok := v.activated[key]
	return ok
}

func (v *Validator) remember(key string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.activated) < maxActivated {
		v.activated[key] = struct{}{}
	}
}

// ensureAK makes sure the AK (and the EK for activations) are persistent in the TPM, recreating
// them when they were replaced. Callers hold i.mu.
func (i *Issuer) ensureAK(c *conn) error {
	if i.ak != nil {
		cur, err := (tpm2.ReadPublic{ObjectHandle: tpm2.TPMHandle(i.akHandle)}).Execute(c)
		if err == nil && bytes.Equal(cur.Name.Buffer, i.ak.name.Buffer) {
			return nil
		}
		i.log.Warn("attestation key missing or replaced, creating a new one", zap.Uint32("handle", i.akHandle))
		i.ak = nil
	}
	rec, err := i.createAK(c)
	if err != nil {
		return err
	}
	i.ak = rec
	i.log.Info("attestation key created under the endorsement key", zap.Uint32("handle", i.akHandle))
	return nil
}
