package gcp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/api/option"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/gcp/gcptest"
	"github.com/berth-k8s/berth/internal/metadata/metadatatest"
)

// start returns a provider reading f.
func start(t *testing.T, f *gcptest.Fake, cfg Config) *Provider {
	t.Helper()
	cfg.MetadataURL = f.MetadataURL
	cfg.ComputeEndpoint = f.ComputeURL
	p, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func lists(f *gcptest.Fake) (n int) {
	f.Read(func(f *gcptest.Fake) { n = f.ListRequests })
	return n
}

func TestProvider(t *testing.T) {
	f := gcptest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	ctx := context.Background()

	self, err := p.Self(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if self.Name != "cp-0" || self.Role != metadata.RoleControlPlane || !slices.Equal(self.IPs, []string{"10.0.0.2"}) {
		t.Fatalf("Self() = %+v", self)
	}
	peers, err := p.Peers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// w-1 is TERMINATED, w-2 has no role, other-0 is of another cluster.
	want := []string{"cp-0/control-plane/10.0.0.2", "cp-1/control-plane/10.0.0.3", "w-0/worker/10.0.0.4"}
	if got := metadatatest.Describe(peers); !slices.Equal(got, want) {
		t.Fatalf("Peers() = %v, want %v", got, want)
	}
	if lists(f) != 3 { // 5 matching instances, 2 per page
		t.Errorf("aggregatedList requests = %d, want 3 (pagination)", lists(f))
	}
	ep, err := p.ControlPlaneEndpoint(ctx)
	if err != nil || ep != "10.0.0.100:6443" {
		t.Fatalf("ControlPlaneEndpoint() = %q, %v", ep, err)
	}
	h, err := p.InitSecretHash(ctx)
	if err != nil || fmt.Sprintf("%x", h) != gcptest.InitSecretHash {
		t.Fatalf("InitSecretHash() = %x, %v", h, err)
	}

	// The worker's view.
	f.Update(func(f *gcptest.Fake) { f.Self = "w-0" })
	if self, err := p.Self(ctx); err != nil || self.Role != metadata.RoleWorker {
		t.Fatalf("Self() on w-0 = %+v, %v", self, err)
	}
}

func TestAttributes(t *testing.T) {
	f := gcptest.New(t)
	p := start(t, f, Config{})
	ctx := context.Background()
	f.Update(func(f *gcptest.Fake) { f.Attributes = map[string]string{} })
	if _, err := p.ControlPlaneEndpoint(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("ControlPlaneEndpoint() without attribute = %v, want ErrNotFound", err)
	}
	if _, err := p.InitSecretHash(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("InitSecretHash() without attribute = %v, want ErrNotFound", err)
	}
	f.Update(func(f *gcptest.Fake) {
		f.Attributes = map[string]string{"berth-control-plane-endpoint": "10.0.0.100", "berth-init-secret-hash": "abc"}
	})
	if _, err := p.ControlPlaneEndpoint(ctx); err == nil || !strings.Contains(err.Error(), "HOST:PORT") {
		t.Errorf("ControlPlaneEndpoint() without port = %v, want a HOST:PORT error", err)
	}
	if _, err := p.InitSecretHash(ctx); err == nil || errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("InitSecretHash() of a short value = %v, want a parse error", err)
	}
}

func TestRoleAndClusterLabels(t *testing.T) {
	metadatatest.RoleAndCluster(t, func(t *testing.T, tags map[string]string) metadatatest.Provider {
		f := gcptest.New(t)
		f.Instances[0].Labels = tags
		return start(t, f, Config{})
	})
}

func TestThrottled(t *testing.T) {
	ctx := context.Background()
	f := gcptest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	f.Update(func(f *gcptest.Fake) { f.APIStatus = http.StatusTooManyRequests })
	if _, err := p.Peers(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Peers() on 429 = %v, want ErrThrottled", err)
	}
	if _, err := p.Self(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on 429 = %v, want ErrThrottled", err)
	}
	f.Update(func(f *gcptest.Fake) { f.APIStatus = http.StatusInternalServerError })
	if _, err := p.Self(ctx); err == nil || errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on 500 = %v, want an error that is not ErrThrottled", err)
	}
	// The metadata server's 429 (the client retries it a few times first).
	f.Update(func(f *gcptest.Fake) { f.APIStatus, f.MetadataStatus = 0, http.StatusTooManyRequests })
	if _, err := p.InitSecretHash(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("InitSecretHash() on metadata 429 = %v, want ErrThrottled", err)
	}
}

