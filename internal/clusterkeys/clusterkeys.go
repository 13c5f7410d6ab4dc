// Package clusterkeys derives a cluster's keys from its master secret and salt with HKDF-SHA256.
// Nothing derived here is stored: anyone holding the master secret and salt can derive it again.
//
//	key                 info string
//	cluster ID          "berth/v1/cluster-id"
//	measurement secret  "berth/v1/measurement-secret"
//	disk key            "berth/v2/disk-key/" + lower-case disk UUID + "/" + hex(SHA-256(identity))
//	disk binding key    "berth/v2/disk-binding/" + lower-case disk UUID
//	legacy disk key     "berth/v1/disk-key/" + lower-case disk UUID
//	legacy binding key  "berth/v1/disk-binding/" + lower-case disk UUID
//	KMS key             "berth/v1/kms-kek/" + generation (decimal, 1, 2, ...)
//	AK CA seed          "berth/v1/ak-ca" (the Ed25519 seed of vtpm.ClusterAKCA)
//	backup key          "berth/v1/backup-key" (wraps the file key of every etcd snapshot, internal/backup)
//	admin access key    "berth/v1/admin-access" (the MAC key of AdminProof, berth kubeconfig)
//
// An admin proof is how an operator shows a joinservice that they hold the master secret without
// sending it: HMAC-SHA256 under the admin access key over a fixed label, the joinservice's nonce,
// the public key to certify and the validity asked for, each length-prefixed. The joinservice holds
// the master secret too, computes the same MAC and compares. The nonce makes a proof good for one
// request only; covering the key and the validity means that whoever sees a proof cannot use it
// for a key of their own or a longer validity. The key serves no other purpose, so a proof tells
// nothing about any other derived key.
//
// A KMS key is the key-encryption key of the KMS v2 plugin every control plane runs (etcd encryption
// at rest, internal/kmsplugin): it encrypts the API servers' data-encryption keys. Each generation
// has its own label, so `berth secrets rotate-key` moves to a key that no earlier one tells anything
// about, and every control plane that holds the master secret's derivations can rebuild any
// generation.
//
// A disk binding is HMAC-SHA256 under the disk binding key of the disk's UUID over the identity of
// the machine the disk belongs to (attestation.Result.Identity, or "instance/" + instance name where
// the variant has no per-machine identity). It is a MAC, not a key: the node keeps it in its disk's
// plaintext header, and the joinservice gives a rejoining node its disk key only when the binding
// verifies for the identity that node attested with. Its own info label keeps it independent of the
// disk key, so knowing a binding tells nothing about the key.
//
// A disk key belongs to one disk on one machine: its label names the disk's UUID and the identity
// of the machine the disk is bound to (the same identity as the binding's). Disk UUIDs are public
// (the LUKS header, the recovery server's Info), so a key derived from the UUID alone would go to
// whoever names it; a machine that names another machine's disk UUID gets the key of a disk that
// would be its own under that UUID, which opens nothing. Disks bound before keys named the machine
// carry a legacy binding (the v1 label); BoundDiskKey tells the two apart by the binding and gives
// such a disk its legacy key, still only to the machine the binding names. Nothing hands out a
// legacy key or binding for a new disk.
package clusterkeys

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Sizes of the inputs and outputs.
const (
	MasterSecretSize = 32
	SaltSize         = 32
	KeySize          = 32
)

// ErrBadInput is returned for a master secret or salt of the wrong size.
var ErrBadInput = errors.New("master secret and salt must be 32 bytes each")

// Keys derives keys for one cluster. The zero value is not usable; create it with New.
type Keys struct {
	master []byte
	salt   []byte
}

// New checks the sizes of master and salt and returns a deriver. It keeps copies of both.
func New(master, salt []byte) (*Keys, error) {
	if len(master) != MasterSecretSize || len(salt) != SaltSize {
		return nil, ErrBadInput
	}
	return &Keys{master: append([]byte(nil), master...), salt: append([]byte(nil), salt...)}, nil
}

func (k *Keys) derive(info string) []byte {
	key, err := hkdf.Key(sha256.New, k.master, k.salt, info, KeySize)
	if err != nil {
		// Only possible for output lengths HKDF-SHA256 cannot produce; KeySize is fixed and valid.
		panic(fmt.Sprintf("deriving %s: %v", info, err))
	}
	return key
}

// MasterSecret returns a copy of the master secret, for handing it to the cluster's joinservice.
func (k *Keys) MasterSecret() []byte { return append([]byte(nil), k.master...) }

// ClusterID is the cluster's public identifier, extended into every node's lock register.
func (k *Keys) ClusterID() []byte { return k.derive("berth/v1/cluster-id") }

// AKCASeed returns the seed of the cluster's attestation-key CA (vtpm.ClusterAKCA), which certifies
// the control planes' TPM attestation keys.
func (k *Keys) AKCASeed() []byte { return k.derive("berth/v1/ak-ca") }

