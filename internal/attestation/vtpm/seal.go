package vtpm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Sealing. A Sealer keeps a small secret (a disk key) in a TPM sealed data object whose only
// authorization is a PolicyPCR over the boot PCRs and the lock register: the boot PCRs must hold the
// values they held when the secret was sealed, and the lock PCR must be all zeros. The node seals
// after it took the lock, so the policy is computed in software from the boot PCRs it reads and zeros
// for the lock PCR; only the next boot, before it extends the lock register again, can unseal.
//
// The object is created under the owner hierarchy's storage root key (SRK), which TPM2_CreatePrimary
// re-derives from the owner seed and the TCG ECC P-256 SRK template on every call (no persistent
// handle to manage; BenchmarkSRK: 0.5-0.6 ms on swtpm and the simulator, against 0.01-0.02 ms
// to check a persistent one, out of 1.2-1.8 ms per Seal or Unseal). TPM2_Clear replaces the owner seed, so
// a blob sealed before a clear no longer loads. The secret crosses the TPM interface only inside
// sessions salted to the SRK with AES-CFB parameter encryption, so it is not readable on the bus.

// sealVersion is the first byte of a sealed blob.
const sealVersion = 1

// maxSealedSecret is the TPM's limit on sealed data (MAX_SYM_DATA).
const maxSealedSecret = 128

// maxSealedBlob bounds a sealed blob; TPM2B_PUBLIC and TPM2B_PRIVATE of a sealed object take a few
// hundred bytes.
const maxSealedBlob = 4096

// sealAttempts bounds how often Seal and Unseal retry when a PCR changes while they run.
const sealAttempts = 3

// Named sealing failures; callers branch on them with errors.Is.
var (
	// ErrSealPolicy means the TPM refused to unseal: the boot was measured differently than when the
	// secret was sealed, or the lock register was already extended in this boot.
	ErrSealPolicy = errors.New("TPM refused to unseal: PCR values differ from the sealing policy")
	// ErrSealedKeyUnusable means the sealed blob cannot be loaded: the TPM was cleared, it is another
	// TPM, or the blob is malformed. Nothing in this TPM can unseal it any more.
	ErrSealedKeyUnusable = errors.New("sealed key unusable in this TPM")
)

// Sealer seals secrets to the TPM behind open under a policy on pcrs (SHA-256 bank) and zero lock
// and phase PCRs. It holds no TPM state between calls and is safe for concurrent use.
type Sealer struct {
	open OpenFunc
	pcrs []uint // the boot PCRs, sorted, without the zero PCRs
	zero []uint // the lock register and the boot phase registers, sorted: zero when unsealing
}

// NewSealer returns a Sealer for the boot PCRs pcrs, the lock register lockPCR (use
// DefaultLockPCR) and the boot phase registers phasePCRs (BootPhase). The lock and phase PCRs must
// be zero to unseal, whatever they hold when sealing: a secret sealed in one boot unseals in a
// later one only before the lock is taken and before the phase is marked. A PCR listed in pcrs and
// as lock or phase register counts as the latter only.
func NewSealer(open OpenFunc, pcrs []uint, lockPCR uint, phasePCRs ...uint) *Sealer {
	seen := map[uint]bool{lockPCR: true}
	zero := []uint{lockPCR}
	for _, p := range phasePCRs {
		if !seen[p] {
			seen[p] = true
			zero = append(zero, p)
		}
	}
	var boot []uint
	for _, p := range pcrs {
		if !seen[p] {
			seen[p] = true
			boot = append(boot, p)
		}
	}
	sort.Slice(boot, func(a, b int) bool { return boot[a] < boot[b] })
	sort.Slice(zero, func(a, b int) bool { return zero[a] < zero[b] })
	return &Sealer{open: open, pcrs: boot, zero: zero}
}

