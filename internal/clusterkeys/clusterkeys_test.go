package clusterkeys

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"strings"
	"testing"
)

func TestDerivations(t *testing.T) {
	master := bytes.Repeat([]byte{1}, 32)
	salt := bytes.Repeat([]byte{2}, 32)
	k, err := New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	k2, _ := New(master, bytes.Repeat([]byte{3}, 32))
	if bytes.Equal(k.ClusterID(), k2.ClusterID()) {
		t.Error("cluster ID does not depend on the salt")
	}
	if !bytes.Equal(k.ClusterID(), k.ClusterID()) {
		t.Error("cluster ID is not deterministic")
	}
	if bytes.Equal(k.ClusterID(), k.MeasurementSecret()) {
		t.Error("cluster ID equals measurement secret")
	}
	me := []byte("machine A")
	if !bytes.Equal(k.DiskKey("ABC-def", me), k.DiskKey("abc-DEF", me)) {
		t.Error("disk key depends on UUID case")
	}
	if bytes.Equal(k.DiskKey("a", me), k.DiskKey("b", me)) {
		t.Error("disk keys of two disks are equal")
	}
	// The attack this label stops: another machine naming the same UUID gets another key.
	if bytes.Equal(k.DiskKey("a", me), k.DiskKey("a", []byte("machine B"))) {
		t.Error("two machines naming the same disk UUID get the same disk key")
	}
	if bytes.Equal(k.DiskKey("a", me), k.LegacyDiskKey("a")) {
		t.Error("the disk key equals the legacy disk key")
	}
	if k.DiskKey("a", nil) != nil || k.DiskKey("", me) != nil {
		t.Error("an empty identity or UUID gets a disk key")
	}
	if !bytes.Equal(k.KMSKey(1), k.KMSKey(1)) || len(k.KMSKey(1)) != KeySize {
		t.Error("KMS key is not a deterministic 32-byte key")
	}
	for name, other := range map[string][]byte{
		"generation 2": k.KMSKey(2), "cluster ID": k.ClusterID(), "disk key of UUID 1": k.DiskKey("1", me),
		"other salt": k2.KMSKey(1), "measurement secret": k.MeasurementSecret(), "backup key": k.BackupKey(),
	} {
		if bytes.Equal(k.KMSKey(1), other) {
			t.Errorf("KMS key of generation 1 equals the %s", name)
		}
	}
	if bytes.Equal(k.BackupKey(), k2.BackupKey()) || len(k.BackupKey()) != KeySize {
		t.Error("the backup key is not a 32-byte key of its salt")
	}
	if len(k.ClusterID()) != KeySize {
		t.Errorf("len(ClusterID()) = %d", len(k.ClusterID()))
	}
	if _, err := New(master[:31], salt); !errors.Is(err, ErrBadInput) {
		t.Errorf("New(short master) = %v, want ErrBadInput", err)
	}
}

