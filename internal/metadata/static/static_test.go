package static

import (
	"context"
	"errors"
	"testing"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/metadata"
)

func TestProvider(t *testing.T) {
	fsys := afero.NewMemMapFs()
	const path = "/etc/berth/metadata.yaml"
	p := New(fsys, path)
	ctx := context.Background()
	if _, err := p.Self(ctx); err == nil {
		t.Fatal("Self() without file = nil error")
	}
	must(t, afero.WriteFile(fsys, path, []byte("self: {name: n1, role: worker, ips: [198.51.100.11]}\n"), 0o600))
	if self, err := p.Self(ctx); err != nil || self.Name != "n1" {
		t.Fatalf("Self() = %+v, %v", self, err)
	}
	if _, err := p.ControlPlaneEndpoint(ctx); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("ControlPlaneEndpoint() = %v, want ErrNotFound", err)
	}
	must(t, afero.WriteFile(fsys, path, []byte("self: {name: n1, role: worker, ips: [198.51.100.11]}\ninitSecretHash: zz\n"), 0o600))
	if _, err := p.InitSecretHash(ctx); err == nil {
		t.Fatal("InitSecretHash() with bad hex = nil error")
	}
	must(t, afero.WriteFile(fsys, path, []byte("self: {name: n1, role: boss, ips: [198.51.100.11]}\n"), 0o600))
	if _, err := p.Self(ctx); err == nil {
		t.Fatal("Self() with unknown role = nil error")
	}
	must(t, afero.WriteFile(fsys, path, []byte("self: {name: n1, role: worker, ips: [1.2.3.4]}\ntypo: 1\n"), 0o600))
	if _, err := p.Self(ctx); err == nil {
		t.Fatal("Self() with unknown field = nil error")
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
