package gcp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/api/option"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/berth-k8s/berth/internal/metadata"
)

const (
	project = "berth-test"
	zoneA   = "europe-west3-a"
	zoneB   = "europe-west3-b"
	hashHex = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
)

// fakeInstance is one VM as the fake Compute API and metadata server know it.
type fakeInstance struct {
	name, zone, status, ip string
	labels                 map[string]string
}

// fake serves the two documented APIs a GCP provider uses: the metadata server (paths under
// /computeMetadata/v1/, the Metadata-Flavor: Google header required) and the Compute Engine API
// (instances.get and instances.aggregatedList with filter and nextPageToken), in their recorded shapes.
type fake struct {
	t    *testing.T
	self string // name of the calling instance

	mu           sync.Mutex
	instances    []fakeInstance
	attrs        map[string]string
	mdStatus     int // when not 0, every metadata request fails with it
	apiStatus    int // when not 0, every Compute API request fails with it
	listRequests int
	pageSize     int
}

func newFake(t *testing.T) *fake {
	return &fake{
		t:    t,
		self: "cp-0",
		instances: []fakeInstance{
			{"cp-0", zoneA, "RUNNING", "10.0.0.2", map[string]string{"berth-cluster": "c1", "berth-role": "control-plane"}},
			{"cp-1", zoneB, "RUNNING", "10.0.0.3", map[string]string{"berth-cluster": "c1", "berth-role": "control-plane"}},
			{"w-0", zoneA, "RUNNING", "10.0.0.4", map[string]string{"berth-cluster": "c1", "berth-role": "worker"}},
			{"w-1", zoneB, "TERMINATED", "10.0.0.5", map[string]string{"berth-cluster": "c1", "berth-role": "worker"}},
			{"w-2", zoneB, "RUNNING", "10.0.0.6", map[string]string{"berth-cluster": "c1"}},
			{"other-0", zoneA, "RUNNING", "10.0.1.2", map[string]string{"berth-cluster": "c2", "berth-role": "worker"}},
		},
		attrs: map[string]string{
			"berth-control-plane-endpoint": "10.0.0.100:6443",
			"berth-init-secret-hash":       hashHex,
		},
		pageSize: 2,
	}
}

func (f *fake) find(name string) (fakeInstance, bool) {
	for _, in := range f.instances {
		if in.name == name {
			return in, true
		}
	}
	return fakeInstance{}, false
}

func (f *fake) serveMetadata(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Metadata-Flavor") != "Google" {
		http.Error(w, "Missing Metadata-Flavor:Google header.", http.StatusForbidden)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.mdStatus != 0 {
		http.Error(w, http.StatusText(f.mdStatus), f.mdStatus)
		return
	}
	self, _ := f.find(f.self)
	suffix := strings.TrimPrefix(r.URL.Path, "/computeMetadata/v1/")
	w.Header().Set("Metadata-Flavor", "Google")
	w.Header().Set("Content-Type", "application/text")
	switch {
	case suffix == "project/project-id":
		fmt.Fprint(w, project)
	case suffix == "instance/zone":
		fmt.Fprintf(w, "projects/123456789012/zones/%s", self.zone)
	case suffix == "instance/name":
		fmt.Fprint(w, self.name)
	case suffix == "instance/network-interfaces/":
		fmt.Fprint(w, "0/\n")
	case suffix == "instance/network-interfaces/0/ip":
		fmt.Fprint(w, self.ip)
	case strings.HasPrefix(suffix, "instance/attributes/"):
		v, ok := f.attrs[strings.TrimPrefix(suffix, "instance/attributes/")]
		if !ok {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, v)
	default:
		http.NotFound(w, r)
	}
}

// apiInstance renders an instance as the Compute API does.
func apiInstance(in fakeInstance) map[string]any {
	return map[string]any{
		"kind":   "compute#instance",
		"id":     "4817296148716272313",
		"name":   in.name,
		"zone":   "https://www.googleapis.com/compute/v1/projects/" + project + "/zones/" + in.zone,
		"status": in.status,
		"labels": in.labels,
		"networkInterfaces": []any{map[string]any{
			"kind":          "compute#networkInterface",
			"name":          "nic0",
			"network":       "https://www.googleapis.com/compute/v1/projects/" + project + "/global/networks/default",
			"networkIP":     in.ip,
			"accessConfigs": []any{map[string]any{"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT", "name": "External NAT", "natIP": "203.0.113.9"}},
		}},
		"shieldedInstanceConfig": map[string]any{"enableSecureBoot": true, "enableVtpm": true, "enableIntegrityMonitoring": true},
		"selfLink":               "https://www.googleapis.com/compute/v1/projects/" + project + "/zones/" + in.zone + "/instances/" + in.name,
	}
}

