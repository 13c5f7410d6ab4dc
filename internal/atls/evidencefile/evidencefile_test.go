package evidencefile

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/attestation"
)

func TestWriteRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "cp1.evidence")
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := Write(path, "198.51.100.10:9000", []byte("cert"), []byte("nonce"), at); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("evidence file: %v, %v; want mode 0600", fi, err)
	}
	ev, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if ev.Version != Version || ev.Endpoint != "198.51.100.10:9000" || !ev.CapturedAt.Equal(at) ||
		!bytes.Equal(ev.Certificate, []byte("cert")) || !bytes.Equal(ev.Nonce, []byte("nonce")) {
		t.Errorf("Read() = %+v", ev)
	}
}

func TestReadRefuses(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct {
		content   string
		malformed bool
	}{
		"not JSON":       {"evidence", true},
		"other version":  {`{"version": 2, "nonce": "AQ==", "certificate": "AQ=="}`, true},
		"no certificate": {`{"version": 1, "nonce": "AQ=="}`, true},
		"no nonce":       {`{"version": 1, "certificate": "AQ=="}`, true},
		"too large":      {strings.Repeat(" ", MaxSize+1), false},
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := Read(path)
		if err == nil || errors.Is(err, attestation.ErrMalformed) != tc.malformed {
			t.Errorf("%s: Read() = %v, want an error (malformed: %v)", name, err, tc.malformed)
		}
	}
	if _, err := Read(filepath.Join(dir, "missing")); err == nil {
		t.Error("Read() of a missing file = nil error")
	}
}
