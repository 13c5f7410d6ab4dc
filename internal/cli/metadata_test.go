package cli

import (
	"context"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/berth-k8s/berth/internal/metadata"
	metachoose "github.com/berth-k8s/berth/internal/metadata/choose"
	metamini "github.com/berth-k8s/berth/internal/metadata/mini"
)

// The host-side service of --metadata=qemu, read by the provider the daemons build for qemu.
func TestMetadataServe(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "cluster.yaml")
	hash := "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	if err := os.WriteFile(file, []byte(`instances:
  - {name: cp-0, role: control-plane, ips: [127.0.0.1]}
  - {name: w-0, role: worker, ips: [198.51.100.20]}
controlPlaneEndpoint: 198.51.100.10:6443
initSecretHash: `+hash+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	srv, _, err := loadClusterFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var lc net.ListenConfig
	lis, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serveMetadata(ctx, lis, srv) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serveMetadata() = %v", err)
		}
	})

	p, err := metachoose.New(ctx, metachoose.Config{Name: metachoose.QEMU, URL: "http://" + lis.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	self, err := p.Self(ctx)
	if err != nil || self.Name != "cp-0" || self.Role != metadata.RoleControlPlane {
		t.Fatalf("Self() = %+v, %v", self, err)
	}
	peers, err := p.Peers(ctx)
	if err != nil || len(peers) != 2 {
		t.Fatalf("Peers() = %v, %v", peers, err)
	}
	if ep, err := p.ControlPlaneEndpoint(ctx); err != nil || ep != "198.51.100.10:6443" {
		t.Fatalf("ControlPlaneEndpoint() = %q, %v", ep, err)
	}
	if h, err := p.InitSecretHash(ctx); err != nil || hex.EncodeToString(h) != hash {
		t.Fatalf("InitSecretHash() = %x, %v", h, err)
	}

	// A caller the file does not list (here: every caller, once cp-0 has another address) is refused.
	srv.SetInstances([]metadata.Instance{{Name: "cp-0", Role: metadata.RoleControlPlane, IPs: []string{"198.51.100.10"}}})
	if _, err := p.Self(ctx); !errors.Is(err, metamini.ErrForbidden) {
		t.Fatalf("Self() from an unknown address = %v, want ErrForbidden", err)
	}
}

func TestMetadataServeBadFile(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{
		"empty":        "instances: []\n",
		"bad role":     "instances: [{name: a, role: boss, ips: [198.51.100.1]}]\n",
		"unknown key":  "instances: [{name: a, role: worker, ips: [198.51.100.1]}]\nendpoint: x\n",
		"bad hash":     "instances: [{name: a, role: worker, ips: [198.51.100.1]}]\ninitSecretHash: abc\n",
		"bad endpoint": "instances: [{name: a, role: worker, ips: [198.51.100.1]}]\ncontrolPlaneEndpoint: nohost\n",
	} {
		file := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(file, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, _, err := loadClusterFile(file); err == nil {
			t.Errorf("%s: loadClusterFile() = nil error", name)
		}
	}
	cmd := NewRootCmd()
	cmd.SetArgs([]string{"metadata", "serve", "--file", filepath.Join(dir, "c.yaml")})
	if err := cmd.Execute(); exitCode(err, true) != exitUsage {
		t.Fatalf("metadata serve without --listen = %v, want a usage error", err)
	}
}
