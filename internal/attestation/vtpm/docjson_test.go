package vtpm

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"
)

// FuzzDocumentDecoders: whatever the fast decoder accepts, encoding/json (with unknown fields refused)
// decodes to the same Document.
func FuzzDocumentDecoders(f *testing.F) {
	full, err := json.Marshal(Document{
		Variant: Variant, UserData: []byte("u"), EKCert: []byte("c"), EKPublic: []byte("e"), AKPublic: []byte("a"),
		AKCreationData: []byte("d"), AKCertifyInfo: []byte("i"), AKCertifySignature: []byte("s"), AKCert: []byte("k"),
		Quote: []byte("q"), QuoteSignature: []byte("qs"), PCRs: map[uint32][]byte{0: make([]byte, 32), 23: {1}},
		EventLog: []byte("l"), Batch: [][]byte{make([]byte, 32), {}},
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(full)
	f.Add([]byte(`{"variant":"tpm","userData":null,"pcrs":{},"batch":[]}`))
	f.Add([]byte(` { "variant" : "tpm" , "pcrs" : null } `))
	f.Add([]byte(`{"variant":"tpm","Variant":"x"}`))
	f.Add([]byte(`{"pcrs":{"1":"AA==","01":"AQ=="}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		fast, ok := fastDecode(data)
		if !ok {
			return
		}
		var ref Document
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&ref); err != nil || dec.More() {
			t.Fatalf("fast decoder accepted %q, encoding/json refuses it: %v", data, err)
		}
		if !reflect.DeepEqual(fast, ref) {
			t.Fatalf("decoders differ on %q:\nfast %+v\njson %+v", data, fast, ref)
		}
	})
}

// TestFastDecodeTakesIssuerOutput: what json.Marshal makes of a Document takes the fast path.
func TestFastDecodeTakesIssuerOutput(t *testing.T) {
	for _, d := range []Document{
		{Variant: Variant, Quote: []byte{1}, PCRs: map[uint32][]byte{3: {2}}},
		{Variant: Variant, UserData: []byte("k"), Batch: [][]byte{{1}, {2}}, EventLog: []byte("log")},
	} {
		raw, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := fastDecode(raw)
		if !ok || !reflect.DeepEqual(got, d) {
			t.Fatalf("fast decode of %s = %+v, %v", raw, got, ok)
		}
	}
}
