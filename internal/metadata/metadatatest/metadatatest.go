// Package metadatatest checks, against a provider's fake, what every cloud metadata provider
// (aws, azure, gcp) promises its callers alike.
package metadatatest

import (
	"context"
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
