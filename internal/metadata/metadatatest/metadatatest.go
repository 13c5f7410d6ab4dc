// Package metadatatest checks, against a provider's fake, what every cloud metadata provider
// (aws, azure, gcp) promises its callers alike; it also holds the small helpers their tests share.
package metadatatest

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/berth-k8s/berth/internal/metadata"
)

// PeersCached checks that peers, called again within ttl on clk, answers without listing the
// cloud's machines again, and once clk moved past ttl lists them afresh. lists returns how many
// listing requests the provider's fake has answered so far.
func PeersCached(t *testing.T, peers func(context.Context) ([]metadata.Instance, error), lists func() int, clk *testingclock.FakePassiveClock, ttl time.Duration) {
	t.Helper()
	ctx := context.Background()
	if _, err := peers(ctx); err != nil {
		t.Fatal(err)
	}
	before := lists()
	if _, err := peers(ctx); err != nil {
		t.Fatal(err)
	}
	if after := lists(); after != before {
		t.Fatalf("Peers() within the TTL listed again (%d more requests)", after-before)
	}
	clk.SetTime(clk.Now().Add(ttl + time.Second))
	if _, err := peers(ctx); err != nil {
		t.Fatal(err)
	}
	if lists() == before {
		t.Fatal("Peers() after the TTL did not list again")
	}
}

// Provider is what the checks call of a provider.
type Provider interface {
	Self(ctx context.Context) (metadata.Instance, error)
	Peers(ctx context.Context) ([]metadata.Instance, error)
}

// RoleAndCluster checks how a provider reads the machine's own role and cluster tags (labels on
// GCP): without a role, or with an unknown one, Self fails and Peers still answers; without a
// cluster, Self answers and Peers fails. tagged returns a provider whose own machine carries tags.
func RoleAndCluster(t *testing.T, tagged func(t *testing.T, tags map[string]string) Provider) {
	ctx := context.Background()
	for _, tc := range []struct {
		name        string
		tags        map[string]string
		self, peers error
	}{
		{"no role", map[string]string{metadata.KeyCluster: "c1"}, metadata.ErrMissingRole, nil},
		{"unknown role", map[string]string{metadata.KeyCluster: "c1", metadata.KeyRole: "boss"}, metadata.ErrInvalidRole, nil},
		{"no cluster", map[string]string{metadata.KeyRole: "worker"}, nil, metadata.ErrMissingCluster},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tagged(t, tc.tags)
			if _, err := p.Self(ctx); tc.self == nil && err != nil || tc.self != nil && !errors.Is(err, tc.self) {
				t.Errorf("Self() = %v, want %v", err, tc.self)
			}
			if _, err := p.Peers(ctx); tc.peers == nil && err != nil || tc.peers != nil && !errors.Is(err, tc.peers) {
				t.Errorf("Peers() = %v, want %v", err, tc.peers)
			}
		})
	}
}

// Describe renders instances as "name/role/ip,ip" lines, in order, for comparing a provider's
// answer with the fake's machines.
func Describe(in []metadata.Instance) []string {
	var out []string
	for _, i := range in {
		out = append(out, i.Name+"/"+string(i.Role)+"/"+strings.Join(i.IPs, ","))
	}
	return out
}

// Status sends a bare GET for url with header to a provider's fake and returns the response's
// status code: for checking that the fake refuses what the real service refuses.
func Status(t *testing.T, url string, header http.Header) int {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	maps.Copy(req.Header, header)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// TokenRefetchedOnce checks how a provider renews the access token its cloud API wants. call is
// one call of the provider that uses the token, tokens how many tokens the fake has handed out.
// After a first call, the fake lets the token expire (expire): the next call fetches one new token
// and succeeds. Then the fake rejects every token (rejectAll): the call fetches exactly one more and
// fails with metadata.ErrTokenExpired.
func TokenRefetchedOnce(t *testing.T, call func(context.Context) error, tokens func() int, expire, rejectAll func()) {
	t.Helper()
	ctx := context.Background()
	if err := call(ctx); err != nil {
		t.Fatal(err)
	}
	expire()
	if err := call(ctx); err != nil {
		t.Fatalf("call after the token expired = %v, want a new token and success", err)
	}
	if n := tokens(); n != 2 {
		t.Errorf("tokens fetched = %d, want 2", n)
	}
	rejectAll()
	if err := call(ctx); !errors.Is(err, metadata.ErrTokenExpired) {
		t.Fatalf("call with every token rejected = %v, want ErrTokenExpired", err)
	}
	if n := tokens(); n != 3 {
		t.Errorf("tokens fetched = %d, want 3 (exactly one refetch)", n)
	}
}