func writeAPIError(w http.ResponseWriter, code int) {
	reason := "backendError"
	if code == http.StatusTooManyRequests {
		reason = "rateLimitExceeded"
	}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"code": code, "message": http.StatusText(code),
		"errors": []any{map[string]any{"message": http.StatusText(code), "domain": "usageLimits", "reason": reason}},
	}})
}

func (f *fake) serveCompute(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.apiStatus != 0 {
		writeAPIError(w, f.apiStatus)
		return
	}
	parts := strings.Split(strings.Trim(strings.TrimPrefix(r.URL.Path, "/compute/v1/"), "/"), "/")
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	switch {
	case len(parts) == 6 && parts[0] == "projects" && parts[1] == project && parts[2] == "zones" && parts[4] == "instances":
		in, ok := f.find(parts[5])
		if !ok || in.zone != parts[3] {
			writeAPIError(w, http.StatusNotFound)
			return
		}
		_ = json.NewEncoder(w).Encode(apiInstance(in))
	case len(parts) == 4 && parts[0] == "projects" && parts[1] == project && parts[2] == "aggregated" && parts[3] == "instances":
		f.listRequests++
		var match []fakeInstance
		for _, in := range f.instances {
			if r.URL.Query().Get("filter") == fmt.Sprintf("labels.berth-cluster = %q", in.labels["berth-cluster"]) {
				match = append(match, in)
			}
		}
		start := 0
		if tok := r.URL.Query().Get("pageToken"); tok != "" {
			var err error
			if start, err = strconv.Atoi(tok); err != nil || start > len(match) {
				writeAPIError(w, http.StatusBadRequest)
				return
			}
		}
		end := min(start+f.pageSize, len(match))
		items := map[string]any{}
		for _, z := range []string{zoneA, zoneB} {
			var list []any
			for _, in := range match[start:end] {
				if in.zone == z {
					list = append(list, apiInstance(in))
				}
			}
			if list == nil {
				items["zones/"+z] = map[string]any{"warning": map[string]any{
					"code": "NO_RESULTS_ON_PAGE", "message": "There are no results for scope 'zones/" + z + "' on this page.",
					"data": []any{map[string]any{"key": "scope", "value": "zones/" + z}},
				}}
				continue
			}
			items["zones/"+z] = map[string]any{"instances": list}
		}
		resp := map[string]any{
			"kind": "compute#instanceAggregatedList", "id": "projects/" + project + "/aggregated/instances",
			"items": items, "selfLink": "https://www.googleapis.com/compute/v1/projects/" + project + "/aggregated/instances",
		}
		if end < len(match) {
			resp["nextPageToken"] = strconv.Itoa(end)
		}
		_ = json.NewEncoder(w).Encode(resp)
	default:
		writeAPIError(w, http.StatusNotFound)
	}
}

func (f *fake) lists() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.listRequests
}