// sealTemplate is a sealed data object that only a policy session can use: no auth value, no
// admin by password, bound to its TPM and parent.
func sealTemplate(policy []byte) tpm2.TPMTPublic {
	return tpm2.TPMTPublic{
		Type:    tpm2.TPMAlgKeyedHash,
		NameAlg: tpm2.TPMAlgSHA256,
		ObjectAttributes: tpm2.TPMAObject{
			FixedTPM:        true,
			FixedParent:     true,
			AdminWithPolicy: true,
			NoDA:            true,
		},
		AuthPolicy: tpm2.TPM2BDigest{Buffer: policy},
		Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgKeyedHash, &tpm2.TPMSKeyedHashParms{
			Scheme: tpm2.TPMTKeyedHashScheme{Scheme: tpm2.TPMAlgNull},
		}),
	}
}

// Seal seals secret (1 to 128 bytes) to the current values of the boot PCRs and zero lock and phase PCRs and
// returns the blob Unseal takes. The blob holds no secret in the clear; only this TPM, before its
// owner hierarchy is cleared, can load it.
func (s *Sealer) Seal(ctx context.Context, secret []byte) ([]byte, error) {
	if len(secret) == 0 || len(secret) > maxSealedSecret {
		return nil, fmt.Errorf("sealing: secret has %d bytes, want 1 to %d", len(secret), maxSealedSecret)
	}
	c, err := openTPM(ctx, s.open)
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	srk, err := createSRK(c)
	if err != nil {
		return nil, err
	}
	defer flush(c, srk.ObjectHandle)

	all := append(append([]uint(nil), s.pcrs...), s.zero...)
	sort.Slice(all, func(a, b int) bool { return all[a] < all[b] })
	sel := sha256Selection(all)
	for attempt := 0; ; attempt++ {
		values, err := readPCRs(c, s.pcrs)
		if err != nil {
			return nil, err
		}
		bootDigest := pcrDigest(values, s.pcrs)
		for _, z := range s.zero {
			values[uint32(z)] = make([]byte, 32)
		}
		policy, err := pcrPolicy(sel, pcrDigest(values, all))
		if err != nil {
			return nil, err
		}
		created, err := s.create(c, srk, secret, policy)
		if err != nil {
			return nil, err
		}
		// The creation data holds the boot PCRs as the TPM saw them at creation: if one changed since
		// we read it, the policy is stale.
		cd, err := created.CreationData.Contents()
		if err != nil {
			return nil, fmt.Errorf("sealing: decoding creation data: %w", err)
		}
		if len(s.pcrs) > 0 && !bytes.Equal(cd.PCRDigest.Buffer, bootDigest) {
			if attempt+1 < sealAttempts {
				continue
			}
			return nil, errors.New("sealing: PCR values kept changing while sealing")
		}
		return marshalSealed(sel, created.OutPublic, created.OutPrivate), nil
	}
}

// create runs TPM2_Create for the sealed object, with the secret encrypted on its way into the TPM.
func (s *Sealer) create(c transport.TPM, srk *tpm2.CreatePrimaryResponse, secret, policy []byte) (*tpm2.CreateResponse, error) {
	srkPub, err := srk.OutPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("sealing: decoding SRK: %w", err)
	}
	sess, closeSess, err := tpm2.HMACSession(c, tpm2.TPMAlgSHA256, 16,
		tpm2.Salted(srk.ObjectHandle, *srkPub), tpm2.AESEncryption(128, tpm2.EncryptIn))
	if err != nil {
		return nil, fmt.Errorf("sealing: starting session: %w", err)
	}
	defer func() { _ = closeSess() }()
	created, err := tpm2.Create{
		ParentHandle: tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: sess},
		InSensitive: tpm2.TPM2BSensitiveCreate{Sensitive: &tpm2.TPMSSensitiveCreate{
			Data: tpm2.NewTPMUSensitiveCreate(&tpm2.TPM2BSensitiveData{Buffer: secret}),
		}},
		InPublic:    tpm2.New2B(sealTemplate(policy)),
		CreationPCR: sha256Selection(s.pcrs),
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("sealing: creating sealed object: %w", err)
	}
	return created, nil
}

