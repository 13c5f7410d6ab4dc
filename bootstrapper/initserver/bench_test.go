package initserver

import (
	"context"
	"testing"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
)

// BenchmarkInitRejected measures what a caller without the init secret costs the node: one
// streaming RPC over loopback that ends in PERMISSION_DENIED (hash lookup, SHA-256, constant-time
// compare). Run: go test -run '^$' -bench InitRejected ./bootstrapper/initserver/
func BenchmarkInitRejected(b *testing.B) {
	// Unlimited: the benchmark measures the check, not the rate limit in front of it.
	h := newHarness(b, &fakeInit{}, WithLimits(atls.Limits{PerPeer: rate.Inf, Global: rate.Inf}))
	req := request(1)
	req.InitSecret = []byte("wrong")
	b.ResetTimer()
	for range b.N {
		stream, err := h.client.Init(context.Background(), req)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := stream.Recv(); status.Code(err) != codes.PermissionDenied {
			b.Fatalf("Recv() = %v", err)
		}
	}
}
