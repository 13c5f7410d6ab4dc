package bootstage

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
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

// laterCheckIns are the check-ins of KeepCheckingIn in the tests: every ten seconds, fake time.
var laterCheckIns = wait.Backoff{Duration: 10 * time.Second, Factor: 1, Steps: math.MaxInt32}

// checkInScript answers the check-in from answers, one a call; the boot's check-in takes the first.
// Past the end it answers with no joinservice reachable.
type checkInScript struct {
	answers []checkInReply
	calls   atomic.Int64
}

type checkInReply struct {
	revoked bool
	err     error
}

var errNoAnswer = errors.New("no joinservice answered the check-in after 8 rounds")

func (f *fixture) scriptCheckIn(answers ...checkInReply) *checkInScript {
	s := &checkInScript{answers: answers}
	f.cfg.CheckIn = func(_ context.Context, diskUUID string, _ []byte) (bool, error) {
		i := int(s.calls.Add(1)) - 1
		f.rec.add("checkin %s", diskUUID)
		if i >= len(s.answers) {
			return false, errNoAnswer
		}
		return s.answers[i].revoked, s.answers[i].err
	}
	return s
}

// bootWithoutAnswer opens a bound disk with its sealed key while no joinservice answers the check-in.
func (f *fixture) bootWithoutAnswer(t *testing.T, answers ...checkInReply) (*Stage, *checkInScript) {
	t.Helper()
	key, cluster := randomBytes(t, 32), randomBytes(t, 32)
	f.boundDisk(key, cluster)
	f.sealer.key, f.sealer.unsealErr = key, nil
	f.cfg.LaterCheckIns = laterCheckIns
	script := f.scriptCheckIn(append([]checkInReply{{err: errNoAnswer}}, answers...)...)
	s := New(f.cfg)
	if res, err := s.Open(testCtx(t)); err != nil || res.Source != SourceSealed {
		t.Fatalf("Open() = %+v, %v; want the sealed key to boot the node", res, err)
	}
	if !s.CheckInPending() {
		t.Fatal("no check-in pending after a boot that nobody answered")
	}
	return s, script
}

// stopper records the kubelet's stop.
func (f *fixture) stopper() func(context.Context) error {
	return func(context.Context) error { f.rec.add("kubelet.Stop"); return nil }
}

// TestKeepCheckingInUntilAnswered: a node that booted without an answer asks again in the background
// until a joinservice answers; admitted on the fourth later ask, it stops asking and leaves the node
// running (nothing locked, nothing stopped, nothing unmounted).
func TestKeepCheckingInUntilAnswered(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		s, script := f.bootWithoutAnswer(t, checkInReply{err: errNoAnswer}, checkInReply{err: errNoAnswer}, checkInReply{err: errNoAnswer}, checkInReply{})
		start := time.Now()
		if err := s.KeepCheckingIn(testCtx(t), f.stopper()); err != nil {
			t.Fatalf("KeepCheckingIn() = %v; want nil once admitted", err)
		}
		if got := script.calls.Load(); got != 5 {
			t.Errorf("%d check-ins; want 5 (the boot's and four later ones, the last admitted)", got)
		}
		if took := time.Since(start); took != 40*time.Second {
			t.Errorf("admitted after %s; want four waits of 10 s", took)
		}
		for _, c := range f.rec.list() {
			if c == "kubelet.Stop" || strings.HasPrefix(c, "disk.SetSealed") || c == "disk.Close" || strings.HasPrefix(c, "mount.Unmount") {
				t.Errorf("an admitted node was touched: %s", c)
			}
		}
		if s.CheckInPending() {
			t.Error("the check-in is still pending after the cluster admitted the node")
		}
		// Asked again, nothing is pending: it returns at once without a check-in.
		if err := s.KeepCheckingIn(testCtx(t), f.stopper()); err != nil || script.calls.Load() != 5 {
			t.Errorf("KeepCheckingIn() after the admission = %v with %d check-ins; want nil and no new check-in", err, script.calls.Load())
		}
		if f.logs.FilterMessage("checked in with the cluster after booting on the sealed key").Len() != 1 {
			t.Error("the late check-in is not logged")
		}
	})
}