// Unseal loads blob under the SRK and unseals it in a policy session on the PCRs the blob names. It
// fails with ErrSealPolicy when the PCRs differ from the sealing policy (another boot, or the lock
// register already extended) and with ErrSealedKeyUnusable when the blob does not load in this TPM.
func (s *Sealer) Unseal(ctx context.Context, blob []byte) ([]byte, error) {
	sel, pub, priv, err := unmarshalSealed(blob)
	if err != nil {
		return nil, err
	}
	c, err := openTPM(ctx, s.open)
	if err != nil {
		return nil, err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	srk, err := createSRK(c)
	if err != nil {
		return nil, err
	}
	defer flush(c, srk.ObjectHandle)
	loaded, err := tpm2.Load{
		ParentHandle: tpm2.AuthHandle{Handle: srk.ObjectHandle, Name: srk.Name, Auth: tpm2.PasswordAuth(nil)},
		InPrivate:    priv,
		InPublic:     pub,
	}.Execute(c)
	if err != nil {
		if isTPMError(err) {
			return nil, fmt.Errorf("%w: loading sealed object: %w", ErrSealedKeyUnusable, err)
		}
		return nil, fmt.Errorf("loading sealed object: %w", err)
	}
	defer flush(c, loaded.ObjectHandle)
	srkPub, err := srk.OutPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("unsealing: decoding SRK: %w", err)
	}
	for attempt := 0; ; attempt++ {
		secret, err := unsealOnce(c, srk.ObjectHandle, srkPub, loaded, sel)
		switch {
		case err == nil:
			return secret, nil
		case errors.Is(err, tpm2.TPMRCPCRChanged) && attempt+1 < sealAttempts:
			continue
		case errors.Is(err, tpm2.TPMRCPolicyFail), errors.Is(err, tpm2.TPMRCPCRChanged):
			return nil, fmt.Errorf("%w: %w", ErrSealPolicy, err)
		case isTPMError(err) && !errors.Is(err, tpm2.TPMRCRetry):
			// A policy session on the blob's PCR selection that the TPM refuses to run, or an object
			// it cannot unseal: nothing in this TPM will change that.
			return nil, fmt.Errorf("%w: %w", ErrSealedKeyUnusable, err)
		default:
			return nil, err
		}
	}
}

// unsealOnce runs PolicyPCR on sel in a fresh policy session salted to the SRK, then TPM2_Unseal with
// the output encrypted, and flushes the session.
func unsealOnce(c transport.TPM, srk tpm2.TPMHandle, srkPub *tpm2.TPMTPublic, obj *tpm2.LoadResponse, sel tpm2.TPMLPCRSelection) ([]byte, error) {
	sess, closeSess, err := tpm2.PolicySession(c, tpm2.TPMAlgSHA256, 16,
		tpm2.Salted(srk, *srkPub), tpm2.AESEncryption(128, tpm2.EncryptOut))
	if err != nil {
		return nil, fmt.Errorf("unsealing: starting policy session: %w", err)
	}
	defer func() { _ = closeSess() }()
	if _, err := (tpm2.PolicyPCR{PolicySession: sess.Handle(), Pcrs: sel}).Execute(c); err != nil {
		return nil, fmt.Errorf("unsealing: PolicyPCR: %w", err)
	}
	rsp, err := tpm2.Unseal{
		ItemHandle: tpm2.AuthHandle{Handle: obj.ObjectHandle, Name: obj.Name, Auth: sess},
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("unsealing: %w", err)
	}
	return rsp.OutData.Buffer, nil
}

// createSRK creates the owner hierarchy's storage root key from the TCG ECC P-256 template; the same
// owner seed always yields the same key.
func createSRK(c transport.TPM) (*tpm2.CreatePrimaryResponse, error) {
	srk, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
		InPublic:      tpm2.New2B(tpm2.ECCSRKTemplate),
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("creating storage root key: %w", err)
	}
	return srk, nil
}

