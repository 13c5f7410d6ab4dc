package kmsplugin

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
)

func testKey(gen uint32, b byte) Key {
	return Key{Generation: gen, KEK: bytes.Repeat([]byte{b}, KeySize)}
}

func TestKeySetValidate(t *testing.T) {
	good := KeySet{Active: 2, Keys: []Key{testKey(1, 1), testKey(2, 2)}}
	if err := good.Validate(); err != nil {
		t.Fatalf("Validate(good) = %v", err)
	}
	for name, s := range map[string]KeySet{
		"no keys":             {Active: 1},
		"generation zero":     {Active: 0, Keys: []Key{testKey(0, 1)}},
		"generation twice":    {Active: 1, Keys: []Key{testKey(1, 1), testKey(1, 2)}},
		"short key":           {Active: 1, Keys: []Key{{Generation: 1, KEK: make([]byte, 16)}}},
		"active not held":     {Active: 3, Keys: []Key{testKey(1, 1), testKey(2, 2)}},
		"active zero, held 1": {Keys: []Key{testKey(1, 1)}},
	} {
		if err := s.Validate(); !errors.Is(err, ErrInvalidKeySet) {
			t.Errorf("%s: Validate() = %v, want ErrInvalidKeySet", name, err)
		}
	}
}

func TestKeyID(t *testing.T) {
	k := testKey(7, 1)
	id := KeyID(k.Generation, k.KEK)
	if !strings.HasPrefix(id, "berth:g7:") || len(id) != len("berth:g7:")+16 {
		t.Fatalf("KeyID = %q", id)
	}
	if gen, ok := GenerationOf(id); !ok || gen != 7 {
		t.Errorf("GenerationOf(%q) = %d, %v", id, gen, ok)
	}
	if KeyID(7, testKey(7, 2).KEK) == id {
		t.Error("two keys of one generation have the same key ID")
	}
	if KeyID(8, k.KEK) == id {
		t.Error("one key in two generations has the same key ID")
	}
	if strings.Contains(id, hex.EncodeToString(k.KEK)[:8]) {
		t.Error("the key ID shows the key's bytes")
	}
	for _, bad := range []string{"", "berth:g0:0123456789abcdef", "berth:gx:0123456789abcdef", "berth:g1:0123", "berth:g1:0123456789abcdeg", "other:g1:0123456789abcdef"} {
		if _, ok := GenerationOf(bad); ok {
			t.Errorf("GenerationOf(%q) accepted it", bad)
		}
	}
}

func TestKeySetEncoding(t *testing.T) {
	s := KeySet{Active: 2, Keys: []Key{testKey(1, 1), testKey(2, 2)}}
	b, err := MarshalKeySet(s)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalKeySet(b)
	if err != nil {
		t.Fatal(err)
	}
	if !back.Equal(s) {
		t.Fatalf("round trip: %v, want %v", back, s)
	}
	if back.Equal(KeySet{Active: 1, Keys: s.Keys}) || back.Equal(KeySet{Active: 2, Keys: []Key{testKey(1, 1), testKey(2, 3)}}) {
		t.Error("Equal ignores the active generation or a key's bytes")
	}
	if _, err := MarshalKeySet(KeySet{Active: 1}); !errors.Is(err, ErrInvalidKeySet) {
		t.Errorf("MarshalKeySet(empty) = %v", err)
	}
	secret := base64.StdEncoding.EncodeToString(testKey(9, 9).KEK)
	for name, in := range map[string]string{
		"not json":       "kek=" + secret,
		"version 2":      `{"version":2,"active":1,"keys":[{"generation":1,"kek":"` + secret + `"}]}`,
		"short key":      `{"version":1,"active":1,"keys":[{"generation":1,"kek":"AAAA"}]}`,
		"active missing": `{"version":1,"active":2,"keys":[{"generation":1,"kek":"` + secret + `"}]}`,
	} {
		_, err := UnmarshalKeySet([]byte(in))
		if !errors.Is(err, ErrInvalidKeySet) {
			t.Errorf("%s: UnmarshalKeySet = %v, want ErrInvalidKeySet", name, err)
		}
		if err != nil && strings.Contains(err.Error(), secret) {
			t.Errorf("%s: the error quotes the key: %v", name, err)
		}
	}
}

// A key set printed in any way (a log field, an error) never shows a key.
func TestKeySetNeverPrintsKeys(t *testing.T) {
	s := KeySet{Active: 1, Keys: []Key{testKey(1, 0xab)}}
	needles := []string{hex.EncodeToString(s.Keys[0].KEK)[:16], base64.StdEncoding.EncodeToString(s.Keys[0].KEK)[:16], "171, 171", "[171 171"}
	for _, out := range []string{
		fmt.Sprint(s), fmt.Sprintf("%v", s), fmt.Sprintf("%+v", s), fmt.Sprintf("%#v", s), fmt.Sprint(s.Keys[0]),
		fmt.Sprintf("%v", s.Keys), fmt.Sprintf("%#v", s.Keys[0]),
	} {
		for _, n := range needles {
			if strings.Contains(strings.ToLower(out), strings.ToLower(n)) {
				t.Errorf("%q shows the key (%q)", out, n)
			}
		}
	}
}
