// Package backuptest checks a sealed snapshot for a canary value: the encodings in which a Secret's
// value could appear in a snapshot's bytes, shared by the backup package's tests and the e2e restore
// drill.
package backuptest

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"slices"
)

// Encodings are the forms in which a Secret's value could appear in a snapshot: as it is, in base64
// (a Secret's data in JSON, standard and URL alphabets), and so in the protobuf etcd stores when
// nothing encrypts it.
func Encodings(value string) map[string][]byte {
	v := []byte(value)
	return map[string][]byte{
		"plain":            v,
		"base64":           []byte(base64.StdEncoding.EncodeToString(v)),
		"base64 (raw URL)": []byte(base64.RawURLEncoding.EncodeToString(v)),
		"base64 (raw)":     []byte(base64.RawStdEncoding.EncodeToString(v)),
		"hex":              []byte(hex.EncodeToString(v)),
	}
}

// Leaks returns the names of the encodings of value that data contains, sorted; none for a
// snapshot that shows nothing of it.
func Leaks(data []byte, value string) []string {
	var found []string
	for name, enc := range Encodings(value) {
		if bytes.Contains(data, enc) {
			found = append(found, name)
		}
	}
	slices.Sort(found)
	return found
}
