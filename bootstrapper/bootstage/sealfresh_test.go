package bootstage

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/statedisk"
)

// powerCycle closes the fake disk as a reboot does.
func (d *fakeDisk) powerCycle() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.opened = false
}

// freshSealedBoot runs a first boot with SealFresh on the fixture: the disk is formatted, its key
// sealed as blob-1, and leftover is written on it. It returns the fresh key and the stage.
func freshSealedBoot(t *testing.T, f *fixture) ([]byte, *Stage) {
	t.Helper()
	f.cfg.SealFresh = true
	s := New(f.cfg)
	res, err := s.Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceFresh {
		t.Fatalf("first boot: source %q; want fresh", res.Source)
	}
	wantCalls(t, f.rec, []string{"disk.Format", "disk.SetMAC", "sealer.Seal", "disk.SetSealed blob-1"}, bindCalls())
	key := f.disk.formatKeys[0]
	if sealed := f.sealer.sealedSecrets(); len(sealed) != 1 || !bytes.Equal(sealed[0], key) {
		t.Fatal("the fresh key was not sealed")
	}
	h, _ := f.disk.Header(t.Context())
	if !statedisk.VerifyHeaderMAC(key, h) {
		t.Fatal("the fresh disk's header MAC does not verify under its key")
	}
	if err := os.WriteFile(filepath.Join(f.disk.Root(), "leftover"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	f.disk.powerCycle()
	f.mounter.mu.Lock()
	clear(f.mounter.bound)
	f.mounter.mu.Unlock()
	f.rec.calls = nil
	return key, s
}

func TestOpenNeverBoundSealedFreshUnseals(t *testing.T) {
	f := newFixture(t)
	key, _ := freshSealedBoot(t, f)
	f.sealer.key, f.sealer.unsealErr = key, nil

	s := New(f.cfg)
	res, err := s.Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceSealed || res.Wiped != "" || res.ClusterID != nil || res.UUID != f.disk.header.UUID {
		t.Errorf("result = %+v; want the unbound disk opened with its sealed key, nothing wiped", res)
	}
	// Unsealed and opened, no format, no lock extension (no cluster), nothing sealed again.
	wantCalls(t, f.rec, []string{"sealer.Unseal blob-1", "disk.Open"}, bindCalls())
	if _, err := os.Stat(filepath.Join(f.disk.Root(), "leftover")); err != nil {
		t.Errorf("the first boot's data is gone: %v", err)
	}
	if f.lock.bootstrapped {
		t.Error("an unbound disk extended the lock register")
	}
	// It is still a fresh node: init or join binds it, re-keying from the unsealed key.
	diskKey, cluster := randomBytes(t, 32), randomBytes(t, 32)
	if err := s.Bind(t.Context(), diskKey, cluster, []byte("b")); err != nil {
		t.Fatalf("Bind after a sealed fresh boot = %v", err)
	}
	if len(f.disk.rekeys) != 1 || !bytes.Equal(f.disk.rekeys[0][0], key) || !bytes.Equal(f.disk.slotKey(), diskKey) {
		t.Error("Bind did not re-key from the unsealed fresh key to the disk key")
	}
}

func TestOpenNeverBoundSealedFreshWiped(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, f *fixture, key []byte)
		calls []string
	}{
		{
			name: "the TPM refuses the sealed key",
			setup: func(_ *testing.T, f *fixture, _ []byte) {
				f.sealer.unsealErr = errSealPolicy
			},
			calls: []string{"sealer.Unseal blob-1"},
		},
		{
			name: "SealFresh is off in this boot",
			setup: func(_ *testing.T, f *fixture, key []byte) {
				f.sealer.key, f.sealer.unsealErr = key, nil
				f.cfg.SealFresh = false
			},
		},
		{
			name: "an init began before the reboot",
			setup: func(t *testing.T, f *fixture, key []byte) {
				f.sealer.key, f.sealer.unsealErr = key, nil
				f.disk.mu.Lock()
				f.disk.opened = true
				f.disk.mu.Unlock()
				f.writeNodeState(t, &nodestate.State{Role: nodestate.RoleInit})
				f.disk.powerCycle()
			},
			calls: []string{"sealer.Unseal blob-1", "disk.Open", "disk.Close"},
		},
		{
			name: "the header was rewritten",
			setup: func(_ *testing.T, f *fixture, key []byte) {
				f.sealer.key, f.sealer.unsealErr = key, nil
				f.disk.rewriteHeader(func(h *statedisk.Header) { h.Binding = []byte("planted") })
			},
			calls: []string{"sealer.Unseal blob-1", "disk.Open", "disk.Close"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			key, _ := freshSealedBoot(t, f)
			tc.setup(t, f, key)
			f.rec.calls = nil
			res, err := New(f.cfg).Open(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			if res.Source != SourceFresh || res.Wiped == "" {
				t.Errorf("result = %+v; want the disk wiped and formatted afresh", res)
			}
			format := []string{"disk.Format"}
			if f.cfg.SealFresh {
				format = append(format, "disk.SetMAC", "sealer.Seal", "disk.SetSealed blob-1")
			}
			wantCalls(t, f.rec, tc.calls, format, bindCalls())
			if _, err := os.Stat(filepath.Join(f.disk.Root(), "leftover")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the never bound disk's data survived: %v", err)
			}
		})
	}
}

func TestOpenRecordsBoot(t *testing.T) {
	f := newFixture(t)
	f.cfg.BootID = "first-boot-id"
	key, _ := freshSealedBoot(t, f)
	if b, err := os.ReadFile(filepath.Join(f.disk.Root(), bootRecord)); err != nil || string(b) != "first-boot-id\n" {
		t.Fatalf("boot record after the first boot = %q, %v", b, err)
	}
	if n := f.logs.FilterMessage("state disk boot record").FilterField(zap.String("previousBootID", "")).Len(); n != 1 {
		t.Errorf("first boot logged %d boot records without a previous boot; want 1", n)
	}
	f.sealer.key, f.sealer.unsealErr = key, nil
	f.cfg.BootID = "second-boot-id"
	if _, err := New(f.cfg).Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if n := f.logs.FilterMessage("state disk boot record").FilterField(zap.String("previousBootID", "first-boot-id")).Len(); n != 1 {
		t.Errorf("the second boot logged %d records naming the first boot; want 1", n)
	}
	if b, _ := os.ReadFile(filepath.Join(f.disk.Root(), bootRecord)); string(b) != "second-boot-id\n" {
		t.Errorf("boot record after the second boot = %q", b)
	}
}

// fakePhase is a boot phase register; its first fails calls fail with err.
type fakePhase struct {
	rec   *recorder
	err   error
	fails int

	mu    sync.Mutex
	calls int
}

func (p *fakePhase) MarkStateDiskOpen(context.Context) error {
	p.rec.add("phase.Mark")
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.calls <= p.fails {
		return p.err
	}
	return nil
}

func TestOpenMarksPhaseLast(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, f *fixture)
		calls []string
	}{
		{name: "fresh disk", setup: func(*testing.T, *fixture) {}, calls: []string{"disk.Format"}},
		{
			name: "sealed key",
			setup: func(t *testing.T, f *fixture) {
				key, cluster := randomBytes(t, 32), randomBytes(t, 32)
				f.boundDisk(key, cluster)
				f.sealer.key, f.sealer.unsealErr = key, nil
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			tc.setup(t, f)
			phase := &fakePhase{rec: f.rec}
			f.cfg.Phase = phase
			if _, err := New(f.cfg).Open(testCtx(t)); err != nil {
				t.Fatal(err)
			}
			calls := f.rec.list()
			if n := f.rec.count("phase.Mark"); n != 1 || calls[len(calls)-1] != "phase.Mark" {
				t.Errorf("calls %q; want the phase marked once, after everything else", calls)
			}
		})
	}
	t.Run("marking fails", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t)
			f.cfg.Phase = &fakePhase{rec: f.rec, err: errors.New("TPM gone"), fails: phaseAttempts}
			if _, err := New(f.cfg).Open(testCtx(t)); err == nil || !strings.Contains(err.Error(), "TPM gone") {
				t.Errorf("Open = %v; want the phase error", err)
			}
			if n := f.rec.count("phase.Mark"); n != phaseAttempts {
				t.Errorf("marked %d times; want %d attempts", n, phaseAttempts)
			}
		})
	})
	t.Run("marking fails once", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t)
			f.cfg.Phase = &fakePhase{rec: f.rec, err: errors.New("reading TPM response: EOF"), fails: 1}
			if _, err := New(f.cfg).Open(testCtx(t)); err != nil {
				t.Errorf("Open = %v; want the second attempt to mark the phase", err)
			}
			if n := f.rec.count("phase.Mark"); n != 2 {
				t.Errorf("marked %d times; want 2", n)
			}
		})
	})
}
