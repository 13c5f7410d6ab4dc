package server

import (
	"context"
	"errors"
	"sync"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/metadata"
)

type listing struct {
	mu    sync.Mutex
	peers []metadata.Instance
	err   error
}

func (l *listing) Peers(context.Context) ([]metadata.Instance, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.peers, l.err
}

func TestKnownPeers(t *testing.T) {
	l := &listing{peers: []metadata.Instance{{Name: "cp-0", IPs: []string{"198.51.100.10", "2001:db8::10"}}, {Name: "w-0", IPs: []string{"198.51.100.20"}}}}
	k := NewKnownPeers(l, zap.NewNop())
	if k.Known("198.51.100.10") {
		t.Fatal("known before the first listing")
	}
	if err := k.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	for peer, want := range map[string]bool{"198.51.100.10": true, "198.51.100.20": true, "2001:db8:0::10": true, "203.0.113.9": false, "": false, "not an ip": false} {
		if got := k.Known(peer); got != want {
			t.Errorf("Known(%q) = %v, want %v", peer, got, want)
		}
	}
	// A failed listing keeps the last set.
	l.mu.Lock()
	l.err = errors.New("metadata unreachable")
	l.mu.Unlock()
	if err := k.Refresh(context.Background()); err == nil || !k.Known("198.51.100.20") {
		t.Fatalf("Refresh() = %v; the last set must stay", err)
	}
}
