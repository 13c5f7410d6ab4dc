package statedisk

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestKeyslot(t *testing.T) {
	slotKey, volumeKey := randomKey(t), bytes.Repeat([]byte{7}, volumeKeySize)
	const uuid = "0b5c6a1e-3f7d-4c2a-9e8b-1d2c3b4a5f60"
	slot, err := wrapKey(slotKey, volumeKey, uuid)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(slot.Wrapped, volumeKey) {
		t.Fatal("wrapped key holds the volume key")
	}
	got, err := unwrapKey(slotKey, slot, uuid)
	if err != nil || !bytes.Equal(got, volumeKey) {
		t.Fatalf("unwrapKey() = %x, %v", got, err)
	}
	again, err := wrapKey(slotKey, volumeKey, uuid)
	if err != nil || bytes.Equal(again.Nonce, slot.Nonce) {
		t.Fatalf("second wrap reused the nonce: %v", err)
	}

	tampered := keyslot{Nonce: slot.Nonce, Wrapped: bytes.Clone(slot.Wrapped)}
	tampered.Wrapped[0] ^= 1
	for name, tc := range map[string]struct {
		key  []byte
		slot keyslot
		uuid string
	}{
		"wrong key":     {randomKey(t), slot, uuid},
		"other disk":    {slotKey, slot, "0b5c6a1e-3f7d-4c2a-9e8b-1d2c3b4a5f61"},
		"tampered slot": {slotKey, tampered, uuid},
	} {
		if _, err := unwrapKey(tc.key, tc.slot, tc.uuid); !errors.Is(err, ErrWrongKey) {
			t.Errorf("%s: unwrapKey() = %v, want ErrWrongKey", name, err)
		}
	}
	if _, err := unwrapKey(slotKey[:16], slot, uuid); err == nil || errors.Is(err, ErrWrongKey) {
		t.Errorf("unwrapKey(16-byte key) = %v, want a key length error", err)
	}
}

func TestNewUUID(t *testing.T) {
	a, err := newUUID()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := newUUID()
	if a == b || len(a) != 36 || a[14] != '4' || a[8] != '-' || a[13] != '-' || a[18] != '-' || a[23] != '-' {
		t.Fatalf("newUUID() = %s, %s", a, b)
	}
	if c := a[19]; c != '8' && c != '9' && c != 'a' && c != 'b' {
		t.Fatalf("newUUID() variant = %c", c)
	}
}

func TestMountAt(t *testing.T) {
	dir := t.TempDir()
	info := filepath.Join(dir, "mountinfo")
	content := "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n" +
		"40 22 7:0 / /srv/my\\040disk rw,relatime shared:5 - ext4 /dev/loop0 rw\n" +
		"41 22 0:50 / /srv/other rw - tmpfs tmpfs rw\n" +
		"42 40 253:3 / /srv/my\\040disk rw,relatime - ext4 /dev/mapper/state rw\n"
	if err := os.WriteFile(info, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	got, ok, err := mountAt(info, "/srv/my disk")
	if err != nil || !ok || got != (mountEntry{Major: 253, Minor: 3, Source: "/dev/mapper/state"}) {
		t.Fatalf("mountAt(/srv/my disk) = %+v, %v, %v; want the top mount", got, ok, err)
	}
	if _, ok, err := mountAt(info, "/srv/none"); ok || err != nil {
		t.Fatalf("mountAt(/srv/none) = %v, %v", ok, err)
	}
}