func TestDiskBinding(t *testing.T) {
	k, err := New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	const uuid = "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70"
	const other = "7c1e4a9b-2f3d-4e8a-b6c5-9d0e1f2a3b4c"
	me, them := []byte("tpm identity of machine A"), []byte("tpm identity of machine B")
	b := k.DiskBinding(uuid, me)
	if len(b) != sha256.Size {
		t.Fatalf("len(DiskBinding()) = %d, want %d", len(b), sha256.Size)
	}
	if !k.VerifyDiskBinding(uuid, me, b) {
		t.Fatal("a disk's own binding does not verify")
	}
	if !k.VerifyDiskBinding(strings.ToUpper(uuid), me, b) {
		t.Error("the binding depends on the UUID's case")
	}
	if bytes.Equal(b, k.DiskKey(uuid, me)) {
		t.Error("the binding equals the disk key")
	}
	if key, ok := k.BoundDiskKey(uuid, me, b); !ok || !bytes.Equal(key, k.DiskKey(uuid, me)) {
		t.Error("BoundDiskKey does not give the machine's disk key for its binding")
	}
	legacy := k.LegacyDiskBinding(uuid, me)
	if bytes.Equal(legacy, b) {
		t.Error("the legacy binding equals the binding")
	}
	if key, ok := k.BoundDiskKey(uuid, me, legacy); !ok || !bytes.Equal(key, k.LegacyDiskKey(uuid)) {
		t.Error("BoundDiskKey does not give the legacy disk key for a legacy binding")
	}
	if key, ok := k.BoundDiskKey(uuid, them, legacy); ok || key != nil {
		t.Error("BoundDiskKey gives a legacy disk key to another machine")
	}
	if key, ok := k.BoundDiskKey(uuid, them, b); ok || key != nil {
		t.Error("BoundDiskKey gives a disk key to another machine")
	}
	k2, _ := New(bytes.Repeat([]byte{9}, 32), bytes.Repeat([]byte{2}, 32))
	flipped := append([]byte(nil), b...)
	flipped[len(flipped)-1] ^= 1
	for name, ok := range map[string]bool{
		"other disk's UUID":          k.VerifyDiskBinding(other, me, b),
		"other machine's identity":   k.VerifyDiskBinding(uuid, them, b),
		"identity with a suffix":     k.VerifyDiskBinding(uuid, append(append([]byte(nil), me...), 0), b),
		"truncated binding":          k.VerifyDiskBinding(uuid, me, b[:len(b)-1]),
		"one bit flipped":            k.VerifyDiskBinding(uuid, me, flipped),
		"binding with a suffix":      k.VerifyDiskBinding(uuid, me, append(append([]byte(nil), b...), 0)),
		"no binding":                 k.VerifyDiskBinding(uuid, me, nil),
		"empty identity":             k.VerifyDiskBinding(uuid, nil, k.DiskBinding(uuid, nil)),
		"empty UUID":                 k.VerifyDiskBinding("", me, k.DiskBinding("", me)),
		"other cluster's master key": k2.VerifyDiskBinding(uuid, me, b),
	} {
		if ok {
			t.Errorf("%s: the binding verifies", name)
		}
	}
}

func TestAdminProof(t *testing.T) {
	k, _ := New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	wrong, _ := New(bytes.Repeat([]byte{9}, 32), bytes.Repeat([]byte{2}, 32))
	nonce, key := []byte("nonce-0123456789"), []byte("public key DER")
	proof := k.AdminProof(nonce, key, 3600)
	if !k.VerifyAdminProof(nonce, key, 3600, proof) {
		t.Fatal("the right secret's proof does not verify")
	}
	if bytes.Equal(proof, k.DiskBinding("x", []byte("y"))) || bytes.Equal(proof[:16], k.BackupKey()[:16]) {
		t.Error("the proof repeats another derivation")
	}
	for name, ok := range map[string]bool{
		"wrong secret":    k.VerifyAdminProof(nonce, key, 3600, wrong.AdminProof(nonce, key, 3600)),
		"other nonce":     k.VerifyAdminProof([]byte("nonce-0123456788"), key, 3600, proof),
		"other key":       k.VerifyAdminProof(nonce, []byte("public key DES"), 3600, proof),
		"longer validity": k.VerifyAdminProof(nonce, key, 3601, proof),
		"truncated proof": k.VerifyAdminProof(nonce, key, 3600, proof[:31]),
		"empty proof":     k.VerifyAdminProof(nonce, key, 3600, nil),
		"empty nonce":     k.VerifyAdminProof(nil, key, 3600, k.AdminProof(nil, key, 3600)),
		"empty key":       k.VerifyAdminProof(nonce, nil, 3600, k.AdminProof(nonce, nil, 3600)),
		"fields run into": k.VerifyAdminProof([]byte("nonce-0123456789p"), []byte("ublic key DER"), 3600, proof),
	} {
		if ok {
			t.Errorf("%s: verifies", name)
		}
	}
}
