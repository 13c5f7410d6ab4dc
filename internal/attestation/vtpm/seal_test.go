package vtpm_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// bootPCRs stand for the PCRs a measured boot extends (firmware, boot loader, kernel, command line).
var bootPCRs = []uint{0, 4, 7, 9}

// testTPM is a TPM that can be rebooted.
type testTPM struct {
	open  vtpm.OpenFunc
	reset func(ctx context.Context) error
}

func simulatorTPM(t testing.TB) testTPM {
	open, _, sim := newSimulator(t)
	return testTPM{open: open, reset: func(context.Context) error { return sim.Reset() }}
}

func swtpmTPM(t testing.TB) testTPM {
	sw := vtpmtest.StartSwtpm(t, vtpmtest.NewSwtpmCA(t))
	return testTPM{open: sw.Open, reset: sw.Reset}
}

// withTPM runs f on a fresh TPM.
func withTPM(t testing.TB, open vtpm.OpenFunc, f func(transport.TPM) error) {
	t.Helper()
	rwc, err := open(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rwc.Close() }()
	if err := f(transport.FromReadWriter(rwc)); err != nil {
		t.Fatal(err)
	}
}

// extend extends pcr's SHA-256 bank with the digest of data.
func extend(t testing.TB, open vtpm.OpenFunc, pcr uint, data string) {
	t.Helper()
	d := sha256.Sum256([]byte(data))
	withTPM(t, open, func(tpm transport.TPM) error {
		_, err := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(pcr), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: d[:]}}},
		}.Execute(tpm)
		return err
	})
}

// boot measures a boot into the boot PCRs of a freshly reset TPM; the same image measures the same.
func boot(t testing.TB, tpm testTPM, image string) {
	t.Helper()
	for _, p := range bootPCRs {
		extend(t, tpm.open, p, fmt.Sprintf("%s: PCR %d", image, p))
	}
}

// reboot resets the TPM as a power cycle does and measures image again.
func reboot(t testing.TB, tpm testTPM, image string) {
	t.Helper()
	if err := tpm.reset(context.Background()); err != nil {
		t.Fatalf("resetting TPM: %v", err)
	}
	boot(t, tpm, image)
}

// clearTPM runs TPM2_Clear with the (empty) lockout authorization, as tpm2_clear does.
func clearTPM(t testing.TB, open vtpm.OpenFunc) {
	t.Helper()
	withTPM(t, open, func(tpm transport.TPM) error {
		_, err := tpm2.Clear{AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHLockout, Auth: tpm2.PasswordAuth(nil)}}.Execute(tpm)
		return err
	})
}

func TestSealSimulator(t *testing.T) { sealLifecycle(t, simulatorTPM(t)) }

func TestSealSwtpm(t *testing.T) { sealLifecycle(t, swtpmTPM(t)) }

