package vtpm

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strconv"

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
	out := make([]byte, base64.StdEncoding.DecodedLen(len(enc)))
	n, err := base64.StdEncoding.Decode(out, enc)
	if err != nil {
		s.ok = false
		return nil
	}
	return out[:n]
}

// pcrs reads null or an object of decimal PCR indices to base64 values.
func (s *docScanner) pcrs() map[uint32][]byte {
	if s.null() {
		return nil
	}
	if !s.lit('{') {
		s.ok = false
		return nil
	}
	m := map[uint32][]byte{}
	if s.lit('}') {
		return m
	}
	for s.ok {
		key := s.str()
		if !s.ok || len(key) == 0 || len(key) > 2 || key[0] == '0' && len(key) > 1 {
			s.ok = false
			return nil
		}
		idx, err := strconv.ParseUint(string(key), 10, 32)
		if _, dup := m[uint32(idx)]; err != nil || dup || !s.lit(':') {
			s.ok = false
			return nil
		}
		m[uint32(idx)] = s.bytesVal()
		if s.lit('}') {
			return m
		}
		s.ok = s.ok && s.lit(',')
	}
	return nil
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

// fastDecode decodes the JSON encoding/json makes of a Document; ok is false for anything else.
func fastDecode(data []byte) (doc Document, ok bool) {
	s := docScanner{b: data, ok: true}
	if !s.lit('{') || s.lit('}') {
		return Document{}, false
	}
	seen := map[string]bool{}
	for s.ok {
		key := string(s.str())
		if !s.ok || seen[key] || !s.lit(':') {
			return Document{}, false
		}
		seen[key] = true
		switch key {
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
		default:
			return Document{}, false
		}
		if s.lit('}') {
			s.ws()
			return doc, s.ok && len(s.b) == 0
		}
		s.ok = s.ok && s.lit(',')
	}
	return Document{}, false
}
