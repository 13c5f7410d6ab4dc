package nodestate

import (
	"testing"

	"github.com/spf13/afero"
)

func TestStoreRoundTrip(t *testing.T) {
	fsys := afero.NewMemMapFs()
	s := NewStore(fsys, "/state/node.json")
	st, err := s.Load()
	if err != nil || st != nil {
		t.Fatalf("Load() on empty disk = %v, %v; want nil, nil", st, err)
	}
	want := &State{Role: RoleInit, ClusterID: "ab", CompletedPhases: []string{"preflight"}}
	if err := s.Save(want); err != nil {
		t.Fatal(err)
	}
	got, err := s.Load()
	if err != nil || got.Role != RoleInit || !got.Completed("preflight") || got.Completed("certs") || got.Done {
		t.Fatalf("Load() = %+v, %v", got, err)
	}
	info, err := fsys.Stat("/state/node.json")
	if err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("state file mode = %v, %v; want 0600", info.Mode(), err)
	}
	if err := afero.WriteFile(fsys, "/state/node.json", []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Load(); err == nil {
		t.Fatal("Load() of corrupt state = nil error")
	}
}
