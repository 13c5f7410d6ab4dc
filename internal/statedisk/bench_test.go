package statedisk

import (
	"context"
	"testing"
)

// The fscrypt backend's costs on a default-size (2 GiB, sparse) image:
//
//	go test -run '^$' -bench Fscrypt -benchtime 20x ./internal/statedisk/

func BenchmarkFscryptFormat(b *testing.B) {
	ctx := context.Background()
	d := newTestFscrypt(b, WithImageSize(DefaultImageSize))
	key := randomKey(b)
	for b.Loop() {
		if _, err := d.Format(ctx, key); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFscryptOpenClose is one Open (mount, unwrap, add key) and one Close (remove key,
// unmount).
func BenchmarkFscryptOpenClose(b *testing.B) {
	ctx := context.Background()
	d := newTestFscrypt(b, WithImageSize(DefaultImageSize))
	key := randomKey(b)
	if _, err := d.Format(ctx, key); err != nil {
		b.Fatal(err)
	}
	if err := d.Close(ctx); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := d.Open(ctx, key); err != nil {
			b.Fatal(err)
		}
		if err := d.Close(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFscryptRekey re-keys an open disk back and forth (unwrap, wrap, atomic header write).
func BenchmarkFscryptRekey(b *testing.B) {
	ctx := context.Background()
	d := newTestFscrypt(b, WithImageSize(DefaultImageSize))
	keys := [2][]byte{randomKey(b), randomKey(b)}
	if _, err := d.Format(ctx, keys[0]); err != nil {
		b.Fatal(err)
	}
	i := 0
	for b.Loop() {
		if err := d.Rekey(ctx, keys[i%2], keys[(i+1)%2]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
