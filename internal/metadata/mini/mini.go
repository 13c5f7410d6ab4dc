// Package mini is the metadata API that `berth mini up` serves on the host to its namespace nodes,
// and the client the bootstrapper uses to read it. The server tells each caller who it is by the
// caller's source address, the way a cloud's instance metadata service does.
//
// Endpoints (all GET, JSON):
//
//	/v1/self                    the calling instance
//	/v1/peers                   every instance of the cluster
//	/v1/control-plane-endpoint  {"endpoint": "HOST:PORT"} (404 until published)
//	/v1/init-secret-hash        {"sha256": "<hex>"}      (404 until published)
//
// A caller whose address belongs to no instance gets 403 on every endpoint.
package mini

import (
	"encoding/hex"
	"encoding/json"
	"net"
	"net/http"
	"sync"

	"github.com/berth-k8s/berth/internal/metadata"
)

// Paths served by Server.
const (
	PathSelf                 = "/v1/self"
	PathPeers                = "/v1/peers"
	PathControlPlaneEndpoint = "/v1/control-plane-endpoint"
	PathInitSecretHash       = "/v1/init-secret-hash"
)

// Server serves the mini metadata API. It is safe for concurrent use; the setters may be called
// while it serves.
type Server struct {
	mu        sync.RWMutex
	instances []metadata.Instance
	endpoint  string
	hash      []byte
}

// NewServer returns a server with no instances.
func NewServer() *Server { return &Server{} }

// SetInstances replaces the set of instances.
func (s *Server) SetInstances(instances []metadata.Instance) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.instances = append([]metadata.Instance(nil), instances...)
}

// SetControlPlaneEndpoint publishes HOST:PORT of the API server.
func (s *Server) SetControlPlaneEndpoint(endpoint string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.endpoint = endpoint
}

// SetInitSecretHash publishes the SHA-256 of the init secret.
func (s *Server) SetInitSecretHash(hash []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hash = append([]byte(nil), hash...)
}

type endpointResponse struct {
	Endpoint string `json:"endpoint"`
}

type hashResponse struct {
	SHA256 string `json:"sha256"`
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	self, ok := s.caller(r)
	if !ok {
		http.Error(w, "unknown instance", http.StatusForbidden)
		return
	}
	switch r.URL.Path {
	case PathSelf:
		writeJSON(w, self)
	case PathPeers:
		writeJSON(w, s.instances)
	case PathControlPlaneEndpoint:
		if s.endpoint == "" {
			http.Error(w, "no control-plane endpoint yet", http.StatusNotFound)
			return
		}
		writeJSON(w, endpointResponse{Endpoint: s.endpoint})
	case PathInitSecretHash:
		if len(s.hash) == 0 {
			http.Error(w, "no init secret hash", http.StatusNotFound)
			return
		}
		writeJSON(w, hashResponse{SHA256: hex.EncodeToString(s.hash)})
	default:
		http.NotFound(w, r)
	}
}

func (s *Server) caller(r *http.Request) (metadata.Instance, bool) {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return metadata.Instance{}, false
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return metadata.Instance{}, false
	}
	for _, inst := range s.instances {
		if inst.HasIP(ip) {
			return inst, true
		}
	}
	return metadata.Instance{}, false
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