// TestKeepCheckingInRevokedLocks: the first joinservice to answer after the boot says REVOKED. The
// node is locked as in the boot stage: the sealed key destroyed first, then the kubelet stopped, then
// the disk's directories unmounted and the disk closed, and the reason logged; KeepCheckingIn
// returns ErrRevoked.
func TestKeepCheckingInRevokedLocks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		s, script := f.bootWithoutAnswer(t, checkInReply{err: errNoAnswer}, checkInReply{revoked: true})
		booted := len(f.rec.list())
		err := s.KeepCheckingIn(testCtx(t), f.stopper())
		if !errors.Is(err, ErrRevoked) {
			t.Fatalf("KeepCheckingIn() = %v; want ErrRevoked", err)
		}
		if script.calls.Load() != 3 {
			t.Errorf("%d check-ins; want 3", script.calls.Load())
		}
		want := slices.Concat([]string{"checkin " + testUUID, "checkin " + testUUID, "disk.SetSealed ", "kubelet.Stop"}, unmountCalls(), []string{"disk.Close"})
		if got := f.rec.list()[booted:]; !slices.Equal(got, want) {
			t.Errorf("calls after the boot:\n got  %q\n want %q", got, want)
		}
		if len(f.disk.header.Sealed) != 0 || f.disk.isOpen() {
			t.Error("the sealed key survived or the disk is still open")
		}
		if f.logs.FilterMessageSnippet("this machine was removed from the cluster: locking the running node").Len() != 1 {
			t.Error("the lock and its reason are not logged")
		}
		if s.CheckInPending() {
			t.Error("the check-in is still pending after the node was locked")
		}
	})
}

// TestKeepCheckingInRevokedStopFails: when stop fails (a pod sandbox the container runtime cannot
// stop), the sealed key is still destroyed, but the disk's directories stay mounted and the disk
// open (what did not stop may still write to it); the failure is logged and returned with ErrRevoked.
func TestKeepCheckingInRevokedStopFails(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		s, _ := f.bootWithoutAnswer(t, checkInReply{revoked: true})
		booted := len(f.rec.list())
		refused := errors.New("1 of 3 pod sandboxes still there: stopping pod sandbox stuck: shim does not answer")
		err := s.KeepCheckingIn(testCtx(t), func(context.Context) error { f.rec.add("kubelet.Stop"); return refused })
		if !errors.Is(err, ErrRevoked) || !errors.Is(err, refused) {
			t.Fatalf("KeepCheckingIn() = %v; want ErrRevoked wrapping the stop's error", err)
		}
		want := []string{"checkin " + testUUID, "disk.SetSealed ", "kubelet.Stop"}
		if got := f.rec.list()[booted:]; !slices.Equal(got, want) {
			t.Errorf("calls after the boot:\n got  %q\n want %q", got, want)
		}
		if len(f.disk.header.Sealed) != 0 {
			t.Error("the sealed key survived a failed stop")
		}
		if !f.disk.isOpen() {
			t.Error("the disk was closed although what runs on it did not stop")
		}
		if f.logs.FilterMessageSnippet("stopping what runs on the state disk of the locked node failed").Len() != 1 {
			t.Error("the failed stop is not logged")
		}
	})
}

