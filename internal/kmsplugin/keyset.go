package kmsplugin

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// KeySize is the size of a key-encryption key (AES-256).
const KeySize = 32

// ErrInvalidKeySet is returned for a key set the plugin cannot use: no keys, a key of the wrong size,
// a generation twice or zero, or an active generation it does not hold.
var ErrInvalidKeySet = errors.New("invalid KMS key set")

// Key is one generation of the key-encryption key (clusterkeys.KMSKey).
type Key struct {
	Generation uint32
	KEK        []byte
}

// String names the key's generation and ID, never its bytes.
func (k Key) String() string {
	return fmt.Sprintf("generation %d (%s)", k.Generation, KeyID(k.Generation, k.KEK))
}

// GoString is String: %#v never prints the key either.
func (k Key) GoString() string { return k.String() }

// KeySet is what a plugin holds: every generation it can decrypt with, and the one it encrypts with.
// A rotation adds a generation, makes it active, and retires the old one once nothing is stored under
// it any more.
type KeySet struct {
	// Active is the generation Encrypt uses and Status reports.
	Active uint32
	// Keys are the generations the plugin decrypts with, in any order.
	Keys []Key
}

// String lists the generations and the active one, never a key's bytes.
func (s KeySet) String() string {
	return fmt.Sprintf("generations %v, active %d", s.Generations(), s.Active)
}

// GoString is String: %#v never prints a key either.
func (s KeySet) GoString() string { return s.String() }

// Validate checks that the plugin can use s.
func (s KeySet) Validate() error {
	if len(s.Keys) == 0 {
		return fmt.Errorf("%w: no keys", ErrInvalidKeySet)
	}
	seen := map[uint32]bool{}
	for _, k := range s.Keys {
		switch {
		case k.Generation == 0:
			return fmt.Errorf("%w: generation 0 (generations start at 1)", ErrInvalidKeySet)
		case seen[k.Generation]:
			return fmt.Errorf("%w: generation %d twice", ErrInvalidKeySet, k.Generation)
		case len(k.KEK) != KeySize:
			return fmt.Errorf("%w: the key of generation %d has %d bytes, want %d", ErrInvalidKeySet, k.Generation, len(k.KEK), KeySize)
		}
		seen[k.Generation] = true
	}
	if !seen[s.Active] {
		return fmt.Errorf("%w: active generation %d is not among %v", ErrInvalidKeySet, s.Active, s.Generations())
	}
	return nil
}

// Generations returns the generations of s, ascending.
func (s KeySet) Generations() []uint32 {
	gens := make([]uint32, 0, len(s.Keys))
	for _, k := range s.Keys {
		gens = append(gens, k.Generation)
	}
	slices.Sort(gens)
	return gens
}

// Key returns generation's key.
func (s KeySet) Key(generation uint32) (Key, bool) {
	for _, k := range s.Keys {
		if k.Generation == generation {
			return k, true
		}
	}
	return Key{}, false
}

// ActiveKeyID is the key ID of the active generation ("" when s does not hold it).
func (s KeySet) ActiveKeyID() string {
	k, ok := s.Key(s.Active)
	if !ok {
		return ""
	}
	return KeyID(k.Generation, k.KEK)
}

// KeyIDs maps each generation's key ID to its generation.
func (s KeySet) KeyIDs() map[string]uint32 {
	ids := make(map[string]uint32, len(s.Keys))
	for _, k := range s.Keys {
		ids[KeyID(k.Generation, k.KEK)] = k.Generation
	}
	return ids
}

// Equal reports whether s and o hold the same keys with the same active generation.
func (s KeySet) Equal(o KeySet) bool {
	if s.Active != o.Active || len(s.Keys) != len(o.Keys) {
		return false
	}
	for _, k := range s.Keys {
		ok, found := o.Key(k.Generation)
		if !found || !hmac.Equal(k.KEK, ok.KEK) {
			return false
		}
	}
	return true
}

// keyIDPrefix starts every key ID this plugin gives out.
const keyIDPrefix = "berth:g"

// KeyID is the key ID of a generation's key, as the API server stores it in plaintext next to every
// object encrypted under it: "berth:g<generation>:<16 hex digits>". The digits are HMAC-SHA256 under
// the key of a fixed label, a fingerprint that tells a key of another cluster (or a corrupted one)
// apart and says nothing about the key.
func KeyID(generation uint32, kek []byte) string {
	mac := hmac.New(sha256.New, kek)
	mac.Write([]byte("berth kms key id"))
	return keyIDPrefix + strconv.FormatUint(uint64(generation), 10) + ":" + hex.EncodeToString(mac.Sum(nil)[:8])
}

// GenerationOf parses the generation out of a key ID this plugin made; ok is false for any other.
func GenerationOf(keyID string) (generation uint32, ok bool) {
	rest, found := strings.CutPrefix(keyID, keyIDPrefix)
	if !found {
		return 0, false
	}
	num, fp, found := strings.Cut(rest, ":")
	if !found || len(fp) != 16 {
		return 0, false
	}
	if _, err := hex.DecodeString(fp); err != nil {
		return 0, false
	}
	g, err := strconv.ParseUint(num, 10, 32)
	if err != nil || g == 0 {
		return 0, false
	}
	return uint32(g), true
}

// keySetFile is the encoding of a KeySet, on the pipe to the plugin and in the file the bootstrapper
// keeps on the node's encrypted state disk.
type keySetFile struct {
	Version int          `json:"version"`
	Active  uint32       `json:"active"`
	Keys    []keySetKeys `json:"keys"`
}

type keySetKeys struct {
	Generation uint32 `json:"generation"`
	KEK        []byte `json:"kek"`
}

// MarshalKeySet encodes s for UnmarshalKeySet. The result holds the keys: it goes only to the plugin's
// pipe or to a file on the encrypted state disk, never to a log.
func MarshalKeySet(s KeySet) ([]byte, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	f := keySetFile{Version: 1, Active: s.Active}
	for _, k := range s.Keys {
		f.Keys = append(f.Keys, keySetKeys(k))
	}
	return json.Marshal(f)
}

// UnmarshalKeySet decodes what MarshalKeySet made and validates it. Errors never quote the input.
func UnmarshalKeySet(b []byte) (KeySet, error) {
	var f keySetFile
	if err := json.Unmarshal(b, &f); err != nil {
		return KeySet{}, fmt.Errorf("%w: not a key set encoding", ErrInvalidKeySet)
	}
	if f.Version != 1 {
		return KeySet{}, fmt.Errorf("%w: encoding version %d, want 1", ErrInvalidKeySet, f.Version)
	}
	s := KeySet{Active: f.Active}
	for _, k := range f.Keys {
		s.Keys = append(s.Keys, Key(k))
	}
	if err := s.Validate(); err != nil {
		return KeySet{}, err
	}
	return s, nil
}
