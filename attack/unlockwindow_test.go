package attack

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/bootstrapper/bootstage"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/statedisk"
)

// TestUnlockWindowClosed attacks a node after its boot stage: root on the running node takes the
// sealed blob from the state disk's header and asks the node's own TPM to unseal it, in the same
// boot in which the stage unsealed it. With the boot phase (the image's --phase-pcr 13) the TPM
// refuses; without it (the control) the same attack gets the disk key, so the test fails when the
// phase is not marked or not part of the seal policy.
func TestUnlockWindowClosed(t *testing.T) {
	requireStateDisk(t)
	const phasePCR = 13
	for _, tc := range []struct {
		name      string
		phase     bool
		wantError error
	}{
		{name: "phase marked", phase: true, wantError: vtpm.ErrSealPolicy},
		{name: "no phase (control)", phase: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tpm := vtpmtest.StartSwtpm(t, vtpmtest.NewSwtpmCA(t))
			dir := t.TempDir()
			disk := statedisk.NewFscrypt(filepath.Join(dir, "state.img"), filepath.Join(dir, "mnt"), statedisk.Exec{}, zap.NewNop(), statedisk.WithImageSize(testImageSize))
			t.Cleanup(func() { _ = disk.Close(context.Background()) })
			var zeros []uint
			cfg := bootstage.Config{Log: zap.NewNop(), Disk: disk, SealFresh: true}
			if tc.phase {
				zeros = []uint{phasePCR}
				cfg.Phase = vtpm.NewBootPhase(tpm.Open, phasePCR)
			}
			sealer := vtpm.NewSealer(tpm.Open, []uint{4, 9, 11, 12}, vtpm.DefaultLockPCR, zeros...)
			cfg.Sealer = sealer

			// First boot: a fresh disk, its key sealed. Then a reboot: the stage unseals it.
			res, err := bootstage.New(cfg).Open(t.Context())
			if err != nil || res.Source != bootstage.SourceFresh {
				t.Fatalf("first boot: %+v, %v", res, err)
			}
			if err := disk.Close(t.Context()); err != nil {
				t.Fatal(err)
			}
			if err := tpm.Reset(t.Context()); err != nil {
				t.Fatal(err)
			}
			res, err = bootstage.New(cfg).Open(t.Context())
			if err != nil || res.Source != bootstage.SourceSealed {
				t.Fatalf("reboot: %+v, %v; want the disk opened with its sealed key", res, err)
			}

			// The attack: the header is plaintext on the disk; the TPM is the node's.
			h, err := disk.Header(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			key, err := sealer.Unseal(t.Context(), h.Sealed)
			t.Logf("unsealing again in the same boot: %d key bytes, %v", len(key), err)
			switch {
			case tc.wantError != nil && !errors.Is(err, tc.wantError):
				t.Fatalf("second unseal in the same boot = %v; want %v", err, tc.wantError)
			case tc.wantError == nil && err != nil:
				t.Fatalf("control: second unseal without a phase = %v; want the key (else the test cannot fail)", err)
			}
		})
	}
}
