package kmsplugin

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	kmsservice "k8s.io/kms/pkg/service"
)

// Status values of the KMS v2 API.
const (
	// APIVersion is the KMS API version Status reports.
	APIVersion = "v2"
	// Healthy is Status's Healthz when the plugin can encrypt and decrypt with its active key.
	Healthy = "ok"
)

// Named errors of the service. Their texts reach the API server's logs and health checks: they name
// key IDs and generations, never key bytes.
var (
	// ErrNoKeys: the plugin has not been given its key set yet.
	ErrNoKeys = errors.New("the plugin holds no key-encryption key yet")
	// ErrUnknownKeyID: Decrypt for a key ID of no generation the plugin holds (retired, or another
	// cluster's).
	ErrUnknownKeyID = errors.New("unknown key ID")
	// ErrDecrypt: the ciphertext does not open under the key its key ID names.
	ErrDecrypt = errors.New("the ciphertext does not decrypt under its key")
	// ErrBadPlaintext: Encrypt got nothing or more than a data-encryption key can be.
	ErrBadPlaintext = errors.New("plaintext must be 1 to 1024 bytes")
)

// ciphertextVersion is the first byte of every ciphertext: version 1 is nonce || AES-256-GCM sealed
// box, with the key ID as additional data.
const ciphertextVersion = 1

// maxPlaintext bounds what Encrypt takes: the API server sends a 32-byte seed and stores the
// ciphertext in a field of at most 1 KiB.
const maxPlaintext = 1024

// Observer learns of every request the service answers. Methods must return at once.
type Observer interface {
	// Request is a finished Encrypt, Decrypt or Status call: keyID is the key ID it used (empty when
	// none), err its error.
	Request(method, keyID string, err error, took time.Duration)
	// Health is the outcome of Status's self-test with the active key.
	Health(healthy bool, activeKeyID string)
}

// Methods of the KMS v2 API, as Observer and the metrics name them.
const (
	MethodEncrypt = "encrypt"
	MethodDecrypt = "decrypt"
	MethodStatus  = "status"
)

// Service implements the KMS v2 service (k8s.io/kms/pkg/service.Service) with the cluster's
// key-encryption keys: AES-256-GCM under the active generation's key, a random 96-bit nonce per call,
// the key ID as additional data. Decrypt picks the key by the key ID the API server stored with the
// object, so every generation the plugin holds stays readable. The keys live only in this process's
// memory.
type Service struct {
	state atomic.Pointer[keyState]
	obs   Observer
}

var _ kmsservice.Service = (*Service)(nil)

type keyState struct {
	set      KeySet
	activeID string
	byID     map[string]cipher.AEAD
}

// NewService returns a service without keys (Status is unhealthy until SetKeys). obs may be nil.
func NewService(obs Observer) *Service {
	if obs == nil {
		obs = nopObserver{}
	}
	return &Service{obs: obs}
}

type nopObserver struct{}

func (nopObserver) Request(string, string, error, time.Duration) {}
func (nopObserver) Health(bool, string)                          {}