// sealLifecycle walks a node's boots: seal after the lock is taken, unseal on the next boot before it,
// and every way the sealed key must stop working.
func sealLifecycle(t *testing.T, tpm testTPM) {
	ctx := context.Background()
	sealer := vtpm.NewSealer(tpm.open, bootPCRs, vtpm.DefaultLockPCR)
	lock := vtpm.NewLockRegister(tpm.open, vtpm.DefaultLockPCR)
	secret := bytes.Repeat([]byte{0x5a}, 32)
	clusterID := []byte("cluster-id")
	mustUnseal := func(t *testing.T, blob, want []byte) {
		t.Helper()
		got, err := sealer.Unseal(ctx, blob)
		if err != nil {
			t.Fatalf("Unseal: %v", err)
		}
		if !bytes.Equal(got, want) {
			t.Fatal("Unseal returned another secret")
		}
	}
	wantErr := func(t *testing.T, blob []byte, want error) {
		t.Helper()
		_, err := sealer.Unseal(ctx, blob)
		t.Logf("Unseal: %v", err)
		if !errors.Is(err, want) {
			t.Fatalf("Unseal: got %v, want %v", err, want)
		}
		if err != nil && bytes.Contains([]byte(err.Error()), secret) {
			t.Fatal("error text contains the secret")
		}
	}

	boot(t, tpm, "image v1")
	blob, err := sealer.Seal(ctx, secret)
	if err != nil {
		t.Fatalf("Seal: %v", err)
	}
	if bytes.Contains(blob, secret) {
		t.Fatal("sealed blob contains the secret in the clear")
	}

	t.Run("round trip", func(t *testing.T) { mustUnseal(t, blob, secret) })

	t.Run("lock register extended", func(t *testing.T) {
		if err := lock.MarkBootstrapped(ctx, clusterID); err != nil {
			t.Fatal(err)
		}
		wantErr(t, blob, vtpm.ErrSealPolicy)
	})

	var sealedLocked []byte
	secret2 := bytes.Repeat([]byte{0xa5}, 32)
	t.Run("sealed after the lock, unsealed on the next boot", func(t *testing.T) {
		// The node seals after it took the lock: the policy wants the lock PCR zero all the same.
		if sealedLocked, err = sealer.Seal(ctx, secret2); err != nil {
			t.Fatalf("Seal: %v", err)
		}
		wantErr(t, sealedLocked, vtpm.ErrSealPolicy)
		reboot(t, tpm, "image v1")
		mustUnseal(t, sealedLocked, secret2)
		mustUnseal(t, blob, secret)
	})

	t.Run("boot PCR extended", func(t *testing.T) {
		extend(t, tpm.open, bootPCRs[1], "something else ran")
		wantErr(t, sealedLocked, vtpm.ErrSealPolicy)
	})

	t.Run("boot measured differently", func(t *testing.T) {
		reboot(t, tpm, "image v2")
		wantErr(t, sealedLocked, vtpm.ErrSealPolicy)
		reboot(t, tpm, "image v1")
		mustUnseal(t, sealedLocked, secret2)
	})

	t.Run("corrupted blob", func(t *testing.T) {
		flip := func(i int) []byte {
			b := append([]byte(nil), sealedLocked...)
			b[i] ^= 0x01
			return b
		}
		for name, b := range map[string][]byte{
			"empty":           nil,
			"unknown version": flip(0),
			"truncated":       sealedLocked[:len(sealedLocked)-1],
			"trailing byte":   append(append([]byte(nil), sealedLocked...), 0),
			"private flipped": flip(len(sealedLocked) - 5),
			"policy flipped":  flip(30), // inside the public area's authPolicy: the lock requirement cannot be edited out
			"garbage":         []byte("\x01\x00\x02garbage"),
		} {
			t.Run(name, func(t *testing.T) { wantErr(t, b, vtpm.ErrSealedKeyUnusable) })
		}
		mustUnseal(t, sealedLocked, secret2)
	})

	t.Run("TPM cleared", func(t *testing.T) {
		clearTPM(t, tpm.open)
		wantErr(t, sealedLocked, vtpm.ErrSealedKeyUnusable)
		wantErr(t, blob, vtpm.ErrSealedKeyUnusable)
		// The cleared TPM seals and unseals anew.
		fresh, err := sealer.Seal(ctx, secret)
		if err != nil {
			t.Fatalf("Seal after clear: %v", err)
		}
		mustUnseal(t, fresh, secret)
	})

	t.Run("lock register only", func(t *testing.T) {
		only := vtpm.NewSealer(tpm.open, []uint{vtpm.DefaultLockPCR}, vtpm.DefaultLockPCR)
		b, err := only.Seal(ctx, secret)
		if err != nil {
			t.Fatalf("Seal: %v", err)
		}
		if got, err := only.Unseal(ctx, b); err != nil || !bytes.Equal(got, secret) {
			t.Fatalf("Unseal: %v", err)
		}
	})

	t.Run("secret size", func(t *testing.T) {
		for _, n := range []int{0, 129} {
			if _, err := sealer.Seal(ctx, make([]byte, n)); err == nil {
				t.Errorf("sealed a %d-byte secret", n)
			}
		}
	})
}

