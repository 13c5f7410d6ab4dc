package backup

import (
	"bytes"
	"crypto/rand"
	"io"
	"testing"
	"time"
)

// BenchmarkSeal and BenchmarkOpen measure sealing and opening a 32 MiB etcd snapshot (MB/s).
func BenchmarkSeal(b *testing.B) {
	keys := testKeys(b, 1)
	data := make([]byte, 32<<20)
	_, _ = rand.Read(data)
	m := Manifest{ClusterID: "c", Taken: time.Now(), KMS: KMSKeysOf(keys, []uint32{1}, 1)}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := Seal(io.Discard, keys, m, bytes.NewReader(data)); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkOpen(b *testing.B) {
	keys := testKeys(b, 1)
	data := make([]byte, 32<<20)
	_, _ = rand.Read(data)
	var sealed bytes.Buffer
	if _, err := Seal(&sealed, keys, Manifest{ClusterID: "c", Taken: time.Now(), KMS: KMSKeysOf(keys, []uint32{1}, 1)}, bytes.NewReader(data)); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		_, r, err := Open(bytes.NewReader(sealed.Bytes()), keys)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, r); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(sealed.Len()-len(data)), "sealing-overhead-bytes")
}
