// Package gcptest serves a local fake of the two Google Cloud APIs the gcp metadata provider reads, in
// their documented, recorded shapes: the metadata server (paths under /computeMetadata/v1/, the
// Metadata-Flavor: Google header required, the service account's access token) and the Compute Engine
// API (instances.get and instances.aggregatedList with a label filter and nextPageToken pagination,
// a Bearer token required, errors as googleapi error JSON). For tests only; it listens on loopback.
package gcptest

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// Names of the fake's project and zones.
const (
	Project = "berth-test"
	ZoneA   = "europe-west3-a"
	ZoneB   = "europe-west3-b"
	// InitSecretHash is the hex init-secret hash the fake's cp-0 carries.
	InitSecretHash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	// Endpoint is the control-plane endpoint the fake's cp-0 carries.
	Endpoint = "10.0.0.100:6443"
)

// Instance is one VM as the fake knows it.
type Instance struct {
	Name, Zone, Status, IP string
	Labels                 map[string]string
}

// Fake holds the fake's state. Change it with Update while the fake serves.
type Fake struct {
	// Self is the name of the calling instance.
	Self string
	// Instances are the project's VMs.
	Instances []Instance
	// Attributes are the calling instance's custom metadata attributes.
	Attributes map[string]string
	// MetadataStatus, when not 0, fails every metadata request with it.
	MetadataStatus int
	// APIStatus, when not 0, fails every Compute API request with it.
	APIStatus int
	// PageSize is how many instances one aggregatedList page holds.
	PageSize int
	// ListRequests counts aggregatedList requests.
	ListRequests int
	// TokenRequests counts service-account token requests.
	TokenRequests int

	mu     sync.Mutex
	tokens map[string]bool

	// MetadataURL is the metadata server's base URL (scheme and host).
	MetadataURL string
	// ComputeURL is the Compute API's base URL, including /compute/v1/.
	ComputeURL string
}

// New serves a fake project with one cluster c1 (control planes cp-0 and cp-1, workers w-0, a
// terminated w-1 and a role-less w-2) and another cluster's other-0; the caller is cp-0. Both servers
// are closed when the test ends.
func New(t testing.TB) *Fake {
	f := &Fake{
		Self: "cp-0",
		Instances: []Instance{
			{"cp-0", ZoneA, "RUNNING", "10.0.0.2", map[string]string{"berth-cluster": "c1", "berth-role": "control-plane"}},
			{"cp-1", ZoneB, "RUNNING", "10.0.0.3", map[string]string{"berth-cluster": "c1", "berth-role": "control-plane"}},
			{"w-0", ZoneA, "RUNNING", "10.0.0.4", map[string]string{"berth-cluster": "c1", "berth-role": "worker"}},
			{"w-1", ZoneB, "TERMINATED", "10.0.0.5", map[string]string{"berth-cluster": "c1", "berth-role": "worker"}},
			{"w-2", ZoneB, "RUNNING", "10.0.0.6", map[string]string{"berth-cluster": "c1"}},
			{"other-0", ZoneA, "RUNNING", "10.0.1.2", map[string]string{"berth-cluster": "c2", "berth-role": "worker"}},
		},
		Attributes: map[string]string{
			"berth-control-plane-endpoint": Endpoint,
			"berth-init-secret-hash":       InitSecretHash,
		},
		PageSize: 2,
		tokens:   map[string]bool{},
	}
	md := httptest.NewServer(http.HandlerFunc(f.serveMetadata))
	t.Cleanup(md.Close)
	api := httptest.NewServer(http.HandlerFunc(f.serveCompute))
	t.Cleanup(api.Close)
	f.MetadataURL = md.URL
	f.ComputeURL = api.URL + "/compute/v1/"
	return f
}

