package tdx

import (
	"crypto/sha512"
	"encoding/binary"
	"errors"
	"fmt"
)

// Document format, version 1. An attestation document is the bytes
//
//	offset  size  field
//	0       4     magic "BTDX"
//	4       2     format version, big endian (1)
//	6       4     n = length of user data, big endian (at most MaxUserDataSize)
//	10      n     user data
//	10+n    4     m = length of the quote, big endian (at most 64 KiB)
//	14+n    m     the TDX quote as the platform produced it
//
// with nothing after the quote. The nonce is not in the document: the validator supplies the one it expects. The
// quote's REPORTDATA is ReportData(userData, nonce). A later format version changes the version field; parsers
// reject versions they do not know.
const (
	documentMagic   = "BTDX"
	documentVersion = 1
	// MaxUserDataSize bounds the user data in a document.
	MaxUserDataSize = 4096
	// MaxNonceSize bounds the nonce bound into report data.
	MaxNonceSize = 4096
)

// reportDataDomain separates Berth's TDX report data from any other use of SHA-512.
const reportDataDomain = "berth tdx report data v1\x00"

// ReportData returns the 64-byte REPORTDATA that binds userData and nonce:
// SHA-512(domain || len(userData) || userData || len(nonce) || nonce) with 32-bit big-endian lengths, so that no
// two (userData, nonce) pairs share an encoding.
func ReportData(userData, nonce []byte) [ReportDataSize]byte {
	h := sha512.New()
	h.Write([]byte(reportDataDomain))
	var l [4]byte
	binary.BigEndian.PutUint32(l[:], uint32(len(userData)))
	h.Write(l[:])
	h.Write(userData)
	binary.BigEndian.PutUint32(l[:], uint32(len(nonce)))
	h.Write(l[:])
	h.Write(nonce)
	var out [ReportDataSize]byte
	copy(out[:], h.Sum(nil))
	return out
}

// Document is a decoded attestation document.
type Document struct {
	UserData []byte
	Quote    []byte
}

// Marshal encodes the document in format version 1.
func (d *Document) Marshal() ([]byte, error) {
	if len(d.UserData) > MaxUserDataSize {
		return nil, fmt.Errorf("encoding document: user data of %d bytes exceeds %d", len(d.UserData), MaxUserDataSize)
	}
	if len(d.Quote) > maxQuoteSize {
		return nil, fmt.Errorf("encoding document: quote of %d bytes exceeds %d", len(d.Quote), maxQuoteSize)
	}
	out := make([]byte, 0, 14+len(d.UserData)+len(d.Quote))
	out = append(out, documentMagic...)
	out = binary.BigEndian.AppendUint16(out, documentVersion)
	out = binary.BigEndian.AppendUint32(out, uint32(len(d.UserData)))
	out = append(out, d.UserData...)
	out = binary.BigEndian.AppendUint32(out, uint32(len(d.Quote)))
	out = append(out, d.Quote...)
	return out, nil
}

// errDocument is the cause of every structural document error.
var errDocument = errors.New("invalid TDX attestation document")

// ParseDocument decodes an attestation document. It checks the envelope only, not the quote inside.
func ParseDocument(b []byte) (*Document, error) {
	if len(b) < 10 || string(b[:4]) != documentMagic {
		return nil, fmt.Errorf("decoding document header: %w", errDocument)
	}
	if v := binary.BigEndian.Uint16(b[4:6]); v != documentVersion {
		return nil, fmt.Errorf("decoding document: format version %d, want %d: %w", v, documentVersion, errDocument)
	}
	rest := b[6:]
	userData, rest, err := lengthPrefixed(rest, MaxUserDataSize, "user data")
	if err != nil {
		return nil, err
	}
	quote, rest, err := lengthPrefixed(rest, maxQuoteSize, "quote")
	if err != nil {
		return nil, err
	}
	if len(rest) != 0 {
		return nil, fmt.Errorf("decoding document: %d bytes after the quote: %w", len(rest), errDocument)
	}
	return &Document{UserData: userData, Quote: quote}, nil
}

func lengthPrefixed(b []byte, limit int, field string) (value, rest []byte, err error) {
	if len(b) < 4 {
		return nil, nil, fmt.Errorf("decoding document %s length: %w", field, errDocument)
	}
	n := binary.BigEndian.Uint32(b[:4])
	if uint64(n) > uint64(limit) || uint64(n) > uint64(len(b)-4) {
		return nil, nil, fmt.Errorf("decoding document %s: length %d exceeds the limit or the document: %w", field, n, errDocument)
	}
	return b[4 : 4+n], b[4+n:], nil
}
