package clusterkeys

import (
	"bytes"
	"errors"
	"testing"
)

func TestDerivations(t *testing.T) {
	master := bytes.Repeat([]byte{1}, 32)
	salt := bytes.Repeat([]byte{2}, 32)
	k, err := New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	k2, _ := New(master, bytes.Repeat([]byte{3}, 32))
	if bytes.Equal(k.ClusterID(), k2.ClusterID()) {
		t.Error("cluster ID does not depend on the salt")
	}
	if !bytes.Equal(k.ClusterID(), k.ClusterID()) {
		t.Error("cluster ID is not deterministic")
	}
	if bytes.Equal(k.ClusterID(), k.MeasurementSecret()) {
		t.Error("cluster ID equals measurement secret")
	}
	if !bytes.Equal(k.DiskKey("ABC-def"), k.DiskKey("abc-DEF")) {
		t.Error("disk key depends on UUID case")
	}
	if bytes.Equal(k.DiskKey("a"), k.DiskKey("b")) {
		t.Error("disk keys of two disks are equal")
	}
	if len(k.ClusterID()) != KeySize {
		t.Errorf("len(ClusterID()) = %d", len(k.ClusterID()))
	}
	if _, err := New(master[:31], salt); !errors.Is(err, ErrBadInput) {
		t.Errorf("New(short master) = %v, want ErrBadInput", err)
	}
}
