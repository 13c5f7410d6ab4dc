package choose

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/aws/awstest"
	"github.com/berth-k8s/berth/internal/metadata/azure/azuretest"
	"github.com/berth-k8s/berth/internal/metadata/gcp/gcptest"
	"github.com/berth-k8s/berth/internal/metadata/mini"
	"github.com/berth-k8s/berth/internal/metadata/static"
)

// want is what a provider built by New must answer: the fake's caller, its peers, the control-plane
// endpoint and the init-secret hash.
type want struct {
	self     string
	role     metadata.Role
	peers    []string
	endpoint string
	hash     string
}

// TestNewBuildsTheNamedProvider builds every provider --metadata names through New, against a local
// server of its platform (a file, the mini API, each cloud's fake), and asks it everything the daemons
// ask. A name wired to the wrong provider, or a URL not passed on, fails here.
func TestNewBuildsTheNamedProvider(t *testing.T) {
	const hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	cloud := want{role: metadata.RoleControlPlane, hash: hash}

	for _, tc := range []struct {
		name  string
		setup func(t *testing.T) (Config, want)
	}{
		{Static, func(t *testing.T) (Config, want) {
			fs := afero.NewMemMapFs()
			f := static.File{
				Self:                 metadata.Instance{Name: "s-0", Role: metadata.RoleWorker, IPs: []string{"192.0.2.10"}},
				Peers:                []metadata.Instance{{Name: "s-1", Role: metadata.RoleControlPlane, IPs: []string{"192.0.2.11"}}},
				ControlPlaneEndpoint: "192.0.2.11:6443",
				InitSecretHash:       hash,
			}
			raw, err := json.Marshal(f)
			if err != nil {
				t.Fatal(err)
			}
			if err := afero.WriteFile(fs, "/etc/berth/metadata.json", raw, 0o600); err != nil {
				t.Fatal(err)
			}
			return Config{Name: Static, File: "/etc/berth/metadata.json", FS: fs},
				want{"s-0", metadata.RoleWorker, []string{"s-0", "s-1"}, "192.0.2.11:6443", hash}
		}},
		{Mini, func(t *testing.T) (Config, want) { return miniServer(t, Mini, hash) }},
		{QEMU, func(t *testing.T) (Config, want) { return miniServer(t, QEMU, hash) }},
		{GCP, func(t *testing.T) (Config, want) {
			f := gcptest.New(t)
			w := cloud
			w.self, w.peers, w.endpoint = "cp-0", []string{"cp-0", "cp-1", "w-0"}, gcptest.Endpoint
			// Without its trailing slash: New adds it, as the Compute client needs.
			return Config{Name: GCP, URL: f.MetadataURL, APIURL: strings.TrimSuffix(f.ComputeURL, "/")}, w
		}},
		{AWS, func(t *testing.T) (Config, want) {
			f := awstest.New(t)
			w := cloud
			w.self = "ip-10-0-0-2.eu-central-1.compute.internal"
			w.peers = []string{w.self, "ip-10-0-0-3.eu-central-1.compute.internal", "ip-10-0-0-4.eu-central-1.compute.internal"}
			w.endpoint = awstest.Endpoint
			return Config{Name: AWS, URL: f.IMDSURL, APIURL: f.EC2URL}, w
		}},
		{Azure, func(t *testing.T) (Config, want) {
			f := azuretest.New(t)
			w := cloud
			w.self, w.peers, w.endpoint = "cp-0", []string{"cp-0", "cp-1", "w-0"}, azuretest.Endpoint
			return Config{Name: Azure, URL: f.IMDSURL, APIURL: f.ARMURL, HTTPClient: f.Client}, w
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			cfg, w := tc.setup(t)
			p, err := New(ctx, cfg)
			if err != nil {
				t.Fatalf("New(%+v): %v", cfg, err)
			}
			self, err := p.Self(ctx)
			if err != nil {
				t.Fatalf("Self: %v", err)
			}
			if self.Name != w.self || self.Role != w.role {
				t.Errorf("Self() = %s/%s, want %s/%s", self.Name, self.Role, w.self, w.role)
			}
			peers, err := p.Peers(ctx)
			if err != nil {
				t.Fatalf("Peers: %v", err)
			}
			var names []string
			for _, i := range peers {
				names = append(names, i.Name)
			}
			if !slices.Equal(names, w.peers) {
				t.Errorf("Peers() = %v, want %v", names, w.peers)
			}
			ep, err := p.ControlPlaneEndpoint(ctx)
			if err != nil {
				t.Fatalf("ControlPlaneEndpoint: %v", err)
			}
			if ep != w.endpoint {
				t.Errorf("ControlPlaneEndpoint() = %q, want %q", ep, w.endpoint)
			}
			h, err := p.InitSecretHash(ctx)
			if err != nil {
				t.Fatalf("InitSecretHash: %v", err)
			}
			if got := hex.EncodeToString(h); got != w.hash {
				t.Errorf("InitSecretHash() = %s, want %s", got, w.hash)
			}
		})
	}
}

