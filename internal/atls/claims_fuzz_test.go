package atls

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// FuzzClaims checks that decoding untrusted claims and verdicts never panics, that well-formed claims
// survive a round trip, and that a verdict's text stays short and printable.
func FuzzClaims(f *testing.F) {
	f.Add([]byte{4, 2, 0xaa, 0xbb, 15, 1, 7}, []byte{0x30, 0x00}, "attestation refused on claimed measurements: X: y")
	f.Fuzz(func(t *testing.T, claims, verdict []byte, text string) {
		if m, err := decodeClaims(claims); err == nil {
			again, err := encodeClaims(m)
			if err != nil {
				t.Fatalf("re-encoding decoded claims: %v", err)
			}
			back, err := decodeClaims(again)
			if err != nil || len(back) != len(m) {
				t.Fatalf("round trip: %v, %d of %d", err, len(back), len(m))
			}
			for i, v := range m {
				if !bytes.Equal(back[i], v) {
					t.Fatalf("measurement %d changed in a round trip", i)
				}
			}
		}
		var r *Rejection
		errors.As(parseRejection(verdict), &r)
		if r != nil && (len(r.Reason) > maxReasonLen || len(r.Message) > maxShownRejectionMsg || strings.ContainsAny(r.Message, "\n\r\x00")) {
			t.Fatalf("verdict not bounded or not printable: %q", r.Message)
		}
		if p, ok := ParseRejection(text); ok && (p.Reason == "" || strings.Trim(p.Reason, "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != "") {
			t.Fatalf("parsed reason %q", p.Reason)
		}
	})
}