// MeasurementSecret is the secret a node may use to prove cluster membership later.
func (k *Keys) MeasurementSecret() []byte { return k.derive("berth/v1/measurement-secret") }

// DiskKey is the key for the state disk with the given UUID (case-insensitive) of the machine with
// the given identity. It returns nil for an empty UUID or identity: those name no disk.
func (k *Keys) DiskKey(diskUUID string, identity []byte) []byte {
	if diskUUID == "" || len(identity) == 0 {
		return nil
	}
	id := sha256.Sum256(identity)
	return k.derive("berth/v2/disk-key/" + strings.ToLower(diskUUID) + "/" + hex.EncodeToString(id[:]))
}

// LegacyDiskKey is the key of a state disk bound before disk keys named the machine: it depends on
// the UUID alone. Only BoundDiskKey (a legacy binding that verifies) and tests use it.
func (k *Keys) LegacyDiskKey(diskUUID string) []byte {
	return k.derive("berth/v1/disk-key/" + strings.ToLower(diskUUID))
}

// KMSKey is generation's key-encryption key of the control planes' KMS plugins. Generations start
// at 1.
func (k *Keys) KMSKey(generation uint32) []byte {
	return k.derive("berth/v1/kms-kek/" + strconv.FormatUint(uint64(generation), 10))
}

// BackupKey wraps the key of every etcd snapshot the cluster takes (internal/backup): whoever holds
// the master secret and salt opens the cluster's snapshots, nobody else does.
func (k *Keys) BackupKey() []byte { return k.derive("berth/v1/backup-key") }

// AdminProof is the proof of possession of the master secret for a request of an admin credential
// (see the package documentation): the joinservice's nonce, the DER SubjectPublicKeyInfo of the
// key to certify and the validity in seconds.
func (k *Keys) AdminProof(nonce, publicKey []byte, validitySeconds int64) []byte {
	mac := hmac.New(sha256.New, k.derive("berth/v1/admin-access"))
	var n [8]byte
	for _, field := range [][]byte{[]byte("berth admin credential v1"), nonce, publicKey} {
		binary.BigEndian.PutUint64(n[:], uint64(len(field)))
		mac.Write(n[:])
		mac.Write(field)
	}
	binary.BigEndian.PutUint64(n[:], uint64(validitySeconds))
	mac.Write(n[:])
	return mac.Sum(nil)
}

// VerifyAdminProof reports whether proof is AdminProof(nonce, publicKey, validitySeconds). The
// comparison takes the same time wherever the proof differs; an empty nonce or key never verifies.
func (k *Keys) VerifyAdminProof(nonce, publicKey []byte, validitySeconds int64, proof []byte) bool {
	if len(nonce) == 0 || len(publicKey) == 0 {
		return false
	}
	return hmac.Equal(proof, k.AdminProof(nonce, publicKey, validitySeconds))
}

// DiskBinding binds the state disk with the given UUID (case-insensitive) to the machine with the
// given identity. It returns nil for an empty UUID or identity: those bind to nothing.
func (k *Keys) DiskBinding(diskUUID string, identity []byte) []byte {
	return k.binding("berth/v2/disk-binding/", diskUUID, identity)
}

// LegacyDiskBinding is the binding of a disk bound before disk keys named the machine.
func (k *Keys) LegacyDiskBinding(diskUUID string, identity []byte) []byte {
	return k.binding("berth/v1/disk-binding/", diskUUID, identity)
}

func (k *Keys) binding(label, diskUUID string, identity []byte) []byte {
	if diskUUID == "" || len(identity) == 0 {
		return nil
	}
	mac := hmac.New(sha256.New, k.derive(label+strings.ToLower(diskUUID)))
	mac.Write(identity)
	return mac.Sum(nil)
}

// VerifyDiskBinding reports whether binding is DiskBinding(diskUUID, identity) or its legacy form.
// The comparison takes the same time wherever the binding differs; an empty UUID, identity or
// binding never verifies.
func (k *Keys) VerifyDiskBinding(diskUUID string, identity, binding []byte) bool {
	_, ok := k.BoundDiskKey(diskUUID, identity, binding)
	return ok
}

// BoundDiskKey is the key of the disk diskUUID when binding binds it to the machine with identity:
// DiskKey for a binding (DiskBinding), LegacyDiskKey for a legacy one (LegacyDiskBinding). It
// returns false, and no key, when binding verifies as neither.
func (k *Keys) BoundDiskKey(diskUUID string, identity, binding []byte) ([]byte, bool) {
	if want := k.DiskBinding(diskUUID, identity); want != nil && hmac.Equal(want, binding) {
		return k.DiskKey(diskUUID, identity), true
	}
	if want := k.LegacyDiskBinding(diskUUID, identity); want != nil && hmac.Equal(want, binding) {
		return k.LegacyDiskKey(diskUUID), true
	}
	return nil, false
}