func TestUnreachable(t *testing.T) {
	var lc net.ListenConfig
	lis, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close() // nothing listens there any more: connections are refused
	p, err := New(context.Background(), Config{
		MetadataURL:   "http://" + addr,
		ClientOptions: []option.ClientOption{option.WithoutAuthentication()},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Self(context.Background()); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Self() without a metadata server = %v, want ErrUnreachable", err)
	}
}

func TestServiceAccountToken(t *testing.T) {
	f := gcptest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	ctx := context.Background()
	for range 3 {
		if _, err := p.Peers(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	f.Read(func(f *gcptest.Fake) { n = f.TokenRequests })
	if n != 1 {
		t.Errorf("token requests = %d, want 1 (the token is reused until it expires)", n)
	}
	// The Compute API no longer accepts the token (revoked, or expired early).
	f.Update(func(f *gcptest.Fake) { f.RevokeTokens() })
	if _, err := p.Peers(ctx); !errors.Is(err, metadata.ErrTokenExpired) {
		t.Errorf("Peers() with a rejected token = %v, want ErrTokenExpired", err)
	}
	// Without authentication the fake refuses: the token above is what made the calls pass.
	q := start(t, f, Config{ClientOptions: []option.ClientOption{option.WithoutAuthentication()}})
	if _, err := q.Self(ctx); !errors.Is(err, metadata.ErrTokenExpired) {
		t.Errorf("Self() without a token = %v, want a 401", err)
	}
}

func TestMetadataFlavorRequired(t *testing.T) {
	f := gcptest.New(t)
	if code := metadatatest.Status(t, f.MetadataURL+"/computeMetadata/v1/instance/name", nil); code != http.StatusForbidden {
		t.Fatalf("metadata request without Metadata-Flavor: status %d, want 403 (the fake must check what the real server checks)", code)
	}
}

func TestPeersCached(t *testing.T) {
	f := gcptest.New(t)
	clk := testingclock.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	p := start(t, f, Config{PeersTTL: 10 * time.Second, Clock: clk})
	ctx := context.Background()
	first, err := p.Peers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	requests := lists(f)
	f.Update(func(f *gcptest.Fake) { f.Instances[2].Status = "STOPPING" })
	again, err := p.Peers(ctx)
	if err != nil || lists(f) != requests || !slices.Equal(metadatatest.Describe(first), metadatatest.Describe(again)) {
		t.Fatalf("Peers() within the TTL listed again (%d -> %d requests) or changed: %v, %v", requests, lists(f), metadatatest.Describe(again), err)
	}
	clk.SetTime(clk.Now().Add(11 * time.Second))
	later, err := p.Peers(ctx)
	if err != nil || lists(f) == requests || len(later) != len(first)-1 {
		t.Fatalf("Peers() after the TTL = %v, %v (%d requests); want a fresh listing without w-0", metadatatest.Describe(later), err, lists(f))
	}
}

func TestRedirectKeepsPath(t *testing.T) {
	var got bytes.Buffer
	ts := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { got.WriteString(r.URL.Path) }))
	t.Cleanup(ts.Close)
	p, err := New(context.Background(), Config{MetadataURL: ts.URL + "/prefix", ClientOptions: []option.ClientOption{option.WithoutAuthentication()}})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = p.md.GetWithContext(context.Background(), "instance/name")
	if got.String() != "/prefix/computeMetadata/v1/instance/name" {
		t.Fatalf("request path = %q", got.String())
	}
	if _, err := New(context.Background(), Config{MetadataURL: "169.254.169.254"}); err == nil {
		t.Fatal("New() with a metadata URL without scheme = nil error")
	}
}