func (f *fake) set(fn func(f *fake)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

// start serves the fake and returns a provider reading it.
func (f *fake) start(cfg Config) *Provider {
	f.t.Helper()
	md := httptest.NewServer(http.HandlerFunc(f.serveMetadata))
	f.t.Cleanup(md.Close)
	api := httptest.NewServer(http.HandlerFunc(f.serveCompute))
	f.t.Cleanup(api.Close)
	cfg.MetadataURL = md.URL
	cfg.ComputeEndpoint = api.URL + "/compute/v1/"
	cfg.ClientOptions = []option.ClientOption{option.WithoutAuthentication()}
	p, err := New(context.Background(), cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return p
}

func names(in []metadata.Instance) []string {
	var out []string
	for _, i := range in {
		out = append(out, i.Name+"/"+string(i.Role)+"/"+strings.Join(i.IPs, ","))
	}
	return out
}

func TestProvider(t *testing.T) {
	f := newFake(t)
	p := f.start(Config{PeersTTL: -1})
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
	if got := names(peers); !slices.Equal(got, want) {
		t.Fatalf("Peers() = %v, want %v", got, want)
	}
	if f.lists() != 3 { // 5 matching instances, 2 per page
		t.Errorf("aggregatedList requests = %d, want 3 (pagination)", f.lists())
	}
	ep, err := p.ControlPlaneEndpoint(ctx)
	if err != nil || ep != "10.0.0.100:6443" {
		t.Fatalf("ControlPlaneEndpoint() = %q, %v", ep, err)
	}
	h, err := p.InitSecretHash(ctx)
	if err != nil || fmt.Sprintf("%x", h) != hashHex {
		t.Fatalf("InitSecretHash() = %x, %v", h, err)
	}

	// The worker's view.
	f.set(func(f *fake) { f.self = "w-0" })
	if self, err := p.Self(ctx); err != nil || self.Role != metadata.RoleWorker {
		t.Fatalf("Self() on w-0 = %+v, %v", self, err)
	}
}

func TestAttributes(t *testing.T) {
	f := newFake(t)
	p := f.start(Config{})
	ctx := context.Background()
	f.set(func(f *fake) { f.attrs = map[string]string{} })
	if _, err := p.ControlPlaneEndpoint(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("ControlPlaneEndpoint() without attribute = %v, want ErrNotFound", err)
	}
	if _, err := p.InitSecretHash(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("InitSecretHash() without attribute = %v, want ErrNotFound", err)
	}
	f.set(func(f *fake) {
		f.attrs = map[string]string{"berth-control-plane-endpoint": "10.0.0.100", "berth-init-secret-hash": "abc"}
	})
	if _, err := p.ControlPlaneEndpoint(ctx); err == nil || !strings.Contains(err.Error(), "HOST:PORT") {
		t.Errorf("ControlPlaneEndpoint() without port = %v, want a HOST:PORT error", err)
	}
	if _, err := p.InitSecretHash(ctx); err == nil || errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("InitSecretHash() of a short value = %v, want a parse error", err)
	}
}

func TestRoleAndClusterLabels(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   error
		peers  error
	}{
		{"no role", map[string]string{"berth-cluster": "c1"}, metadata.ErrMissingRole, nil},
		{"unknown role", map[string]string{"berth-cluster": "c1", "berth-role": "boss"}, metadata.ErrInvalidRole, nil},
		{"no cluster", map[string]string{"berth-role": "worker"}, nil, metadata.ErrMissingCluster},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t)
			f.instances[0].labels = tc.labels
			p := f.start(Config{})
			_, err := p.Self(ctx)
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("Self() = %v, want %v", err, tc.want)
			}
			_, err = p.Peers(ctx)
			if tc.peers == nil && err != nil || tc.peers != nil && !errors.Is(err, tc.peers) {
				t.Errorf("Peers() = %v, want %v", err, tc.peers)
			}
		})
	}
}

func TestThrottled(t *testing.T) {
	ctx := context.Background()
	f := newFake(t)
	p := f.start(Config{PeersTTL: -1})
	f.set(func(f *fake) { f.apiStatus = http.StatusTooManyRequests })
	if _, err := p.Peers(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Peers() on 429 = %v, want ErrThrottled", err)
	}
	if _, err := p.Self(ctx); !errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on 429 = %v, want ErrThrottled", err)
	}
	f.set(func(f *fake) { f.apiStatus = http.StatusInternalServerError })
	if _, err := p.Self(ctx); err == nil || errors.Is(err, metadata.ErrThrottled) {
		t.Errorf("Self() on 500 = %v, want an error that is not ErrThrottled", err)
	}
	// The metadata server's 429 (the client retries it a few times first).
	f.set(func(f *fake) { f.apiStatus, f.mdStatus = 0, http.StatusTooManyRequests })
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

func TestMetadataFlavorRequired(t *testing.T) {
	f := newFake(t)
	md := httptest.NewServer(http.HandlerFunc(f.serveMetadata))
	t.Cleanup(md.Close)
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, md.URL+"/computeMetadata/v1/instance/name", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := md.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("metadata request without Metadata-Flavor: status %d, want 403 (the fake must check what the real server checks)", resp.StatusCode)
	}
}

func TestPeersCached(t *testing.T) {
	f := newFake(t)
	clk := testingclock.NewFakePassiveClock(time.Unix(1_700_000_000, 0))
	p := f.start(Config{PeersTTL: 10 * time.Second, Clock: clk})
	ctx := context.Background()
	first, err := p.Peers(ctx)
	if err != nil {
		t.Fatal(err)
	}
	requests := f.lists()
	f.set(func(f *fake) { f.instances[2].status = "STOPPING" })
	again, err := p.Peers(ctx)
	if err != nil || f.lists() != requests || !slices.Equal(names(first), names(again)) {
		t.Fatalf("Peers() within the TTL listed again (%d -> %d requests) or changed: %v, %v", requests, f.lists(), names(again), err)
	}
	clk.SetTime(clk.Now().Add(11 * time.Second))
	later, err := p.Peers(ctx)
	if err != nil || f.lists() == requests || len(later) != len(first)-1 {
		t.Fatalf("Peers() after the TTL = %v, %v (%d requests); want a fresh listing without w-0", names(later), err, f.lists())
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