// SetKeys replaces the key set. Requests in flight finish with the set they started with.
func (s *Service) SetKeys(set KeySet) error {
	if err := set.Validate(); err != nil {
		return err
	}
	st := &keyState{set: set, activeID: set.ActiveKeyID(), byID: map[string]cipher.AEAD{}}
	for _, k := range set.Keys {
		block, err := aes.NewCipher(k.KEK)
		if err != nil {
			return fmt.Errorf("%w: generation %d: %w", ErrInvalidKeySet, k.Generation, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return fmt.Errorf("%w: generation %d: %w", ErrInvalidKeySet, k.Generation, err)
		}
		st.byID[KeyID(k.Generation, k.KEK)] = aead
	}
	s.state.Store(st)
	return nil
}

// Generations returns the generations the service holds and the active one (0 without keys).
func (s *Service) Generations() (gens []uint32, active uint32) {
	st := s.state.Load()
	if st == nil {
		return nil, 0
	}
	return st.set.Generations(), st.set.Active
}

// Encrypt seals data under the active key.
func (s *Service) Encrypt(_ context.Context, _ string, data []byte) (resp *kmsservice.EncryptResponse, err error) {
	start := time.Now()
	keyID := ""
	defer func() { s.obs.Request(MethodEncrypt, keyID, err, time.Since(start)) }()
	st := s.state.Load()
	if st == nil {
		return nil, ErrNoKeys
	}
	if len(data) == 0 || len(data) > maxPlaintext {
		return nil, ErrBadPlaintext
	}
	keyID = st.activeID
	ct, err := seal(st.byID[keyID], keyID, data)
	if err != nil {
		return nil, err
	}
	return &kmsservice.EncryptResponse{Ciphertext: ct, KeyID: keyID}, nil
}

// Decrypt opens req's ciphertext under the key its key ID names.
func (s *Service) Decrypt(_ context.Context, _ string, req *kmsservice.DecryptRequest) (plain []byte, err error) {
	start := time.Now()
	keyID := req.KeyID
	defer func() { s.obs.Request(MethodDecrypt, keyID, err, time.Since(start)) }()
	st := s.state.Load()
	if st == nil {
		return nil, ErrNoKeys
	}
	aead, ok := st.byID[keyID]
	if !ok {
		gen, _ := GenerationOf(keyID)
		return nil, fmt.Errorf("%w %s (generation %d; this plugin holds %v)", ErrUnknownKeyID, quoteKeyID(keyID), gen, st.set.Generations())
	}
	return open(aead, keyID, req.Ciphertext)
}

// Status reports the active key ID and whether the plugin can encrypt and decrypt with it: every call
// seals and opens a random value under the active key, so a plugin that cannot decrypt says so.
func (s *Service) Status(_ context.Context) (resp *kmsservice.StatusResponse, err error) {
	start := time.Now()
	keyID := ""
	healthy := false
	defer func() {
		s.obs.Health(healthy, keyID)
		s.obs.Request(MethodStatus, keyID, err, time.Since(start))
	}()
	st := s.state.Load()
	if st == nil {
		return &kmsservice.StatusResponse{Version: APIVersion, Healthz: ErrNoKeys.Error()}, nil
	}
	keyID = st.activeID
	if err := selfTest(st.byID[keyID], keyID); err != nil {
		return &kmsservice.StatusResponse{Version: APIVersion, Healthz: err.Error(), KeyID: keyID}, nil
	}
	healthy = true
	return &kmsservice.StatusResponse{Version: APIVersion, Healthz: Healthy, KeyID: keyID}, nil
}

// selfTest seals a random value under aead and opens it again.
func selfTest(aead cipher.AEAD, keyID string) error {
	probe := make([]byte, 32)
	if _, err := rand.Read(probe); err != nil {
		return fmt.Errorf("self-test: reading random bytes: %w", err)
	}
	ct, err := seal(aead, keyID, probe)
	if err != nil {
		return fmt.Errorf("self-test: %w", err)
	}
	back, err := open(aead, keyID, ct)
	if err != nil {
		return fmt.Errorf("self-test: %w", err)
	}
	if string(back) != string(probe) {
		return errors.New("self-test: decrypting gave other bytes than were encrypted")
	}
	return nil
}

func seal(aead cipher.AEAD, keyID string, plain []byte) ([]byte, error) {
	out := make([]byte, 1+aead.NonceSize(), 1+aead.NonceSize()+len(plain)+aead.Overhead())
	out[0] = ciphertextVersion
	if _, err := rand.Read(out[1:]); err != nil {
		return nil, fmt.Errorf("reading a nonce: %w", err)
	}
	return aead.Seal(out, out[1:], plain, []byte(keyID)), nil
}

func open(aead cipher.AEAD, keyID string, ct []byte) ([]byte, error) {
	if len(ct) < 1+aead.NonceSize()+aead.Overhead() || ct[0] != ciphertextVersion {
		return nil, ErrDecrypt
	}
	nonce := ct[1 : 1+aead.NonceSize()]
	plain, err := aead.Open(nil, nonce, ct[1+aead.NonceSize():], []byte(keyID))
	if err != nil {
		return nil, ErrDecrypt
	}
	return plain, nil
}

// quoteKeyID shortens and quotes (escaping control characters) a key ID a caller sent, for an error
// text.
func quoteKeyID(id string) string {
	const maxLen = 64
	if len(id) > maxLen {
		return strconv.Quote(id[:maxLen]) + "..."
	}
	return strconv.Quote(id)
}
