package bootstage

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

// checkInAnswer scripts the cluster's answer to the check-in and records it.
func (f *fixture) checkInAnswer(revoked bool, err error) {
	f.cfg.CheckIn = func(_ context.Context, diskUUID string, clusterID []byte) (bool, error) {
		f.rec.add("checkin %s", diskUUID)
		return revoked, err
	}
}

// TestOpenSealedChecksIn: after the sealed key opened the disk and before the lock register is
// extended (the cluster's policy admits a node whose register is zero), the node checks in; admitted,
// or with no joinservice answering within the check-in's bound, it boots on.
func TestOpenSealedChecksIn(t *testing.T) {
	for name, err := range map[string]error{"admitted": nil, "no answer": errors.New("no joinservice answered the check-in after 8 rounds")} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			key, cluster := randomBytes(t, 32), randomBytes(t, 32)
			f.boundDisk(key, cluster)
			f.sealer.key, f.sealer.unsealErr = key, nil
			f.checkInAnswer(false, err)

			res, err := New(f.cfg).Open(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			if res.Source != SourceSealed {
				t.Errorf("source = %q; want sealed", res.Source)
			}
			wantCalls(t, f.rec, []string{"sealer.Unseal blob-0", "disk.Open", "checkin " + testUUID, lockMark(cluster)}, bindCalls())
		})
	}
}

// TestOpenRevokedLocksAndWaits: the cluster answers the check-in REVOKED. The node destroys its
// sealed key, closes the disk again before anything is extended or mounted, and waits for a key from
// the cluster: its rejoins are refused REVOKED until berth node readmit, then it opens the disk with
// the rejoin ticket's key and seals it again.
func TestOpenRevokedLocksAndWaits(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.key, f.sealer.unsealErr = key, nil
		f.cfg.RefusedBackoff = time.Second
		f.checkInAnswer(true, nil)
		revoked := errors.New("rejoin refused: REVOKED")
		f.scriptRejoin(t, rejoinAnswer{err: revoked}, rejoinAnswer{key: key, cluster: cluster})
		f.cfg.Recover = f.waitingRecovery()

		res, err := New(f.cfg).Open(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if res.Source != SourceRejoin {
			t.Errorf("source = %q; want rejoin (after the re-admission)", res.Source)
		}
		calls := f.rec.list()
		want := []string{"sealer.Unseal blob-0", "disk.Open", "checkin " + testUUID, "disk.SetSealed ", "disk.Close"}
		if len(calls) < len(want) || !slices.Equal(calls[:len(want)], want) {
			t.Fatalf("calls = %q; want them to begin %q (no extend, no mount before the lock)", calls, want)
		}
		if f.rec.count("rejoin") != 2 || f.rec.count(lockMark(cluster)) != 1 {
			t.Errorf("calls = %q; want two rejoins and one extend after them", calls)
		}
		if got := f.sealer.sealedSecrets(); len(got) != 1 || !bytes.Equal(got[0], key) {
			t.Errorf("sealed %d keys after the re-admission; want the disk key once", len(got))
		}
		if f.logs.FilterMessageSnippet("this machine was removed from the cluster").Len() != 1 {
			t.Error("the lock is not logged")
		}
	})
}