// TestSealFlushesHandles checks that Seal and Unseal, also when they fail, leave no transient object
// or session behind (swtpm has no resource manager).
func TestSealFlushesHandles(t *testing.T) {
	tpm := swtpmTPM(t)
	ctx := context.Background()
	sealer := vtpm.NewSealer(tpm.open, bootPCRs, vtpm.DefaultLockPCR)
	blob, err := sealer.Seal(ctx, []byte("secret"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sealer.Unseal(ctx, blob); err != nil {
		t.Fatal(err)
	}
	extend(t, tpm.open, bootPCRs[0], "changed")
	if _, err := sealer.Unseal(ctx, blob); !errors.Is(err, vtpm.ErrSealPolicy) {
		t.Fatalf("got %v, want ErrSealPolicy", err)
	}
	bad := append([]byte(nil), blob...)
	bad[len(bad)-5] ^= 1
	if _, err := sealer.Unseal(ctx, bad); !errors.Is(err, vtpm.ErrSealedKeyUnusable) {
		t.Fatalf("got %v, want ErrSealedKeyUnusable", err)
	}
	for _, first := range []tpm2.TPMHandle{0x80000000, 0x02000000, 0x03000000} { // transient, HMAC/loaded and policy sessions
		withTPM(t, tpm.open, func(c transport.TPM) error {
			rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: uint32(first), PropertyCount: 64}.Execute(c)
			if err != nil {
				return err
			}
			hs, err := rsp.CapabilityData.Data.Handles()
			if err != nil {
				return err
			}
			var left []tpm2.TPMHandle
			for _, h := range hs.Handle {
				if h>>24 == first>>24 {
					left = append(left, h)
				}
			}
			if len(left) != 0 {
				return fmt.Errorf("handles left behind: %#x", left)
			}
			return nil
		})
	}
}

// TestSealOtherTPM: a blob sealed in one TPM does not load in another.
func TestSealOtherTPM(t *testing.T) {
	ctx := context.Background()
	ca := vtpmtest.NewSwtpmCA(t)
	a, b := vtpmtest.StartSwtpm(t, ca), vtpmtest.StartSwtpm(t, ca)
	blob, err := vtpm.NewSealer(a.Open, bootPCRs, vtpm.DefaultLockPCR).Seal(ctx, []byte("secret"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vtpm.NewSealer(b.Open, bootPCRs, vtpm.DefaultLockPCR).Unseal(ctx, blob); !errors.Is(err, vtpm.ErrSealedKeyUnusable) {
		t.Fatalf("got %v, want ErrSealedKeyUnusable", err)
	}
}

// TestMachineIdentity: the node's MachineIdentity is the Result.Identity the validator reports for its
// documents, on plain and on activation-bound validation; it is stable per TPM and differs between TPMs.
func TestMachineIdentity(t *testing.T) {
	ctx := context.Background()
	ca := vtpmtest.NewSwtpmCA(t)
	a, b := vtpmtest.StartSwtpm(t, ca), vtpmtest.StartSwtpm(t, ca)
	issA, issB := vtpm.NewIssuer(a.Open, zap.NewNop()), vtpm.NewIssuer(b.Open, zap.NewNop())
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	idA, err := issA.MachineIdentity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	idB, err := issB.MachineIdentity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(idA) != sha256.Size || bytes.Equal(idA, idB) {
		t.Fatalf("identities %x and %x: want two different SHA-256 digests", idA, idB)
	}
	again, err := vtpm.NewIssuer(a.Open, zap.NewNop()).MachineIdentity(ctx)
	if err != nil || !bytes.Equal(again, idA) {
		t.Fatalf("second issuer on the same TPM: %x, %v; want %x", again, err, idA)
	}

	nonce := []byte("nonce")
	for name, tc := range map[string]struct {
		iss  *vtpm.Issuer
		want []byte
	}{"A": {issA, idA}, "B": {issB, idB}} {
		t.Run(name+" plain", func(t *testing.T) {
			doc, err := tc.iss.Issue(ctx, nil, nonce)
			if err != nil {
				t.Fatal(err)
			}
			res, err := v.Validate(ctx, doc, nonce)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(res.Identity, tc.want) {
				t.Fatalf("Result.Identity = %x, want %x", res.Identity, tc.want)
			}
		})
		t.Run(name+" activated", func(t *testing.T) {
			rawID, err := tc.iss.Identity(ctx)
			if err != nil {
				t.Fatal(err)
			}
			challenge, secret, validate, err := v.Challenge(rawID)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tc.iss.Activate(ctx, challenge)
			if err != nil {
				t.Fatal(err)
			}
			doc, err := tc.iss.Issue(ctx, nil, mixed(nonce, got))
			if err != nil {
				t.Fatal(err)
			}
			res, err := validate(ctx, doc, mixed(nonce, secret))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(res.Identity, tc.want) {
				t.Fatalf("Result.Identity = %x, want %x", res.Identity, tc.want)
			}
		})
	}
}

func benchSeal(b *testing.B, tpm testTPM, unseal bool) {
	ctx := context.Background()
	boot(b, tpm, "image v1")
	sealer := vtpm.NewSealer(tpm.open, bootPCRs, vtpm.DefaultLockPCR)
	secret := make([]byte, 32)
	blob, err := sealer.Seal(ctx, secret)
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if unseal {
			_, err = sealer.Unseal(ctx, blob)
		} else {
			_, err = sealer.Seal(ctx, secret)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(blob)), "blob-bytes")
}

// BenchmarkSeal prints the cost of sealing a 32-byte key (SRK re-derived each time).
func BenchmarkSeal(b *testing.B) {
	b.Run("simulator", func(b *testing.B) { benchSeal(b, simulatorTPM(b), false) })
	b.Run("swtpm", func(b *testing.B) { benchSeal(b, swtpmTPM(b), false) })
}

// BenchmarkUnseal prints the cost of unsealing on boot (SRK re-derived each time).
func BenchmarkUnseal(b *testing.B) {
	b.Run("simulator", func(b *testing.B) { benchSeal(b, simulatorTPM(b), true) })
	b.Run("swtpm", func(b *testing.B) { benchSeal(b, swtpmTPM(b), true) })
}

// BenchmarkSRK compares re-deriving the ECC SRK (TPM2_CreatePrimary + flush, what the Sealer does)
// with what a persistent SRK would cost instead (TPM2_ReadPublic of its handle to check it).
func BenchmarkSRK(b *testing.B) {
	for name, mk := range map[string]func(testing.TB) testTPM{"simulator": simulatorTPM, "swtpm": swtpmTPM} {
		b.Run(name, func(b *testing.B) {
			tpm := mk(b)
			rwc, err := tpm.open(context.Background())
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = rwc.Close() }()
			c := transport.FromReadWriter(rwc)
			create := func() *tpm2.CreatePrimaryResponse {
				rsp, err := tpm2.CreatePrimary{
					PrimaryHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
					InPublic:      tpm2.New2B(tpm2.ECCSRKTemplate),
				}.Execute(c)
				if err != nil {
					b.Fatal(err)
				}
				return rsp
			}
			b.Run("create-primary", func(b *testing.B) {
				for b.Loop() {
					rsp := create()
					if _, err := (tpm2.FlushContext{FlushHandle: rsp.ObjectHandle}).Execute(c); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("persistent-read-public", func(b *testing.B) {
				const handle = tpm2.TPMHandle(0x81000001)
				rsp := create()
				if _, err := (tpm2.EvictControl{
					Auth:             tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
					ObjectHandle:     tpm2.NamedHandle{Handle: rsp.ObjectHandle, Name: rsp.Name},
					PersistentHandle: handle,
				}).Execute(c); err != nil {
					b.Fatal(err)
				}
				_, _ = tpm2.FlushContext{FlushHandle: rsp.ObjectHandle}.Execute(c)
				for b.Loop() {
					if _, err := (tpm2.ReadPublic{ObjectHandle: handle}).Execute(c); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}

func TestSealBootPhaseSimulator(t *testing.T) { sealBootPhase(t, simulatorTPM(t)) }

func TestSealBootPhaseSwtpm(t *testing.T) { sealBootPhase(t, swtpmTPM(t)) }

// sealBootPhase: a key sealed with a phase PCR unseals once per boot, before the boot stage marks
// the state disk open; after the mark the same boot cannot unseal it again, the next boot can.
func sealBootPhase(t *testing.T, tpm testTPM) {
	ctx := context.Background()
	const phasePCR = 13
	sealer := vtpm.NewSealer(tpm.open, bootPCRs, vtpm.DefaultLockPCR, phasePCR)
	phase := vtpm.NewBootPhase(tpm.open, phasePCR)
	secret := bytes.Repeat([]byte{0xa5}, 32)

	boot(t, tpm, "image v1")
	if err := phase.MarkStateDiskOpen(ctx); err != nil {
		t.Fatal(err)
	}
	// Sealed after the phase was marked (as Bind does): the policy still wants the phase PCR zero.
	blob, err := sealer.Seal(ctx, secret)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sealer.Unseal(ctx, blob); !errors.Is(err, vtpm.ErrSealPolicy) {
		t.Fatalf("Unseal after the phase in the sealing boot = %v; want ErrSealPolicy", err)
	}

	reboot(t, tpm, "image v1")
	got, err := sealer.Unseal(ctx, blob)
	if err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("first Unseal of the next boot = %v; want the secret", err)
	}
	if err := phase.MarkStateDiskOpen(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = sealer.Unseal(ctx, blob)
	t.Logf("second Unseal in the same boot: %v", err)
	if !errors.Is(err, vtpm.ErrSealPolicy) {
		t.Fatalf("second Unseal in the same boot = %v; want ErrSealPolicy", err)
	}
	// A restarted daemon marks again: nothing changes.
	if err := phase.MarkStateDiskOpen(ctx); err != nil {
		t.Fatalf("marking the phase twice = %v; want nil", err)
	}
	withTPM(t, tpm.open, func(c transport.TPM) error {
		rsp, err := tpm2.PCRRead{PCRSelectionIn: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
			Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(phasePCR),
		}}}}.Execute(c)
		if err != nil {
			return err
		}
		if got := rsp.PCRValues.Digests[0].Buffer; !bytes.Equal(got, vtpm.ExpectedPhaseValue(vtpm.StateDiskOpenEvent)) {
			t.Errorf("phase PCR = %x; want %x", got, vtpm.ExpectedPhaseValue(vtpm.StateDiskOpenEvent))
		}
		return nil
	})

	// Anything else measured into the phase PCR: the mark refuses, the key does not unseal.
	reboot(t, tpm, "image v1")
	extend(t, tpm.open, phasePCR, "a system extension")
	if err := phase.MarkStateDiskOpen(ctx); !errors.Is(err, vtpm.ErrPhaseUnexpected) {
		t.Errorf("MarkStateDiskOpen over a foreign value = %v; want ErrPhaseUnexpected", err)
	}
	if _, err := sealer.Unseal(ctx, blob); !errors.Is(err, vtpm.ErrSealPolicy) {
		t.Errorf("Unseal with a foreign value in the phase PCR = %v; want ErrSealPolicy", err)
	}
}