// Update changes the fake's state under its lock.
func (f *Fake) Update(fn func(f *Fake)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

// Read reads the fake's state under its lock.
func (f *Fake) Read(fn func(f *Fake)) { f.Update(fn) }

// RevokeTokens makes the Compute API refuse every access token handed out so far. Call it inside Update.
func (f *Fake) RevokeTokens() { f.tokens = map[string]bool{} }

func (f *Fake) find(name string) (Instance, bool) {
	for _, in := range f.Instances {
		if in.Name == name {
			return in, true
		}
	}
	return Instance{}, false
}

func (f *Fake) serveMetadata(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Metadata-Flavor") != "Google" {
		http.Error(w, "Missing Metadata-Flavor:Google header.", http.StatusForbidden)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.MetadataStatus != 0 {
		http.Error(w, http.StatusText(f.MetadataStatus), f.MetadataStatus)
		return
	}
	self, _ := f.find(f.Self)
	suffix := strings.TrimPrefix(r.URL.Path, "/computeMetadata/v1/")
	w.Header().Set("Metadata-Flavor", "Google")
	w.Header().Set("Content-Type", "application/text")
	switch {
	case suffix == "project/project-id":
		_, _ = fmt.Fprint(w, Project)
	case suffix == "instance/zone":
		_, _ = fmt.Fprintf(w, "projects/123456789012/zones/%s", self.Zone)
	case suffix == "instance/name":
		_, _ = fmt.Fprint(w, self.Name)
	case suffix == "instance/network-interfaces/":
		_, _ = fmt.Fprint(w, "0/\n")
	case suffix == "instance/network-interfaces/0/ip":
		_, _ = fmt.Fprint(w, self.IP)
	case suffix == "instance/service-accounts/default/token":
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		tok := "ya29.fake-" + hex.EncodeToString(b)
		f.tokens[tok] = true
		f.TokenRequests++
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"access_token": tok, "expires_in": 3599, "token_type": "Bearer"})
	case strings.HasPrefix(suffix, "instance/attributes/"):
		v, ok := f.Attributes[strings.TrimPrefix(suffix, "instance/attributes/")]
		if !ok {
			http.NotFound(w, r)
			return
		}
		_, _ = fmt.Fprint(w, v)
	default:
		http.NotFound(w, r)
	}
}

// apiInstance renders an instance as the Compute API does.
func apiInstance(in Instance) map[string]any {
	return map[string]any{
		"kind":   "compute#instance",
		"id":     "4817296148716272313",
		"name":   in.Name,
		"zone":   "https://www.googleapis.com/compute/v1/projects/" + Project + "/zones/" + in.Zone,
		"status": in.Status,
		"labels": in.Labels,
		"networkInterfaces": []any{map[string]any{
			"kind":          "compute#networkInterface",
			"name":          "nic0",
			"network":       "https://www.googleapis.com/compute/v1/projects/" + Project + "/global/networks/default",
			"networkIP":     in.IP,
			"accessConfigs": []any{map[string]any{"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT", "name": "External NAT", "natIP": "203.0.113.9"}},
		}},
		"shieldedInstanceConfig": map[string]any{"enableSecureBoot": true, "enableVtpm": true, "enableIntegrityMonitoring": true},
		"selfLink":               "https://www.googleapis.com/compute/v1/projects/" + Project + "/zones/" + in.Zone + "/instances/" + in.Name,
	}
}

func writeAPIError(w http.ResponseWriter, code int) {
	reason, domain := "backendError", "global"
	switch code {
	case http.StatusTooManyRequests:
		reason, domain = "rateLimitExceeded", "usageLimits"
	case http.StatusUnauthorized:
		reason = "authError"
		w.Header().Set("WWW-Authenticate", `Bearer realm="https://accounts.google.com/", error="invalid_token"`)
	case http.StatusNotFound:
		reason = "notFound"
	}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{
		"code": code, "message": http.StatusText(code),
		"errors": []any{map[string]any{"message": http.StatusText(code), "domain": domain, "reason": reason}},
	}})
}

func (f *Fake) serveCompute(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.tokens[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")] {
		writeAPIError(w, http.StatusUnauthorized)
		return
	}
	if f.APIStatus != 0 {
		writeAPIError(w, f.APIStatus)
		return
	}
	parts := strings.Split(strings.Trim(strings.TrimPrefix(r.URL.Path, "/compute/v1/"), "/"), "/")
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	switch {
	case len(parts) == 6 && parts[0] == "projects" && parts[1] == Project && parts[2] == "zones" && parts[4] == "instances":
		in, ok := f.find(parts[5])
		if !ok || in.Zone != parts[3] {
			writeAPIError(w, http.StatusNotFound)
			return
		}
		_ = json.NewEncoder(w).Encode(apiInstance(in))
	case len(parts) == 4 && parts[0] == "projects" && parts[1] == Project && parts[2] == "aggregated" && parts[3] == "instances":
		f.ListRequests++
		var match []Instance
		for _, in := range f.Instances {
			if r.URL.Query().Get("filter") == fmt.Sprintf("labels.berth-cluster = %q", in.Labels["berth-cluster"]) {
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
		end := min(start+f.PageSize, len(match))
		items := map[string]any{}
		for _, z := range []string{ZoneA, ZoneB} {
			var list []any
			for _, in := range match[start:end] {
				if in.Zone == z {
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
			"kind": "compute#instanceAggregatedList", "id": "projects/" + Project + "/aggregated/instances",
			"items": items, "selfLink": "https://www.googleapis.com/compute/v1/projects/" + Project + "/aggregated/instances",
		}
		if end < len(match) {
			resp["nextPageToken"] = strconv.Itoa(end)
		}
		_ = json.NewEncoder(w).Encode(resp)
	default:
		writeAPIError(w, http.StatusNotFound)
	}
}
