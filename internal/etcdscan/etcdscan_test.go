package etcdscan

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/berth-k8s/berth/internal/apiservertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

// kmsValue builds a stored value as the API server writes it: prefix, then an EncryptedObject with
// encryptedData (1), keyID (2), encryptedDEKSource (3), an annotation (4) and the source type (5).
func kmsValue(provider, keyID string, keyIDFirst bool) []byte {
	b := Prefix(provider)
	data := func(b []byte) []byte {
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		return protowire.AppendBytes(b, []byte("ciphertext"))
	}
	id := func(b []byte) []byte {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		return protowire.AppendString(b, keyID)
	}
	if keyIDFirst {
		b = id(b)
		b = data(b)
	} else {
		b = data(b)
		b = id(b)
	}
	b = protowire.AppendTag(b, 3, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("dek"))
	var entry []byte
	entry = protowire.AppendTag(entry, 1, protowire.BytesType)
	entry = protowire.AppendString(entry, "example.com/a")
	b = protowire.AppendTag(b, 4, protowire.BytesType)
	b = protowire.AppendBytes(b, entry)
	b = protowire.AppendTag(b, 5, protowire.VarintType)
	return protowire.AppendVarint(b, 1)
}

func TestKeyIDOf(t *testing.T) {
	for _, first := range []bool{true, false} {
		if id, err := KeyIDOf(kmsValue("berth", "berth:g2:0011223344556677", first), "berth"); err != nil || id != "berth:g2:0011223344556677" {
			t.Errorf("KeyIDOf (key ID first: %v) = %q, %v", first, id, err)
		}
	}
	noID := append(Prefix("berth"), protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), []byte("x"))...)
	for name, v := range map[string][]byte{
		"plaintext":      []byte("k8s\x00\x0a\x0cv1\x12\x06Secret"),
		"other provider": kmsValue("other", "id", true),
		"aescbc":         []byte("k8s:enc:aescbc:v1:key1:xxxx"),
		"truncated":      kmsValue("berth", "berth:g2:0011223344556677", true)[:len(Prefix("berth"))+3],
		"no key ID":      noID,
	} {
		if _, err := KeyIDOf(v, "berth"); !errors.Is(err, ErrNotKMS) {
			t.Errorf("%s: KeyIDOf = %v, want ErrNotKMS", name, err)
		}
	}
}

func TestParseKey(t *testing.T) {
	for key, want := range map[string]Object{
		"/registry/secrets/ns/name":  {Key: "/registry/secrets/ns/name", Resource: "secrets", Namespace: "ns", Name: "name"},
		"/registry/namespaces/other": {Key: "/registry/namespaces/other", Resource: "namespaces", Name: "other"},
	} {
		if got, ok := ParseKey(key); !ok || got != want {
			t.Errorf("ParseKey(%q) = %+v, %v", key, got, ok)
		}
	}
	for _, bad := range []string{"/other/secrets/a/b", "/registry/secrets", "/registry/secrets/a/b/c", "/registry//a"} {
		if _, ok := ParseKey(bad); ok {
			t.Errorf("ParseKey(%q) accepted it", bad)
		}
	}
}

// Scan against a real etcd: several pages, two key IDs, plaintext, the listing limit, and nothing
// outside the prefixes.
func TestScan(t *testing.T) {
	env := apiservertest.Shared(t)
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	const prefix = "/registry/scantest/"
	put := func(k string, v []byte) {
		if _, err := c.Put(ctx, k, string(v)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 450 {
		put(fmt.Sprintf("%sns/new-%03d", prefix, i), kmsValue("berth", "new", i%2 == 0))
	}
	for i := range 7 {
		put(fmt.Sprintf("%sns/old-%d", prefix, i), kmsValue("berth", "old", true))
	}
	put(prefix+"ns/plain", []byte("k8s\x00plaintext"))
	put("/registry/scantest2/ns/outside", kmsValue("berth", "old", true))

	r, err := Scan(ctx, c, Options{Provider: "berth", Prefixes: []string{prefix}, Keep: []string{"new"}})
	if err != nil {
		t.Fatal(err)
	}
	if r.Objects != 458 || r.ByKeyID["new"] != 450 || r.ByKeyID["old"] != 7 || r.NotEncrypted != 1 || len(r.Listed) != 8 || r.Truncated {
		t.Fatalf("report = objects %d, by key %v, not encrypted %d, listed %d (truncated %v)", r.Objects, r.ByKeyID, r.NotEncrypted, len(r.Listed), r.Truncated)
	}
	for _, o := range r.Listed {
		if o.Resource != "scantest" || o.Namespace != "ns" || (o.Name != "plain" || o.KeyID != "") && (o.Name[:4] != "old-" || o.KeyID != "old") {
			t.Errorf("listed %+v", o)
		}
	}
	r, err = Scan(ctx, c, Options{Provider: "berth", Prefixes: []string{prefix}, Keep: []string{"new"}, Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Listed) != 3 || !r.Truncated || r.ByKeyID["old"] != 7 {
		t.Errorf("limited report: listed %d, truncated %v, old %d", len(r.Listed), r.Truncated, r.ByKeyID["old"])
	}
}