// miniServer serves the mini metadata API on loopback; the caller is the instance at 127.0.0.1.
func miniServer(t *testing.T, name, hash string) (Config, want) {
	s := mini.NewServer()
	s.SetInstances([]metadata.Instance{
		{Name: "m-0", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}},
		{Name: "m-1", Role: metadata.RoleWorker, IPs: []string{"192.0.2.21"}},
	})
	s.SetControlPlaneEndpoint("127.0.0.1:6443")
	raw, err := hex.DecodeString(hash)
	if err != nil {
		t.Fatal(err)
	}
	s.SetInitSecretHash(raw)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return Config{Name: name, URL: srv.URL},
		want{"m-0", metadata.RoleControlPlane, []string{"m-0", "m-1"}, "127.0.0.1:6443", hash}
}

// TestValidateRefuses checks that every configuration New cannot build is refused before any request,
// with an error that names the flag to fix (and the value, where one was given).
func TestValidateRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		// every string must appear in the error
		mentions []string
	}{
		{"no name", Config{}, []string{"--metadata is required", "static, mini, qemu, gcp, aws, azure"}},
		{"unknown name", Config{Name: "openstack"}, []string{`--metadata "openstack"`, "want one of static, mini, qemu, gcp, aws, azure"}},
		{"name in upper case", Config{Name: "GCP"}, []string{`--metadata "GCP"`}},
		{"static without file", Config{Name: Static}, []string{"--metadata=static needs --metadata-file"}},
		{"mini without url", Config{Name: Mini}, []string{"--metadata=mini needs --metadata-url"}},
		{"qemu without url", Config{Name: QEMU}, []string{"--metadata=qemu needs --metadata-url"}},
		{"url without scheme", Config{Name: Mini, URL: "192.0.2.1:8080"}, []string{`--metadata-url "192.0.2.1:8080"`, "want http(s)://"}},
		{"url of another scheme", Config{Name: GCP, URL: "ftp://192.0.2.1"}, []string{`--metadata-url "ftp://192.0.2.1"`}},
		{"api url without host", Config{Name: AWS, APIURL: "https://"}, []string{`--metadata-api-url "https://"`}},
		{"api url for static", Config{Name: Static, File: "/f", APIURL: "https://192.0.2.1"}, []string{"--metadata-api-url is for gcp, aws and azure, not static"}},
		{"api url for mini", Config{Name: Mini, URL: "http://192.0.2.1", APIURL: "https://192.0.2.1"}, []string{"not mini"}},
		{"api url for qemu", Config{Name: QEMU, URL: "http://192.0.2.1", APIURL: "https://192.0.2.1"}, []string{"not qemu"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if err == nil {
				t.Fatalf("Validate(%+v) = nil, want an error", tc.cfg)
			}
			for _, m := range tc.mentions {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("Validate(%+v) = %q, want it to mention %q", tc.cfg, err, m)
				}
			}
			// New refuses the same configuration with the same error, before it builds anything.
			p, nerr := New(context.Background(), tc.cfg)
			if p != nil || nerr == nil || nerr.Error() != err.Error() {
				t.Errorf("New(%+v) = %v, %v; want nil, %q", tc.cfg, p, nerr, err)
			}
		})
	}
}

// TestValidateAccepts checks the configurations the daemons use: the clouds need no URL (their
// well-known addresses are the defaults), mini and qemu need only theirs.
func TestValidateAccepts(t *testing.T) {
	for _, cfg := range []Config{
		{Name: Static, File: "/etc/berth/metadata.json"},
		{Name: Mini, URL: "http://192.0.2.1:8080"},
		{Name: QEMU, URL: "http://192.0.2.1:8080/base/"},
		{Name: GCP},
		{Name: AWS},
		{Name: Azure},
		{Name: GCP, URL: "http://192.0.2.1", APIURL: "https://192.0.2.2/compute/v1/"},
		{Name: AWS, URL: "http://192.0.2.1", APIURL: "https://192.0.2.2"},
		{Name: Azure, URL: "http://192.0.2.1", APIURL: "https://192.0.2.2"},
	} {
		if err := cfg.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v, want nil", cfg, err)
		}
	}
	if !slices.Equal(Names, []string{Static, Mini, QEMU, GCP, AWS, Azure}) {
		t.Errorf("Names = %v: a provider was added or removed; update the tables of this test and the README", Names)
	}
}
