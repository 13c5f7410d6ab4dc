package kmsplugin

import (
	"bytes"
	"context"
	"crypto/cipher"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	kmsservice "k8s.io/kms/pkg/service"
)

type recorder struct {
	mu       sync.Mutex
	requests []string
	health   []bool
}

func (r *recorder) Request(method, keyID string, err error, _ time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	res := "ok"
	if err != nil {
		res = "error"
	}
	r.requests = append(r.requests, method+" "+keyID+" "+res)
}

func (r *recorder) Health(healthy bool, _ string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.health = append(r.health, healthy)
}

func TestServiceRoundTripAndRotation(t *testing.T) {
	ctx := context.Background()
	rec := &recorder{}
	svc := NewService(rec)
	if _, err := svc.Encrypt(ctx, "u", []byte("seed")); !errors.Is(err, ErrNoKeys) {
		t.Fatalf("Encrypt without keys = %v, want ErrNoKeys", err)
	}
	st, err := svc.Status(ctx)
	if err != nil || st.Healthz == Healthy || st.KeyID != "" {
		t.Fatalf("Status without keys = %+v, %v; want unhealthy without key ID", st, err)
	}
	g1 := KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}
	if err := svc.SetKeys(g1); err != nil {
		t.Fatal(err)
	}
	st, err = svc.Status(ctx)
	if err != nil || st.Healthz != Healthy || st.KeyID != g1.ActiveKeyID() || st.Version != "v2" {
		t.Fatalf("Status = %+v, %v", st, err)
	}
	seed := bytes.Repeat([]byte{7}, 32)
	old, err := svc.Encrypt(ctx, "u", seed)
	if err != nil {
		t.Fatal(err)
	}
	if old.KeyID != g1.ActiveKeyID() || bytes.Contains(old.Ciphertext, seed) {
		t.Fatalf("Encrypt = key ID %q, ciphertext holds the plaintext: %v", old.KeyID, bytes.Contains(old.Ciphertext, seed))
	}
	again, _ := svc.Encrypt(ctx, "u", seed)
	if bytes.Equal(again.Ciphertext, old.Ciphertext) {
		t.Error("two encryptions of one plaintext are equal (nonce reused)")
	}

	// Rotation: generation 2 becomes active, generation 1 still decrypts.
	g12 := KeySet{Active: 2, Keys: []Key{testKey(1, 1), testKey(2, 2)}}
	if err := svc.SetKeys(g12); err != nil {
		t.Fatal(err)
	}
	if gens, active := svc.Generations(); active != 2 || len(gens) != 2 {
		t.Errorf("Generations() = %v, %d", gens, active)
	}
	st, _ = svc.Status(ctx)
	if st.KeyID != g12.ActiveKeyID() || st.KeyID == old.KeyID {
		t.Fatalf("Status key ID after rotation = %q", st.KeyID)
	}
	newer, err := svc.Encrypt(ctx, "u", seed)
	if err != nil || newer.KeyID != g12.ActiveKeyID() {
		t.Fatalf("Encrypt after rotation = %v, %v", newer, err)
	}
	for _, c := range []*kmsservice.EncryptResponse{old, newer} {
		plain, err := svc.Decrypt(ctx, "u", &kmsservice.DecryptRequest{Ciphertext: c.Ciphertext, KeyID: c.KeyID})
		if err != nil || !bytes.Equal(plain, seed) {
			t.Errorf("Decrypt under %s = %v, %v", c.KeyID, plain, err)
		}
	}

	// Retired: generation 1 is gone, its objects no longer decrypt.
	if err := svc.SetKeys(KeySet{Active: 2, Keys: []Key{testKey(2, 2)}}); err != nil {
		t.Fatal(err)
	}
	_, err = svc.Decrypt(ctx, "u", &kmsservice.DecryptRequest{Ciphertext: old.Ciphertext, KeyID: old.KeyID})
	if !errors.Is(err, ErrUnknownKeyID) || !strings.Contains(err.Error(), "generation 1") {
		t.Errorf("Decrypt under a retired key = %v, want ErrUnknownKeyID naming generation 1", err)
	}
	if strings.Contains(rec.requests[len(rec.requests)-1], " ok") {
		t.Errorf("the observer saw the failed Decrypt as ok: %v", rec.requests)
	}
}

func TestServiceRefusesTampering(t *testing.T) {
	ctx := context.Background()
	svc := NewService(nil)
	set := KeySet{Active: 2, Keys: []Key{testKey(1, 1), testKey(2, 2)}}
	if err := svc.SetKeys(set); err != nil {
		t.Fatal(err)
	}
	c, err := svc.Encrypt(ctx, "u", []byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	other := KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}.ActiveKeyID()
	flip := func(i int) []byte {
		b := bytes.Clone(c.Ciphertext)
		b[i] ^= 1
		return b
	}
	for name, req := range map[string]*kmsservice.DecryptRequest{
		"other generation's key ID": {Ciphertext: c.Ciphertext, KeyID: other},
		"version byte flipped":      {Ciphertext: flip(0), KeyID: c.KeyID},
		"nonce bit flipped":         {Ciphertext: flip(3), KeyID: c.KeyID},
		"tag bit flipped":           {Ciphertext: flip(len(c.Ciphertext) - 1), KeyID: c.KeyID},
		"truncated":                 {Ciphertext: c.Ciphertext[:20], KeyID: c.KeyID},
		"empty":                     {KeyID: c.KeyID},
	} {
		if _, err := svc.Decrypt(ctx, "u", req); !errors.Is(err, ErrDecrypt) {
			t.Errorf("%s: Decrypt = %v, want ErrDecrypt", name, err)
		}
	}
	_, err = svc.Decrypt(ctx, "u", &kmsservice.DecryptRequest{Ciphertext: c.Ciphertext, KeyID: "evil\x1b[31m" + strings.Repeat("x", 200)})
	if !errors.Is(err, ErrUnknownKeyID) || strings.Contains(err.Error(), "\x1b") || len(err.Error()) > 200 {
		t.Errorf("Decrypt with a hostile key ID = %q", err)
	}
	for _, p := range [][]byte{nil, make([]byte, 1025)} {
		if _, err := svc.Encrypt(ctx, "u", p); !errors.Is(err, ErrBadPlaintext) {
			t.Errorf("Encrypt(%d bytes) = %v", len(p), err)
		}
	}
}

// Status's self-test fails when the active key cannot decrypt what it encrypted: the health check
// that follows it goes red.
func TestStatusSelfTestFails(t *testing.T) {
	rec := &recorder{}
	svc := NewService(rec)
	if err := svc.SetKeys(KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}); err != nil {
		t.Fatal(err)
	}
	// Break the active key as corrupted memory would: what it seals no longer opens.
	st := *svc.state.Load()
	st.byID = map[string]cipher.AEAD{st.activeID: brokenAEAD{st.byID[st.activeID]}}
	svc.state.Store(&st)
	resp, err := svc.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if resp.Healthz == Healthy || !strings.Contains(resp.Healthz, "self-test") {
		t.Errorf("Status with a key that cannot decrypt = %+v, want an unhealthy self-test", resp)
	}
	if len(rec.health) == 0 || rec.health[len(rec.health)-1] {
		t.Errorf("the observer was told the plugin is healthy: %v", rec.health)
	}
}

// brokenAEAD seals like its AEAD and never opens.
type brokenAEAD struct{ cipher.AEAD }

func (brokenAEAD) Open([]byte, []byte, []byte, []byte) ([]byte, error) {
	return nil, errors.New("message authentication failed")
}