// TestKeepCheckingInRevokedUnmountsOthers: mounts of the disk the stage did not make (mini's
// containerd root, bound by the node's own script) come off before the stage's binds, each logged,
// one already gone with its peer (EINVAL) is passed over, and the disk closes.
func TestKeepCheckingInRevokedUnmountsOthers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		s, _ := f.bootWithoutAnswer(t, checkInReply{revoked: true})
		f.mounter.others = []string{"/var/lib/containerd", "/var/log"}
		f.mounter.gone = map[string]bool{"/var/log": true} // unmounted with a peer
		booted := len(f.rec.list())
		if err := s.KeepCheckingIn(testCtx(t), f.stopper()); !errors.Is(err, ErrRevoked) || strings.Contains(err.Error(), "not closed") {
			t.Fatalf("KeepCheckingIn() = %v; want ErrRevoked with the disk closed", err)
		}
		want := slices.Concat([]string{"checkin " + testUUID, "disk.SetSealed ", "kubelet.Stop", "mount.Unmount /var/lib/containerd", "mount.Unmount /var/log"},
			unmountCalls(), []string{"disk.Close"})
		if got := f.rec.list()[booted:]; !slices.Equal(got, want) {
			t.Errorf("calls after the boot:\n got  %q\n want %q", got, want)
		}
		if f.disk.isOpen() {
			t.Error("the disk is still open")
		}
		if got := f.logs.FilterMessage("unmounted a mount on the state disk").Len(); got != 1+len(unmountCalls()) {
			t.Errorf("%d unmounts logged, want %d", got, 1+len(unmountCalls()))
		}
		if f.logs.FilterMessage("a mount on the state disk was already gone").Len() != 1 {
			t.Error("the mount unmounted with its peer is not logged")
		}
	})
}

// TestKeepCheckingInRevokedMountBusy: a mount of the disk that stays busy (a process still holds a
// file in it) is reported by path and logged, and the disk stays open.
func TestKeepCheckingInRevokedMountBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		s, _ := f.bootWithoutAnswer(t, checkInReply{revoked: true})
		f.mounter.others = []string{"/var/lib/containerd"}
		f.mounter.busy = map[string]bool{"/var/lib/containerd": true}
		err := s.KeepCheckingIn(testCtx(t), f.stopper())
		if !errors.Is(err, ErrRevoked) || !errors.Is(err, unix.EBUSY) || !strings.Contains(err.Error(), "unmounting /var/lib/containerd") {
			t.Fatalf("KeepCheckingIn() = %v; want ErrRevoked naming the busy mount", err)
		}
		if !f.disk.isOpen() || slices.Contains(f.rec.list(), "disk.Close") {
			t.Error("the disk was closed although a mount of it is busy")
		}
		if f.logs.FilterMessageSnippet("unmounting the state disk's mounts of the locked node failed").Len() != 1 {
			t.Error("the busy mount is not logged")
		}
	})
}

// TestMountsOf picks the disk's mounts from a mount table: binds of the disk (not its own mount),
// mounts below them (a pod's volume), in reverse order; a placeholder mounted under a bind before
// it, other devices and the disk's own mount are left alone, but a mount propagated below the
// disk's own mount is not.
func TestMountsOf(t *testing.T) {
	table := strings.Join([]string{
		"22 1 8:1 / / rw - ext4 /dev/sda1 rw",
		"30 22 0:40 / /var/lib/berth ro - tmpfs berth-no-state-disk ro",
		"31 22 7:3 / /run/berth/state-disk rw - ext4 /dev/loop3 rw",
		"32 22 7:3 /data/etc-kubernetes /etc/kubernetes rw - ext4 /dev/loop3 rw",
		"33 22 7:3 /data/var-lib-kubelet /var/lib/kubelet rw - ext4 /dev/loop3 rw",
		"34 30 7:3 /data/var-lib-berth /var/lib/berth rw - ext4 /dev/loop3 rw",
		"35 22 7:3 /data/var-lib-containerd /var/lib/containerd rw - ext4 /dev/loop3 rw",
		"36 33 0:50 / /var/lib/kubelet/pods/p/volumes/kubernetes.io~projected/kube-api-access rw - tmpfs tmpfs rw",
		"37 22 0:51 / /var/lib/kubeletx rw - tmpfs tmpfs rw",
		"38 22 7:3 /data/var\\040log /var/log\\040x rw - ext4 /dev/loop3 rw",
		"39 31 0:52 / /run/berth/state-disk/data/var-lib-kubelet/pods/p/volumes/v rw - tmpfs tmpfs rw",
		"",
	}, "\n")
	got := mountsOf(table, "7:3", "/run/berth/state-disk/data")
	want := []string{"/run/berth/state-disk/data/var-lib-kubelet/pods/p/volumes/v", "/var/log x", "/var/lib/kubelet/pods/p/volumes/kubernetes.io~projected/kube-api-access", "/var/lib/containerd",
		"/var/lib/berth", "/var/lib/kubelet", "/etc/kubernetes"}
	if !slices.Equal(got, want) {
		t.Errorf("mountsOf:\n got  %q\n want %q", got, want)
	}
}

