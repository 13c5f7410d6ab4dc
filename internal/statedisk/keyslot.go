package statedisk

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"fmt"
)

// keyslot is a volume key wrapped with AES-256-GCM under a slot key.
type keyslot struct {
	Nonce   []byte `json:"nonce"`
	Wrapped []byte `json:"wrapped"`
}

// keyslotAAD binds a keyslot to its disk and to the header format.
func keyslotAAD(uuid string) []byte {
	return []byte(headerVersion + "\x00" + uuid)
}

func slotAEAD(slotKey []byte) (cipher.AEAD, error) {
	if err := checkKey(slotKey); err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(slotKey)
	if err != nil {
		return nil, fmt.Errorf("creating keyslot cipher: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("creating keyslot cipher: %w", err)
	}
	return aead, nil
}

// wrapKey wraps volumeKey under slotKey for the disk uuid, with a fresh random nonce.
func wrapKey(slotKey, volumeKey []byte, uuid string) (keyslot, error) {
	aead, err := slotAEAD(slotKey)
	if err != nil {
		return keyslot{}, err
	}
	nonce := make([]byte, aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return keyslot{}, fmt.Errorf("generating keyslot nonce: %w", err)
	}
	return keyslot{Nonce: nonce, Wrapped: aead.Seal(nil, nonce, volumeKey, keyslotAAD(uuid))}, nil
}

// unwrapKey returns the volume key of slot; ErrWrongKey if slotKey does not open it. The caller
// owns (and zeroes) the result.
func unwrapKey(slotKey []byte, slot keyslot, uuid string) ([]byte, error) {
	aead, err := slotAEAD(slotKey)
	if err != nil {
		return nil, err
	}
	if len(slot.Nonce) != aead.NonceSize() {
		return nil, fmt.Errorf("reading keyslot: nonce has %d bytes, want %d", len(slot.Nonce), aead.NonceSize())
	}
	volumeKey, err := aead.Open(nil, slot.Nonce, slot.Wrapped, keyslotAAD(uuid))
	if err != nil {
		return nil, ErrWrongKey
	}
	if len(volumeKey) != volumeKeySize {
		clear(volumeKey)
		return nil, fmt.Errorf("reading keyslot: volume key has %d bytes, want %d", len(volumeKey), volumeKeySize)
	}
	return volumeKey, nil
}