// pcrPolicy is the policy digest of a single TPM2_PolicyPCR over sel with the given PCR digest.
func pcrPolicy(sel tpm2.TPMLPCRSelection, digest []byte) ([]byte, error) {
	calc, err := tpm2.NewPolicyCalculator(tpm2.TPMAlgSHA256)
	if err != nil {
		return nil, fmt.Errorf("computing sealing policy: %w", err)
	}
	if err := (tpm2.PolicyPCR{Pcrs: sel, PcrDigest: tpm2.TPM2BDigest{Buffer: digest}}).Update(calc); err != nil {
		return nil, fmt.Errorf("computing sealing policy: %w", err)
	}
	return calc.Hash().Digest, nil
}

// isTPMError reports whether err is a response code from the TPM (not a transport failure) that is
// not a warning such as TPM_RC_RETRY.
func isTPMError(err error) bool {
	var rc tpm2.TPMRC
	return errors.As(err, &rc) && !rc.IsWarning()
}

// marshalSealed encodes a sealed blob: version, then the PCR selection (TPML_PCR_SELECTION), the
// object's TPM2B_PUBLIC and its TPM2B_PRIVATE, each behind a two-byte length.
func marshalSealed(sel tpm2.TPMLPCRSelection, pub tpm2.TPM2BPublic, priv tpm2.TPM2BPrivate) []byte {
	b := []byte{sealVersion}
	b = appendSized(b, tpm2.Marshal(sel))
	b = appendSized(b, tpm2.Marshal(pub))
	return appendSized(b, tpm2.Marshal(priv))
}

// unmarshalSealed decodes and checks a sealed blob; every failure is ErrSealedKeyUnusable.
func unmarshalSealed(blob []byte) (tpm2.TPMLPCRSelection, tpm2.TPM2BPublic, tpm2.TPM2BPrivate, error) {
	var (
		sel  tpm2.TPMLPCRSelection
		pub  tpm2.TPM2BPublic
		priv tpm2.TPM2BPrivate
	)
	bad := func(what string) error {
		return fmt.Errorf("%w: malformed sealed blob: %s", ErrSealedKeyUnusable, what)
	}
	if len(blob) == 0 || len(blob) > maxSealedBlob || blob[0] != sealVersion {
		return sel, pub, priv, bad("unknown version or size")
	}
	rawSel, rest, ok1 := cutSized(blob[1:])
	rawPub, rest, ok2 := cutSized(rest)
	rawPriv, rest, ok3 := cutSized(rest)
	if !ok1 || !ok2 || !ok3 || len(rest) != 0 {
		return sel, pub, priv, bad("truncated")
	}
	s, err := tpm2.Unmarshal[tpm2.TPMLPCRSelection](rawSel)
	if err != nil || !bytes.Equal(tpm2.Marshal(s), rawSel) {
		return sel, pub, priv, bad("PCR selection")
	}
	if len(s.PCRSelections) != 1 || s.PCRSelections[0].Hash != tpm2.TPMAlgSHA256 || len(selectedPCRs(*s)) == 0 {
		return sel, pub, priv, bad("PCR selection is not in the SHA-256 bank")
	}
	p, err := tpm2.Unmarshal[tpm2.TPM2BPublic](rawPub)
	if err != nil || !bytes.Equal(tpm2.Marshal(p), rawPub) {
		return sel, pub, priv, bad("public area")
	}
	area, err := p.Contents()
	if err != nil || area.Type != tpm2.TPMAlgKeyedHash || area.ObjectAttributes.UserWithAuth || len(area.AuthPolicy.Buffer) == 0 {
		return sel, pub, priv, bad("not a policy-sealed data object")
	}
	pr, err := tpm2.Unmarshal[tpm2.TPM2BPrivate](rawPriv)
	if err != nil || !bytes.Equal(tpm2.Marshal(pr), rawPriv) {
		return sel, pub, priv, bad("private area")
	}
	return *s, *p, *pr, nil
}
