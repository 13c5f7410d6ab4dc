package vtpm

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Documents are JSON as encoding/json writes them. Decoding them with encoding/json (reflection, a
// validity scan, then the decode) was a third of a repeat validation; fastDecode reads exactly that
// form in one pass. Anything it does not expect (escapes, other key spellings, duplicate keys,
// non-ASCII text, numbers, nesting) makes it give up, and encoding/json decodes the input as before:
// the fast path only decides faster, never differently (FuzzDocumentDecoders compares them).

// decodeDocument decodes a document's JSON: the fast path, else encoding/json with unknown fields
// refused and nothing after the object.
func decodeDocument(data []byte) (Document, error) {
	if doc, ok := fastDecode(data); ok {
		return doc, nil
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var doc Document
	if err := dec.Decode(&doc); err != nil {
		return Document{}, fmt.Errorf("%w: decoding: %w", attestation.ErrMalformed, err)
	}
	if dec.More() {
		return Document{}, fmt.Errorf("%w: trailing data", attestation.ErrMalformed)
	}
	return doc, nil
}

// docScanner reads the JSON of a Document; ok turns false at the first surprise.
type docScanner struct {
	b  []byte
	ok bool
}

func (s *docScanner) ws() {
	for len(s.b) > 0 && (s.b[0] == ' ' || s.b[0] == '\t' || s.b[0] == '\n' || s.b[0] == '\r') {
		s.b = s.b[1:]
	}
}

// lit consumes c (after whitespace).
func (s *docScanner) lit(c byte) bool {
	s.ws()
	if len(s.b) > 0 && s.b[0] == c {
		s.b = s.b[1:]
		return true
	}
	return false
}

// null consumes the literal null (after whitespace).
func (s *docScanner) null() bool {
	s.ws()
	if bytes.HasPrefix(s.b, []byte("null")) {
		s.b = s.b[4:]
		return true
	}
	return false
}

// str reads a string of printable ASCII without escapes and returns its contents.
func (s *docScanner) str() []byte {
	if !s.lit('"') {
		s.ok = false
		return nil
	}
	for i, c := range s.b {
		switch {
		case c == '"':
			out := s.b[:i]
			s.b = s.b[i+1:]
			return out
		case c == '\\' || c < 0x20 || c >= 0x80:
			s.ok = false
			return nil
		}
	}
	s.ok = false
	return nil
}

// bytesVal reads null (nil) or a base64 string, as encoding/json decodes a []byte.
func (s *docScanner) bytesVal() []byte {
	if s.null() {
		return nil
	}
	enc := s.str()
	if !s.ok {
		return nil
	}
	return s.decode(enc)
}

// decode decodes base64 text into a new array.
func (s *docScanner) decode(enc []byte) []byte {
	out := make([]byte, base64.StdEncoding.DecodedLen(len(enc)))
	n, err := base64.StdEncoding.Decode(out, enc)
	if err != nil {
		s.ok = false
		return nil
	}
	return out[:n]
}

// pcrs reads null or an object of decimal PCR indices to base64 values. The values share one
// backing array (each capped to its own bytes): a document carries 24 of them.
func (s *docScanner) pcrs() map[uint32][]byte {
	if s.null() {
		return nil
	}
	if !s.lit('{') {
		s.ok = false
		return nil
	}
	m := make(map[uint32][]byte, 24)
	if s.lit('}') {
		return m
	}
	vals := make([]byte, 0, 24*sha256.Size)
	for s.ok {
		key := s.str()
		if !s.ok || len(key) == 0 || len(key) > 2 || key[0] == '0' && len(key) > 1 {
			s.ok = false
			return nil
		}
		idx := uint32(0)
		for _, c := range key {
			if c < '0' || c > '9' {
				s.ok = false
				return nil
			}
			idx = idx*10 + uint32(c-'0')
		}
		if _, dup := m[idx]; dup || !s.lit(':') {
			s.ok = false
			return nil
		}
		var v []byte
		v, vals = s.bytesInto(vals)
		m[idx] = v
		if s.lit('}') {
			return m
		}
		s.ok = s.ok && s.lit(',')
	}
	return nil
}

// bytesInto is bytesVal decoding into buf's spare capacity when it fits (else into a new array); it
// returns the value, capped, and buf grown by it.
func (s *docScanner) bytesInto(buf []byte) (val, grown []byte) {
	if s.null() {
		return nil, buf
	}
	enc := s.str()
	if !s.ok {
		return nil, buf
	}
	n := base64.StdEncoding.DecodedLen(len(enc))
	if cap(buf)-len(buf) < n {
		return s.decode(enc), buf
	}
	out := buf[len(buf) : len(buf)+n]
	m, err := base64.StdEncoding.Decode(out, enc)
	if err != nil {
		s.ok = false
		return nil, buf
	}
	return out[:m:m], buf[:len(buf)+m]
}

// batch reads null or an array of base64 strings.
func (s *docScanner) batch() [][]byte {
	if s.null() {
		return nil
	}
	if !s.lit('[') {
		s.ok = false
		return nil
	}
	out := [][]byte{}
	if s.lit(']') {
		return out
	}
	for s.ok {
		out = append(out, s.bytesVal())
		if s.lit(']') {
			return out
		}
		s.ok = s.ok && s.lit(',')
	}
	return nil
}

// docKeys are the keys of a Document's JSON, in the order of the bits fastDecode marks them seen with.
var docKeys = [...]string{"variant", "userData", "ekCert", "ekPublic", "akPublic", "akCreationData", "akCertifyInfo",
	"akCertifySignature", "akCert", "quote", "quoteSignature", "pcrs", "eventLog", "batch"}

// fastDecode decodes the JSON encoding/json makes of a Document; ok is false for anything else.
func fastDecode(data []byte) (doc Document, ok bool) {
	s := docScanner{b: data, ok: true}
	if !s.lit('{') || s.lit('}') {
		return Document{}, false
	}
	var seen uint16 // bit i: docKeys[i]
	for s.ok {
		key := s.str()
		if !s.ok || !s.lit(':') {
			return Document{}, false
		}
		k := slices.Index(docKeys[:], string(key)) // no allocation: the conversion does not escape
		if k < 0 || seen&(1<<k) != 0 {
			return Document{}, false
		}
		seen |= 1 << k
		switch docKeys[k] {
		case "variant":
			doc.Variant = string(s.str())
		case "userData":
			doc.UserData = s.bytesVal()
		case "ekCert":
			doc.EKCert = s.bytesVal()
		case "ekPublic":
			doc.EKPublic = s.bytesVal()
		case "akPublic":
			doc.AKPublic = s.bytesVal()
		case "akCreationData":
			doc.AKCreationData = s.bytesVal()
		case "akCertifyInfo":
			doc.AKCertifyInfo = s.bytesVal()
		case "akCertifySignature":
			doc.AKCertifySignature = s.bytesVal()
		case "akCert":
			doc.AKCert = s.bytesVal()
		case "quote":
			doc.Quote = s.bytesVal()
		case "quoteSignature":
			doc.QuoteSignature = s.bytesVal()
		case "pcrs":
			doc.PCRs = s.pcrs()
		case "eventLog":
			doc.EventLog = s.bytesVal()
		case "batch":
			doc.Batch = s.batch()
		}
		if s.lit('}') {
			s.ws()
			return doc, s.ok && len(s.b) == 0
		}
		s.ok = s.ok && s.lit(',')
	}
	return Document{}, false
}
