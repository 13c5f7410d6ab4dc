package mini

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/berth-k8s/berth/internal/metadata"
)

func TestServerKeysByCallerAddress(t *testing.T) {
	srv := NewServer()
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	c := NewClient(ts.URL)
	ctx := context.Background()

	if _, err := c.Self(ctx); !errors.Is(err, ErrForbidden) {
		t.Fatalf("Self() for unknown caller = %v, want ErrForbidden", err)
	}

	cp := metadata.Instance{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"127.0.0.1"}}
	w := metadata.Instance{Name: "worker-0", Role: metadata.RoleWorker, IPs: []string{"198.51.100.12"}}
	srv.SetInstances([]metadata.Instance{cp, w})

	self, err := c.Self(ctx)
	if err != nil || self.Name != "cp-0" {
		t.Fatalf("Self() = %+v, %v; want cp-0", self, err)
	}
	peers, err := c.Peers(ctx)
	if err != nil || len(peers) != 2 {
		t.Fatalf("Peers() = %+v, %v; want 2 peers", peers, err)
	}
	if _, err := c.ControlPlaneEndpoint(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("ControlPlaneEndpoint() before publish = %v, want ErrNotFound", err)
	}
	if _, err := c.InitSecretHash(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("InitSecretHash() before publish = %v, want ErrNotFound", err)
	}
	srv.SetControlPlaneEndpoint("198.51.100.10:6443")
	hash := bytes.Repeat([]byte{7}, 32)
	srv.SetInitSecretHash(hash)
	if ep, err := c.ControlPlaneEndpoint(ctx); err != nil || ep != "198.51.100.10:6443" {
		t.Fatalf("ControlPlaneEndpoint() = %q, %v", ep, err)
	}
	if got, err := c.InitSecretHash(ctx); err != nil || !bytes.Equal(got, hash) {
		t.Fatalf("InitSecretHash() = %x, %v", got, err)
	}
}

func TestServerRejectsWrites(t *testing.T) {
	srv := NewServer()
	srv.SetInstances([]metadata.Instance{{Name: "a", Role: metadata.RoleWorker, IPs: []string{"127.0.0.1"}}})
	req := httptest.NewRequest(http.MethodPost, PathSelf, nil)
	req.RemoteAddr = net.JoinHostPort("127.0.0.1", "1234")
	rec := httptest.NewRecorder()
	srv.ServeHTTP(rec, req)
	if rec.Code != http.StatusMethodNotAllowed {
		t.Fatalf("POST status = %d, want 405", rec.Code)
	}
}