// TestKeepCheckingInStopsWithContext: with no joinservice ever answering, the loop asks until its
// context ends and then returns the context's error, its timer stopped (synctest fails a test whose
// goroutines outlive it).
func TestKeepCheckingInStopsWithContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		s, script := f.bootWithoutAnswer(t)
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- s.KeepCheckingIn(ctx, f.stopper()) }()
		time.Sleep(35 * time.Second) // fake time: three later check-ins
		synctest.Wait()
		if got := script.calls.Load(); got != 4 {
			t.Errorf("%d check-ins after 35 s; want the boot's and three later ones", got)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("KeepCheckingIn() after cancel = %v; want context.Canceled", err)
		}
		if f.rec.count("kubelet.Stop") != 0 || f.rec.count("disk.Close") != 0 {
			t.Error("the node was locked without a REVOKED answer")
		}
	})
}

// TestKeepCheckingInNothingPending: after a boot whose check-in was answered, or that did not boot
// on the sealed key, there is nothing to ask again.
func TestKeepCheckingInNothingPending(t *testing.T) {
	f := newFixture(t)
	key, cluster := randomBytes(t, 32), randomBytes(t, 32)
	f.boundDisk(key, cluster)
	f.sealer.key, f.sealer.unsealErr = key, nil
	script := f.scriptCheckIn(checkInReply{})
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if s.CheckInPending() {
		t.Fatal("a check-in is pending after the cluster admitted the node at boot")
	}
	if err := s.KeepCheckingIn(testCtx(t), f.stopper()); err != nil || script.calls.Load() != 1 {
		t.Errorf("KeepCheckingIn() = %v with %d check-ins; want nil and only the boot's", err, script.calls.Load())
	}
}

// TestCheckInNoOneToAsk: the cluster's only control plane has nobody to check in with
// (ErrNoOneToAsk): it boots on its sealed key without a pending check-in, so nothing asks again;
// a node whose other control planes were removed while it waited stops asking, nothing locked.
func TestCheckInNoOneToAsk(t *testing.T) {
	nobody := checkInReply{err: fmt.Errorf("%w: this node is the cluster's only control plane", ErrNoOneToAsk)}
	t.Run("at boot", func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.key, f.sealer.unsealErr = key, nil
		script := f.scriptCheckIn(nobody)
		s := New(f.cfg)
		if res, err := s.Open(testCtx(t)); err != nil || res.Source != SourceSealed {
			t.Fatalf("Open() = %+v, %v; want the sealed key to boot the node", res, err)
		}
		if s.CheckInPending() {
			t.Error("a check-in is pending on the only control plane")
		}
		if err := s.KeepCheckingIn(testCtx(t), f.stopper()); err != nil || script.calls.Load() != 1 {
			t.Errorf("KeepCheckingIn() = %v after %d check-ins; want nil and only the boot's", err, script.calls.Load())
		}
		if f.logs.FilterMessageSnippet("only control plane").Len() != 1 {
			t.Error("the boot without a check-in is not logged")
		}
	})
	t.Run("later", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t)
			s, script := f.bootWithoutAnswer(t, checkInReply{err: errNoAnswer}, nobody, checkInReply{revoked: true})
			if err := s.KeepCheckingIn(testCtx(t), f.stopper()); err != nil {
				t.Fatalf("KeepCheckingIn() = %v; want nil once nobody is left to ask", err)
			}
			if script.calls.Load() != 3 || s.CheckInPending() {
				t.Errorf("%d check-ins, pending %v; want 3 and nothing pending", script.calls.Load(), s.CheckInPending())
			}
			if f.rec.count("kubelet.Stop") != 0 || f.rec.count("disk.Close") != 0 {
				t.Error("the node was locked without a REVOKED answer")
			}
		})
	})
}
