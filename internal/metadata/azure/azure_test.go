package azure

import (
	"context"
	"encoding/hex"
	"errors"
	"net"
	"net/http"
	"slices"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/azure/azuretest"
	"github.com/berth-k8s/berth/internal/metadata/metadatatest"
)

// start returns a provider reading f, with the SDK's retries off.
func start(t *testing.T, f *azuretest.Fake, cfg Config) *Provider {
	t.Helper()
	cfg.IMDSURL, cfg.ARMEndpoint, cfg.HTTPClient = f.IMDSURL, f.ARMURL, f.Client
	if cfg.MaxRetries == 0 {
		cfg.MaxRetries = -1
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestProvider(t *testing.T) {
	f := azuretest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	ctx := context.Background()

	self, err := p.Self(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if self.Name != "cp-0" || self.Role != metadata.RoleControlPlane || !slices.Equal(self.IPs, []string{"10.0.0.4", "10.0.0.14"}) {
		t.Fatalf("Self() = %+v", self)
	}
	peers, err := p.Peers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// w-1 failed provisioning, w-2 has no role, other-0 is of another cluster.
	want := []string{"cp-0/control-plane/10.0.0.4,10.0.0.14", "cp-1/control-plane/10.0.0.5", "w-0/worker/10.0.0.6"}
	if got := metadatatest.Describe(peers); !slices.Equal(got, want) {
		t.Fatalf("Peers() = %v, want %v", got, want)
	}
	var vmPages, nicPages, tokens int
	f.Read(func(f *azuretest.Fake) {
		vmPages, nicPages, tokens = f.VMListRequests, f.NICListRequests, f.TokenRequests
	})
	if vmPages != 3 || nicPages != 3 { // 6 VMs and 6 NICs, 2 per page
		t.Errorf("list pages = %d VMs, %d NICs, want 3 each (nextLink pagination)", vmPages, nicPages)
	}
	if tokens != 1 {
		t.Errorf("token requests = %d, want 1", tokens)
	}
	ep, err := p.ControlPlaneEndpoint(ctx)
	if err != nil || ep != azuretest.Endpoint {
		t.Fatalf("ControlPlaneEndpoint() = %q, %v", ep, err)
	}
	h, err := p.InitSecretHash(ctx)
	if err != nil || hex.EncodeToString(h) != azuretest.InitSecretHash {
		t.Fatalf("InitSecretHash() = %x, %v", h, err)
	}
	if _, err := p.Peers(ctx); err != nil {
		t.Fatal(err)
	}
	f.Read(func(f *azuretest.Fake) { tokens = f.TokenRequests })
	if tokens != 1 {
		t.Errorf("token requests after a second listing = %d, want 1 (the token is reused)", tokens)
	}

	f.Update(func(f *azuretest.Fake) { f.Self = "w-0" })
	if self, err := p.Self(ctx); err != nil || self.Role != metadata.RoleWorker {
		t.Fatalf("Self() on w-0 = %+v, %v", self, err)
	}
	if _, err := p.ControlPlaneEndpoint(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("ControlPlaneEndpoint() without tag = %v, want ErrNotFound", err)
	}
	if _, err := p.InitSecretHash(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("InitSecretHash() without tag = %v, want ErrNotFound", err)
	}
}

func TestExpiredToken(t *testing.T) {
	f := azuretest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	// An expired token: ARM answers 401, and the provider fetches a fresh one.
	metadatatest.TokenRefetchedOnce(t,
		func(ctx context.Context) error { _, err := p.Peers(ctx); return err },
		func() (n int) { f.Read(func(f *azuretest.Fake) { n = f.TokenRequests }); return n },
		func() { f.Update(func(f *azuretest.Fake) { f.ExpireTokens() }) },
		func() { f.Update(func(f *azuretest.Fake) { f.RejectTokens = true }) })
}

func TestRoleAndCluster(t *testing.T) {
	metadatatest.RoleAndCluster(t, func(t *testing.T, tags map[string]string) metadatatest.Provider {
		f := azuretest.New(t)
		f.VMs[0].Tags = tags
		return start(t, f, Config{})
	})
}

func TestThrottled(t *testing.T) {
	ctx := context.Background()
	f := azuretest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	f.Update(func(f *azuretest.Fake) { f.ARMStatus = http.StatusTooManyRequests })
	if _, err := p.Peers(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Peers() on ARM 429 = %v, want ErrThrottled", err)
	}
	f.Update(func(f *azuretest.Fake) { f.ARMStatus = http.StatusInternalServerError })
	if _, err := p.Peers(ctx); err == nil || errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Peers() on ARM 500 = %v, want an error that is not ErrThrottled", err)
	}
	f.Update(func(f *azuretest.Fake) { f.ARMStatus, f.IMDSStatus = 0, http.StatusTooManyRequests })
	if _, err := p.Self(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on IMDS 429 = %v, want ErrThrottled", err)
	}
}

func TestThrottledRetried(t *testing.T) {
	f := azuretest.New(t)
	// With the SDK's retries on, a 429 is retried after Retry-After (1 s) before the error.
	p := start(t, f, Config{PeersTTL: -1, MaxRetries: 1})
	if _, err := p.Peers(context.Background()); err != nil {
		t.Fatal(err)
	}
	var before, after int
	f.Read(func(f *azuretest.Fake) { before = f.ARMRequests })
	f.Update(func(f *azuretest.Fake) { f.ARMStatus = http.StatusTooManyRequests })
	if _, err := p.Peers(context.Background()); !errors.Is(err, metadata.ErrThrottled) {
		t.Fatalf("Peers() on 429 = %v, want ErrThrottled", err)
	}
	f.Read(func(f *azuretest.Fake) { after = f.ARMRequests })
	if after-before != 2 {
		t.Errorf("ARM requests for one throttled listing = %d, want 2 (one retry)", after-before)
	}
}

// The fake checks what IMDS checks; the provider passes those checks (TestProvider), and this shows
// the checks are there.
func TestIMDSHeaders(t *testing.T) {
	f := azuretest.New(t)
	for _, tc := range []struct {
		name, query string
		header      bool
	}{
		{"no Metadata header", "?api-version=2021-02-01", false},
		{"no api-version", "", true},
	} {
		var header http.Header
		if tc.header {
			header = http.Header{"Metadata": {"true"}}
		}
		if code := metadatatest.Status(t, f.IMDSURL+"/metadata/instance"+tc.query, header); code != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400", tc.name, code)
		}
	}
}

func TestARMNeedsTLS(t *testing.T) {
	if _, err := New(Config{ARMEndpoint: "http://127.0.0.1:1"}); err == nil {
		t.Fatal("New() with an http ARM endpoint = nil error; tokens must not travel in the clear")
	}
	if _, err := New(Config{IMDSURL: "169.254.169.254"}); err == nil {
		t.Fatal("New() with an IMDS URL without scheme = nil error")
	}
}

func TestUnreachable(t *testing.T) {
	var lc net.ListenConfig
	lis, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close()
	p, err := New(Config{IMDSURL: "http://" + addr})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Self(context.Background()); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Self() without IMDS = %v, want ErrUnreachable", err)
	}
}

func TestPeersCached(t *testing.T) {
	f := azuretest.New(t)
	clk := testingclock.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	p := start(t, f, Config{PeersTTL: 10 * time.Second, Clock: clk})
	lists := func() (n int) {
		f.Read(func(f *azuretest.Fake) { n = f.VMListRequests })
		return n
	}
	metadatatest.PeersCached(t, p.Peers, lists, clk, 10*time.Second)
}
