package aws

import (
	"context"
	"encoding/hex"
	"errors"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/aws/awstest"
	"github.com/berth-k8s/berth/internal/metadata/metadatatest"
)

// start returns a provider reading f, with the EC2 SDK's retries off. Credentials come from the
// instance profile (IMDS) unless cfg has some.
func start(t *testing.T, f *awstest.Fake, cfg Config) *Provider {
	t.Helper()
	cfg.IMDSEndpoint, cfg.EC2Endpoint = f.IMDSURL, f.EC2URL
	cfg.EC2Attempts = 1
	return New(cfg)
}

func TestProvider(t *testing.T) {
	f := awstest.New(t)
	p := start(t, f, Config{PeersTTL: -1})
	ctx := context.Background()

	self, err := p.Self(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Named and addressed as its peers see it: private DNS name, primary address first.
	if self.Name != "ip-10-0-0-2.eu-central-1.compute.internal" || self.Role != metadata.RoleControlPlane || !slices.Equal(self.IPs, []string{"10.0.0.2", "10.0.8.2"}) {
		t.Fatalf("Self() = %+v", self)
	}
	var before int
	f.Read(func(f *awstest.Fake) { before = f.Describes })
	peers, err := p.Peers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"ip-10-0-0-2.eu-central-1.compute.internal/control-plane/10.0.0.2,10.0.8.2",
		"ip-10-0-0-3.eu-central-1.compute.internal/control-plane/10.0.0.3",
		"ip-10-0-0-4.eu-central-1.compute.internal/worker/10.0.0.4",
	}
	if got := metadatatest.Describe(peers); !slices.Equal(got, want) {
		t.Fatalf("Peers() = %v, want %v", got, want)
	}
	var describes int
	var filters map[string][]string
	f.Read(func(f *awstest.Fake) { describes, filters = f.Describes, f.LastFilters })
	// Peers: one DescribeInstances for this instance, then 4 matching instances (w-2 has no role) at 2 per page.
	if describes-before != 3 {
		t.Errorf("DescribeInstances calls for Peers() = %d, want 3 (self + 2 pages)", describes-before)
	}
	if !slices.Equal(filters["tag:berth-cluster"], []string{"c1"}) || !slices.Equal(filters["instance-state-name"], []string{"running"}) {
		t.Errorf("DescribeInstances filters = %v", filters)
	}
	ep, err := p.ControlPlaneEndpoint(ctx)
	if err != nil || ep != awstest.Endpoint {
		t.Fatalf("ControlPlaneEndpoint() = %q, %v", ep, err)
	}
	h, err := p.InitSecretHash(ctx)
	if err != nil || hex.EncodeToString(h) != awstest.InitSecretHash {
		t.Fatalf("InitSecretHash() = %x, %v", h, err)
	}
	var puts int
	f.Read(func(f *awstest.Fake) { puts = f.TokenPuts })
	if puts != 1 {
		t.Errorf("token PUTs = %d, want 1 (the token is reused until it expires)", puts)
	}

	f.Update(func(f *awstest.Fake) { f.Self = "i-0w0" })
	if _, err := p.ControlPlaneEndpoint(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("ControlPlaneEndpoint() without tag = %v, want ErrNotFound", err)
	}
	if _, err := p.InitSecretHash(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("InitSecretHash() without tag = %v, want ErrNotFound", err)
	}
}

func TestTokenExpiry(t *testing.T) {
	f := awstest.New(t)
	p := start(t, f, Config{})
	metadatatest.TokenRefetchedOnce(t,
		func(ctx context.Context) error { _, err := p.Self(ctx); return err },
		func() (n int) { f.Read(func(f *awstest.Fake) { n = f.TokenPuts }); return n },
		func() { f.Update(func(f *awstest.Fake) { f.ExpireOnce = true }) },
		func() { f.Update(func(f *awstest.Fake) { f.RejectAll = true }) })
}

func TestIMDSRequiresToken(t *testing.T) {
	f := awstest.New(t)
	if code := metadatatest.Status(t, f.IMDSURL+"/latest/meta-data/instance-id", nil); code != http.StatusUnauthorized {
		t.Fatalf("IMDSv1 GET: status %d, want 401 (the fake must refuse what IMDSv2-only refuses)", code)
	}
}

func TestRoleAndCluster(t *testing.T) {
	metadatatest.RoleAndCluster(t, func(t *testing.T, tags map[string]string) metadatatest.Provider {
		f := awstest.New(t)
		f.Instances[0].Tags = tags
		return start(t, f, Config{})
	})
}

func TestThrottled(t *testing.T) {
	ctx := context.Background()
	for _, code := range []string{"RequestLimitExceeded", "Throttling"} {
		f := awstest.New(t)
		p := start(t, f, Config{})
		f.Update(func(f *awstest.Fake) { f.EC2Error = code })
		if _, err := p.Peers(ctx); !errors.Is(err, metadata.ErrThrottled) {
			t.Errorf("Peers() on %s = %v, want ErrThrottled", code, err)
		}
	}
	f := awstest.New(t)
	p := start(t, f, Config{})
	f.Update(func(f *awstest.Fake) { f.EC2Error = "InvalidInstanceID.Malformed" })
	if _, err := p.Self(ctx); err == nil || errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on InvalidInstanceID.Malformed = %v, want an error that is not ErrThrottled", err)
	}
	f.Update(func(f *awstest.Fake) { f.EC2Error, f.IMDSStatus = "", http.StatusTooManyRequests })
	if _, err := p.Self(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on IMDS 429 = %v, want ErrThrottled", err)
	}
}

func TestStaticCredentials(t *testing.T) {
	f := awstest.New(t)
	// Credentials the fake does not accept: the instance profile's are what the other tests sign with.
	p := start(t, f, Config{Credentials: credentials.NewStaticCredentialsProvider("AKIDOTHER", "secret", "")})
	if _, err := p.Self(context.Background()); err == nil || !strings.Contains(err.Error(), "AuthFailure") {
		t.Fatalf("Self() with credentials EC2 refuses = %v, want AuthFailure", err)
	}
}

func TestInstanceNotFound(t *testing.T) {
	f := awstest.New(t)
	p := start(t, f, Config{})
	// EC2 does not know the instance yet (eventual consistency after a launch): callers retry.
	f.Update(func(f *awstest.Fake) { f.EC2Error = "InvalidInstanceID.NotFound" })
	if _, err := p.Self(context.Background()); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("Self() on InvalidInstanceID.NotFound = %v, want ErrNotFound", err)
	}
	// An IMDS path that does not exist is ErrNotFound too.
	if _, err := p.get(context.Background(), "tags/instance/berth-role"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("get() of a missing path = %v, want ErrNotFound", err)
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
	p := New(Config{IMDSEndpoint: "http://" + addr})
	if _, err := p.Self(context.Background()); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Self() without IMDS = %v, want ErrUnreachable", err)
	}
}

func TestPeersCached(t *testing.T) {
	f := awstest.New(t)
	clk := testingclock.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	p := start(t, f, Config{PeersTTL: 10 * time.Second, Clock: clk})
	lists := func() (n int) {
		f.Read(func(f *awstest.Fake) { n = f.Describes })
		return n
	}
	metadatatest.PeersCached(t, p.Peers, lists, clk, 10*time.Second)
}
