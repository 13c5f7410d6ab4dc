package statedisk

import (
	"bytes"
	"testing"
)

func TestHeaderMAC(t *testing.T) {
	key, other := bytes.Repeat([]byte{1}, KeySize), bytes.Repeat([]byte{2}, KeySize)
	h := Header{UUID: "0f8b9c2e-5d1a-4b7e-9a3c-2e6f1d4b8a70", ClusterID: []byte("cluster"), Binding: []byte("binding"), Sealed: []byte("blob")}
	mac, err := HeaderMAC(key, h)
	if err != nil {
		t.Fatal(err)
	}
	h.MAC = mac
	if !VerifyHeaderMAC(key, h) {
		t.Fatal("a header's own MAC does not verify")
	}
	upper := h
	upper.UUID = "0F8B9C2E-5D1A-4B7E-9A3C-2E6F1D4B8A70"
	resealed := h
	resealed.Sealed = []byte("another blob")
	if !VerifyHeaderMAC(key, upper) || !VerifyHeaderMAC(key, resealed) {
		t.Error("the MAC depends on the UUID's case or on the sealed blob")
	}
	for name, changed := range map[string]Header{
		"cluster ID":                  {UUID: h.UUID, ClusterID: []byte("other"), Binding: h.Binding, MAC: mac},
		"binding":                     {UUID: h.UUID, ClusterID: h.ClusterID, Binding: []byte("other"), MAC: mac},
		"UUID":                        {UUID: "7c1e4a9b-2f3d-4e8a-b6c5-9d0e1f2a3b4c", ClusterID: h.ClusterID, Binding: h.Binding, MAC: mac},
		"field boundary moved":        {UUID: h.UUID, ClusterID: []byte("clusterb"), Binding: []byte("inding"), MAC: mac},
		"no MAC":                      {UUID: h.UUID, ClusterID: h.ClusterID, Binding: h.Binding},
		"MAC truncated":               {UUID: h.UUID, ClusterID: h.ClusterID, Binding: h.Binding, MAC: mac[:16]},
		"cluster ID moved to the end": {UUID: h.UUID, Binding: append([]byte("cluster"), h.Binding...), MAC: mac},
	} {
		if VerifyHeaderMAC(key, changed) {
			t.Errorf("%s changed: the MAC still verifies", name)
		}
	}
	if VerifyHeaderMAC(other, h) {
		t.Error("the MAC verifies under another disk key")
	}
	if _, err := HeaderMAC(key[:16], h); err == nil {
		t.Error("HeaderMAC took a short key")
	}
}

// TestFscryptSetMAC: the MAC survives in the header file, and a re-format drops it.
func TestFscryptSetMAC(t *testing.T) {
	ctx := t.Context()
	d := newTestFscrypt(t)
	key := randomKey(t)
	h, err := d.Format(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetBinding(ctx, []byte("cluster"), []byte("binding")); err != nil {
		t.Fatal(err)
	}
	h.ClusterID, h.Binding = []byte("cluster"), []byte("binding")
	mac, err := HeaderMAC(key, h)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetMAC(ctx, mac); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := d.Header(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.MAC, mac) || !VerifyHeaderMAC(key, got) {
		t.Fatalf("header after close: %+v", got)
	}
	if got, err = d.Format(ctx, key); err != nil || got.MAC != nil {
		t.Fatalf("a re-formatted disk keeps a MAC (%x) or fails: %v", got.MAC, err)
	}
}
