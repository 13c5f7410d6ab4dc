package backup

import (
	"bufio"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"filippo.io/age"
	"golang.org/x/crypto/chacha20poly1305"

	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// magic starts every snapshot's payload.
const magic = "berth-snapshot v1\n"

// stanzaType names the age stanza that wraps a snapshot's file key under the backup key.
const stanzaType = "berth-backup"

// maxManifest bounds the manifest a reader accepts.
const maxManifest = 1 << 20

// Named errors of Open.
var (
	// ErrWrongSecret: the snapshot was not sealed under this master secret (or it is not a snapshot).
	ErrWrongSecret = errors.New("the snapshot does not open with this master secret")
	// ErrCorrupt: the snapshot opened but its content is cut short or changed.
	ErrCorrupt = errors.New("the snapshot is damaged")
)

// Manifest is what a snapshot carries beside etcd's data: enough to restore the cluster's Secrets.
type Manifest struct {
	// ClusterID is the cluster's ID (hex), the one its nodes' lock registers hold.
	ClusterID string `json:"clusterID"`
	// Taken is when the snapshot was taken.
	Taken time.Time `json:"taken"`
	// KMS is the KMS key spec at the snapshot, with every generation's key-encryption key.
	KMS KMSKeys `json:"kms"`
}

// KMSKeys are the KMS plugin's keys at a snapshot: every generation the Secrets may be encrypted
// under, and the active one.
type KMSKeys struct {
	Active uint32 `json:"active"`
	// Keys maps a generation (decimal) to its 32-byte key-encryption key.
	Keys map[string][]byte `json:"keys"`
}

// String never prints the keys.
func (k KMSKeys) String() string {
	return fmt.Sprintf("KMS keys (%d generations, active %d)", len(k.Keys), k.Active)
}

// GoString never prints the keys.
func (k KMSKeys) GoString() string { return k.String() }

// Key returns generation's key.
func (k KMSKeys) Key(generation uint32) ([]byte, bool) {
	b, ok := k.Keys[strconv.FormatUint(uint64(generation), 10)]
	return b, ok
}

// KMSKeysOf derives the keys of generations (the KMS spec's) from keys.
func KMSKeysOf(keys *clusterkeys.Keys, generations []uint32, active uint32) KMSKeys {
	out := KMSKeys{Active: active, Keys: make(map[string][]byte, len(generations))}
	for _, g := range generations {
		out.Keys[strconv.FormatUint(uint64(g), 10)] = keys.KMSKey(g)
	}
	return out
}

// Seal writes the sealed snapshot of m and the etcd snapshot read from data to w, under keys'
// backup key. It returns the number of etcd snapshot bytes sealed.
func Seal(w io.Writer, keys *clusterkeys.Keys, m Manifest, data io.Reader) (int64, error) {
	if len(m.KMS.Keys) == 0 {
		return 0, errors.New("sealing a snapshot: the manifest has no KMS keys")
	}
	mb, err := json.Marshal(m)
	if err != nil {
		return 0, fmt.Errorf("sealing a snapshot: %w", err)
	}
	enc, err := age.Encrypt(w, recipient{key: keys.BackupKey()})
	if err != nil {
		return 0, fmt.Errorf("sealing a snapshot: %w", err)
	}
	bw := bufio.NewWriterSize(enc, 64<<10)
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(mb)))
	for _, part := range [][]byte{[]byte(magic), n[:], mb} {
		if _, err := bw.Write(part); err != nil {
			return 0, fmt.Errorf("sealing a snapshot: %w", err)
		}
	}
	copied, err := io.Copy(bw, data)
	if err != nil {
		return copied, fmt.Errorf("sealing a snapshot: reading etcd's snapshot: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return copied, fmt.Errorf("sealing a snapshot: %w", err)
	}
	if err := enc.Close(); err != nil {
		return copied, fmt.Errorf("sealing a snapshot: %w", err)
	}
	return copied, nil
}

// Open opens a sealed snapshot with keys' backup key: its manifest, and a reader of the etcd
// snapshot. Reading returns ErrCorrupt when the rest of the file was cut or changed, so that a
// caller writing it out must not use what it wrote before the read ended with io.EOF.
func Open(r io.Reader, keys *clusterkeys.Keys) (Manifest, io.Reader, error) {
	dec, err := age.Decrypt(r, identity{key: keys.BackupKey()})
	if err != nil {
		if errors.Is(err, ErrWrongSecret) || errors.Is(err, age.ErrIncorrectIdentity) {
			return Manifest{}, nil, ErrWrongSecret
		}
		// A header that is not age's, or whose MAC fails although the stanza opened.
		return Manifest{}, nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	br := bufio.NewReaderSize(dec, 64<<10)
	head := make([]byte, len(magic)+4)
	if _, err := io.ReadFull(br, head); err != nil {
		return Manifest{}, nil, fmt.Errorf("%w: reading its manifest: %w", ErrCorrupt, err)
	}
	if string(head[:len(magic)]) != magic {
		return Manifest{}, nil, fmt.Errorf("%w: not a Berth snapshot of a known version", ErrCorrupt)
	}
	size := binary.BigEndian.Uint32(head[len(magic):])
	if size > maxManifest {
		return Manifest{}, nil, fmt.Errorf("%w: a manifest of %d bytes", ErrCorrupt, size)
	}
	mb := make([]byte, size)
	if _, err := io.ReadFull(br, mb); err != nil {
		return Manifest{}, nil, fmt.Errorf("%w: reading its manifest: %w", ErrCorrupt, err)
	}
	var m Manifest
	if err := json.Unmarshal(mb, &m); err != nil {
		return Manifest{}, nil, fmt.Errorf("%w: decoding its manifest: %w", ErrCorrupt, err)
	}
	if _, ok := m.KMS.Key(m.KMS.Active); !ok {
		return Manifest{}, nil, fmt.Errorf("%w: the manifest has no key of the active KMS generation", ErrCorrupt)
	}
	return m, corruptReader{br}, nil
}

// corruptReader names every error but io.EOF ErrCorrupt.
type corruptReader struct{ r io.Reader }

func (c corruptReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		err = fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return n, err
}

// recipient wraps a file key under the backup key: XChaCha20-Poly1305 with a random nonce, the
// stanza's body being the nonce and the sealed key.
type recipient struct{ key []byte }

func (r recipient) Wrap(fileKey []byte) ([]*age.Stanza, error) {
	aead, err := chacha20poly1305.NewX(r.key)
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, aead.NonceSize(), aead.NonceSize()+len(fileKey)+aead.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	return []*age.Stanza{{Type: stanzaType, Body: aead.Seal(nonce, nonce, fileKey, []byte(stanzaType))}}, nil
}

// identity unwraps what recipient wrapped.
type identity struct{ key []byte }

func (id identity) Unwrap(stanzas []*age.Stanza) ([]byte, error) {
	aead, err := chacha20poly1305.NewX(id.key)
	if err != nil {
		return nil, err
	}
	for _, s := range stanzas {
		if s.Type != stanzaType || len(s.Body) < aead.NonceSize() {
			continue
		}
		key, err := aead.Open(nil, s.Body[:aead.NonceSize()], s.Body[aead.NonceSize():], []byte(stanzaType))
		if err == nil {
			return key, nil
		}
		return nil, ErrWrongSecret
	}
	return nil, fmt.Errorf("no %s stanza: %w", stanzaType, age.ErrIncorrectIdentity)
}
