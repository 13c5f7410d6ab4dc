package bootstage

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/statedisk"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	testUUID  = "6b1f0c3a-2d4e-4f58-9a7b-1c2d3e4f5a6b"
	stateBind = "var-lib-berth"
)

var errSealPolicy = errors.New("the TPM's policy refused the sealed key")

// randomBytes returns n random bytes: keys of the tests are random so that a search for them in the
// logs cannot match by accident.
func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// testCtx bounds a test that could otherwise wait forever (in a synctest bubble, in fake time).
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func clone(b []byte) []byte { return append([]byte(nil), b...) }

// recorder keeps the calls of all fakes in the order they happened.
type recorder struct {
	mu    sync.Mutex
	calls []string
}

func (r *recorder) add(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, fmt.Sprintf(format, args...))
}

func (r *recorder) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

func (r *recorder) count(call string) int {
	n := 0
	for _, c := range r.list() {
		if c == call {
			n++
		}
	}
	return n
}

// fakeDisk is a state disk in memory: a header, a slot key and a plaintext root in a temporary
// directory. Format empties the root, as the real backends destroy everything.
type fakeDisk struct {
	rec  *recorder
	root string

	mu         sync.Mutex
	formatted  bool
	opened     bool
	header     statedisk.Header
	slot       []byte
	formats    int
	formatKeys [][]byte
	openKeys   [][]byte
	rekeys     [][2][]byte

	formatErr, rekeyErr, setBindingErr error
}

func (d *fakeDisk) Header(context.Context) (statedisk.Header, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.formatted {
		return statedisk.Header{}, statedisk.ErrNotFormatted
	}
	h := d.header
	h.ClusterID, h.Binding, h.Sealed, h.MAC = clone(h.ClusterID), clone(h.Binding), clone(h.Sealed), clone(h.MAC)
	return h, nil
}

func (d *fakeDisk) Format(_ context.Context, key []byte) (statedisk.Header, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.add("disk.Format")
	d.formatKeys = append(d.formatKeys, clone(key))
	if d.formatErr != nil {
		return statedisk.Header{}, d.formatErr
	}
	entries, err := os.ReadDir(d.root)
	if err != nil {
		return statedisk.Header{}, err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(d.root, e.Name())); err != nil {
			return statedisk.Header{}, err
		}
	}
	d.formats++
	d.formatted, d.opened, d.slot = true, true, clone(key)
	d.header = statedisk.Header{UUID: fmt.Sprintf("00000000-0000-4000-8000-%012d", d.formats)}
	return d.header, nil
}

func (d *fakeDisk) Open(_ context.Context, key []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.openKeys = append(d.openKeys, clone(key))
	switch {
	case !d.formatted:
		d.rec.add("disk.Open not-formatted")
		return statedisk.ErrNotFormatted
	case !bytes.Equal(key, d.slot):
		d.rec.add("disk.Open wrong-key")
		return fmt.Errorf("unwrapping the keyslot: %w", statedisk.ErrWrongKey)
	}
	d.rec.add("disk.Open")
	d.opened = true
	return nil
}

func (d *fakeDisk) Rekey(_ context.Context, oldKey, newKey []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.add("disk.Rekey")
	d.rekeys = append(d.rekeys, [2][]byte{clone(oldKey), clone(newKey)})
	if d.rekeyErr != nil {
		return d.rekeyErr
	}
	if !bytes.Equal(oldKey, d.slot) {
		return statedisk.ErrWrongKey
	}
	d.slot = clone(newKey)
	return nil
}

func (d *fakeDisk) SetBinding(_ context.Context, clusterID, binding []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.add("disk.SetBinding")
	if d.setBindingErr != nil {
		return d.setBindingErr
	}
	d.header.ClusterID, d.header.Binding = clone(clusterID), clone(binding)
	return nil
}

func (d *fakeDisk) SetSealed(_ context.Context, blob []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.add("disk.SetSealed %s", blob)
	d.header.Sealed = clone(blob)
	return nil
}

func (d *fakeDisk) SetMAC(_ context.Context, mac []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.add("disk.SetMAC")
	d.header.MAC = clone(mac)
	return nil
}

func (d *fakeDisk) Opened(context.Context) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.opened, nil
}

func (d *fakeDisk) Root() string { return d.root }

func (d *fakeDisk) Close(context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.add("disk.Close")
	d.opened = false
	return nil
}

// bound makes the disk one that a cluster bound in an earlier boot: closed, keyed with key, its
// header authenticated under key.
func (d *fakeDisk) bound(key, clusterID, binding, sealed []byte) {
	d.boundLegacy(key, clusterID, binding, sealed)
	d.mu.Lock()
	defer d.mu.Unlock()
	mac, err := statedisk.HeaderMAC(key, d.header)
	if err != nil {
		panic(err)
	}
	d.header.MAC = mac
}

// boundLegacy is bound by an earlier version: the header has no MAC.
func (d *fakeDisk) boundLegacy(key, clusterID, binding, sealed []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.formatted, d.opened, d.slot = true, false, clone(key)
	d.header = statedisk.Header{UUID: testUUID, ClusterID: clone(clusterID), Binding: clone(binding), Sealed: clone(sealed)}
}

// rewriteHeader changes the header as someone with write access to the disk can.
func (d *fakeDisk) rewriteHeader(change func(*statedisk.Header)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	change(&d.header)
}

func (d *fakeDisk) slotKey() []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	return clone(d.slot)
}

func (d *fakeDisk) isOpen() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.opened
}

// fakeSealer unseals to key (or fails with unsealErr) and seals to blob.
type fakeSealer struct {
	rec       *recorder
	key       []byte
	unsealErr error
	blob      []byte
	sealErr   error

	mu     sync.Mutex
	sealed [][]byte
}

func (s *fakeSealer) Seal(_ context.Context, secret []byte) ([]byte, error) {
	s.rec.add("sealer.Seal")
	s.mu.Lock()
	s.sealed = append(s.sealed, clone(secret))
	s.mu.Unlock()
	if s.sealErr != nil {
		return nil, s.sealErr
	}
	return clone(s.blob), nil
}

func (s *fakeSealer) Unseal(_ context.Context, blob []byte) ([]byte, error) {
	s.rec.add("sealer.Unseal %s", blob)
	if s.unsealErr != nil {
		return nil, s.unsealErr
	}
	return clone(s.key), nil
}

func (s *fakeSealer) sealedSecrets() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sealed)
}

// fakeLock is a lock register.
type fakeLock struct {
	rec  *recorder
	name string

	mu           sync.Mutex
	bootstrapped bool
	marks        [][]byte
}

func (l *fakeLock) MarkBootstrapped(_ context.Context, clusterID []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.rec.add("lock.Mark %s %x", l.name, clusterID)
	l.marks = append(l.marks, clone(clusterID))
	l.bootstrapped = true
	return nil
}

func (l *fakeLock) Bootstrapped(context.Context) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.bootstrapped, nil
}

// fakeMounter remembers which disk directory is mounted over which target.
type fakeMounter struct {
	t   *testing.T
	rec *recorder

	mu    sync.Mutex
	bound map[string]string
	order []string // targets in the order of their binds
	// others are mounts of the disk that the stage did not make (mini's containerd root); busy
	// mounts refuse Unmount.
	others []string
	busy   map[string]bool
	gone   map[string]bool // already unmounted through a peer: Unmount says EINVAL
}

func (m *fakeMounter) BindMount(src, dst string) error {
	if fi, err := os.Stat(src); err != nil || !fi.IsDir() {
		m.t.Errorf("BindMount(%s, %s): the source is not a directory (%v)", src, dst, err)
	}
	m.rec.add("mount.Bind %s", dst)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.bound[dst] = filepath.Base(src)
	m.order = append(m.order, dst)
	return nil
}

func (m *fakeMounter) IsBound(dst, name string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bound[dst] == name, nil
}

func (m *fakeMounter) Unmount(dst string) error {
	m.rec.add("mount.Unmount %s", dst)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.busy[dst] {
		return unix.EBUSY
	}
	if m.gone[dst] {
		m.others = slices.DeleteFunc(m.others, func(o string) bool { return o == dst })
		return unix.EINVAL
	}
	delete(m.bound, dst)
	m.others = slices.DeleteFunc(m.others, func(o string) bool { return o == dst })
	return nil
}

// MountsOf lists the other mounts of the disk (others), then the bound targets in reverse order of
// their binds.
func (m *fakeMounter) MountsOf(string) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := slices.Clone(m.others)
	for i := len(m.order) - 1; i >= 0; i-- {
		if _, ok := m.bound[m.order[i]]; ok {
			out = append(out, m.order[i])
		}
	}
	return out, nil
}

type fixture struct {
	rec     *recorder
	disk    *fakeDisk
	sealer  *fakeSealer
	lock    *fakeLock
	mounter *fakeMounter
	logs    *observer.ObservedLogs
	texts   *textCore
	cfg     Config
}

var testBinds = []Bind{
	{Name: "etc-kubernetes", Target: "/etc/kubernetes"},
	{Name: "var-lib-kubelet", Target: "/var/lib/kubelet"},
	{Name: "var-lib-etcd", Target: "/var/lib/etcd"},
	{Name: stateBind, Target: "/var/lib/berth"},
}

// newFixture returns a stage configuration on fakes: an unformatted disk, a sealer without a key,
// one lock register, and rejoin and recovery that fail the test when called.
func newFixture(t *testing.T) *fixture {
	rec := &recorder{}
	core, logs := observer.New(zapcore.DebugLevel)
	texts := newTextCore()
	f := &fixture{
		texts:   texts,
		rec:     rec,
		disk:    &fakeDisk{rec: rec, root: t.TempDir()},
		sealer:  &fakeSealer{rec: rec, unsealErr: errors.New("no key sealed in this test"), blob: []byte("blob-1")},
		lock:    &fakeLock{rec: rec, name: "pcr15"},
		mounter: &fakeMounter{t: t, rec: rec, bound: map[string]string{}},
		logs:    logs,
	}
	f.cfg = Config{
		Log:       zap.New(zapcore.NewTee(core, texts)),
		Disk:      f.disk,
		Sealer:    f.sealer,
		Locks:     []LockRegister{f.lock},
		Binds:     testBinds,
		StateBind: stateBind,
		Mounter:   f.mounter,
		Rejoin: func(context.Context, string, []byte) ([]byte, []byte, error) {
			t.Error("rejoin called")
			return nil, nil, errors.New("rejoin called")
		},
		Recover: func(context.Context, string, []byte, []byte, func(context.Context, []byte) error) error {
			t.Error("recovery called")
			return errors.New("recovery called")
		},
		Identity: func(context.Context) ([]byte, error) { return []byte("ek-hash"), nil },
	}
	return f
}

// boundDisk makes the fixture's disk one bound to cluster with key, its key sealed as blob-0.
func (f *fixture) boundDisk(key, cluster []byte) {
	f.disk.bound(key, cluster, []byte("binding-mac"), []byte("blob-0"))
}

// waitingRecovery is a recovery server nobody calls: it serves until ctx ends.
func (f *fixture) waitingRecovery() RecoverFunc {
	return func(ctx context.Context, _ string, _, _ []byte, _ func(context.Context, []byte) error) error {
		f.rec.add("recover.Serve")
		<-ctx.Done()
		f.rec.add("recover.Stopped")
		return ctx.Err()
	}
}

func (f *fixture) writeNodeState(t *testing.T, st *nodestate.State) {
	t.Helper()
	path := filepath.Join(f.disk.Root(), stateBind, "node-state.json")
	if err := nodestate.NewStore(afero.NewOsFs(), path).Save(st); err != nil {
		t.Fatal(err)
	}
}

func bindCalls() []string {
	var calls []string
	for _, b := range testBinds {
		calls = append(calls, "mount.Bind "+b.Target)
	}
	return calls
}

func unmountCalls() []string {
	var calls []string
	for i := len(testBinds) - 1; i >= 0; i-- {
		calls = append(calls, "mount.Unmount "+testBinds[i].Target)
	}
	return calls
}

func wantCalls(t *testing.T, rec *recorder, want ...[]string) {
	t.Helper()
	w := slices.Concat(want...)
	if got := rec.list(); !slices.Equal(got, w) {
		t.Errorf("calls:\n got  %q\n want %q", got, w)
	}
}

func lockMark(cluster []byte) string { return fmt.Sprintf("lock.Mark pcr15 %x", cluster) }

func TestOpenUnformattedFormatsFresh(t *testing.T) {
	f := newFixture(t)
	s := New(f.cfg)

	res, err := s.Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceFresh || res.ClusterID != nil || res.Wiped != "" {
		t.Errorf("result = %+v; want a fresh, unbound disk, nothing wiped", res)
	}
	if res.UUID == "" || res.UUID != f.disk.header.UUID || s.UUID() != res.UUID {
		t.Errorf("UUID: result %q, stage %q, disk %q", res.UUID, s.UUID(), f.disk.header.UUID)
	}
	// Nothing to unseal and no cluster: no unseal, no lock extension, no seal.
	wantCalls(t, f.rec, []string{"disk.Format"}, bindCalls())
	if len(f.disk.formatKeys) != 1 || len(f.disk.formatKeys[0]) != statedisk.KeySize {
		t.Fatalf("format keys = %d; want one %d-byte key", len(f.disk.formatKeys), statedisk.KeySize)
	}
	if bytes.Equal(f.disk.formatKeys[0], make([]byte, statedisk.KeySize)) {
		t.Error("the fresh key is all zeros")
	}
	if f.lock.bootstrapped {
		t.Error("a fresh disk extended the lock register")
	}
	for _, b := range testBinds {
		if fi, err := os.Stat(filepath.Join(f.disk.Root(), b.Name)); err != nil || !fi.IsDir() {
			t.Errorf("%s not created on the disk: %v", b.Name, err)
		}
		if f.mounter.bound[b.Target] != b.Name {
			t.Errorf("%s is not mounted over %s", b.Name, b.Target)
		}
	}

	// A second fresh node gets another random key.
	g := newFixture(t)
	if _, err := New(g.cfg).Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(f.disk.formatKeys[0], g.disk.formatKeys[0]) {
		t.Error("two fresh disks got the same key")
	}
}

func TestOpenFormatFails(t *testing.T) {
	f := newFixture(t)
	f.disk.formatErr = errors.New("mkfs failed")
	_, err := New(f.cfg).Open(testCtx(t))
	if err == nil || !errors.Is(err, f.disk.formatErr) {
		t.Fatalf("Open = %v; want the format error", err)
	}
	wantCalls(t, f.rec, []string{"disk.Format"})
}

func TestOpenNeverBoundDiskIsWiped(t *testing.T) {
	f := newFixture(t)
	// A disk formatted by an init or join that did not get as far as binding it.
	f.disk.bound(randomBytes(t, 32), nil, nil, nil)
	leftover := filepath.Join(f.disk.Root(), stateBind, "leftover")
	if err := os.MkdirAll(filepath.Dir(leftover), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(leftover, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}

	res, err := New(f.cfg).Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceFresh || res.Wiped == "" || res.ClusterID != nil {
		t.Errorf("result = %+v; want fresh with Wiped set", res)
	}
	if res.UUID == testUUID {
		t.Error("the wiped disk kept its UUID")
	}
	// Never unsealed, never asked the cluster: formatted at once.
	wantCalls(t, f.rec, []string{"disk.Format"}, bindCalls())
	if _, err := os.Stat(leftover); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the never-bound disk's data survived: %v", err)
	}
}

func TestOpenSealed(t *testing.T) {
	for _, tc := range []struct {
		name         string
		bootstrapped bool
		wantMark     bool
	}{
		{name: "lock register reset by the reboot", wantMark: true},
		{name: "lock register already extended", bootstrapped: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			key, cluster := randomBytes(t, 32), randomBytes(t, 32)
			f.boundDisk(key, cluster)
			f.sealer.key, f.sealer.unsealErr = key, nil
			f.lock.bootstrapped = tc.bootstrapped

			res, err := New(f.cfg).Open(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			if res.Source != SourceSealed || res.UUID != testUUID || !bytes.Equal(res.ClusterID, cluster) || res.Wiped != "" {
				t.Errorf("result = %+v", res)
			}
			var mark []string
			if tc.wantMark {
				mark = []string{lockMark(cluster)}
			}
			// Unsealed from the header's blob, opened, locked, mounted; nothing sealed again.
			wantCalls(t, f.rec, []string{"sealer.Unseal blob-0", "disk.Open"}, mark, bindCalls())
			if len(f.disk.openKeys) != 1 || !bytes.Equal(f.disk.openKeys[0], key) {
				t.Errorf("disk opened with %x; want the unsealed key", f.disk.openKeys)
			}
			if n := len(f.sealer.sealedSecrets()); n != 0 {
				t.Errorf("sealed %d times on a sealed boot", n)
			}
		})
	}
}

func TestOpenExtendsEveryLockRegister(t *testing.T) {
	f := newFixture(t)
	key, cluster := randomBytes(t, 32), randomBytes(t, 32)
	f.boundDisk(key, cluster)
	f.sealer.key, f.sealer.unsealErr = key, nil
	marker := &fakeLock{rec: f.rec, name: "marker"}
	f.cfg.Locks = append(f.cfg.Locks, marker)

	if _, err := New(f.cfg).Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	wantCalls(t, f.rec, []string{"sealer.Unseal blob-0", "disk.Open", lockMark(cluster), fmt.Sprintf("lock.Mark marker %x", cluster)}, bindCalls())
}

// rejoinScript answers rejoin calls in order, repeating its last answer.
type rejoinAnswer struct {
	key, cluster []byte
	err          error
}

func (f *fixture) scriptRejoin(t *testing.T, answers ...rejoinAnswer) func() []string {
	var mu sync.Mutex
	var seen []string
	f.cfg.Rejoin = func(_ context.Context, uuid string, binding []byte) ([]byte, []byte, error) {
		mu.Lock()
		defer mu.Unlock()
		f.rec.add("rejoin")
		seen = append(seen, fmt.Sprintf("%s %s", uuid, binding))
		a := answers[0]
		if len(answers) > 1 {
			answers = answers[1:]
		}
		return clone(a.key), clone(a.cluster), a.err
	}
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}

func TestOpenRejoinWhenUnsealFails(t *testing.T) {
	for _, tc := range []struct {
		name      string
		sealer    bool
		unsealErr error
		sealed    []byte
		// unsealKey is a key the TPM gives that does not open the disk.
		wrongUnseal bool
		wantFirst   []string
	}{
		{name: "policy refused", sealer: true, unsealErr: fmt.Errorf("unsealing: %w", errSealPolicy), sealed: []byte("blob-0"), wantFirst: []string{"sealer.Unseal blob-0"}},
		{name: "unsealed key does not open", sealer: true, wrongUnseal: true, sealed: []byte("blob-0"), wantFirst: []string{"sealer.Unseal blob-0", "disk.Open wrong-key"}},
		{name: "nothing sealed", sealer: true},
		{name: "no sealer (TDX)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			key, cluster := randomBytes(t, 32), randomBytes(t, 32)
			f.disk.bound(key, cluster, []byte("binding-mac"), tc.sealed)
			f.sealer.unsealErr = tc.unsealErr
			if tc.wrongUnseal {
				f.sealer.key = randomBytes(t, 32)
			}
			if !tc.sealer {
				f.cfg.Sealer = nil
			}
			seen := f.scriptRejoin(t, rejoinAnswer{key: key, cluster: cluster})
			f.cfg.Recover = f.waitingRecovery()

			res, err := New(f.cfg).Open(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			if res.Source != SourceRejoin || !bytes.Equal(res.ClusterID, cluster) {
				t.Errorf("result = %+v; want rejoin", res)
			}
			if got := seen(); !slices.Equal(got, []string{testUUID + " binding-mac"}) {
				t.Errorf("rejoin asked with %q; want the header's UUID and binding", got)
			}
			if !f.disk.isOpen() {
				t.Error("disk not open")
			}
			// The recovery server was started and stopped once the rejoin won.
			if f.rec.count("recover.Serve") != 1 || f.rec.count("recover.Stopped") != 1 {
				t.Errorf("recovery server not started and stopped: %q", f.rec.list())
			}
			var reseal []string
			if tc.sealer {
				reseal = []string{"sealer.Seal", "disk.SetSealed blob-1"}
				if s := f.sealer.sealedSecrets(); len(s) != 1 || !bytes.Equal(s[0], key) {
					t.Errorf("sealed %x; want the rejoin key once", s)
				}
			}
			// The rejoin and the recovery server run side by side: drop recovery's entries for the
			// order check.
			var got []string
			for _, c := range f.rec.list() {
				if !strings.HasPrefix(c, "recover.") {
					got = append(got, c)
				}
			}
			want := slices.Concat(tc.wantFirst, []string{"rejoin", "disk.Open"}, reseal, []string{lockMark(cluster)}, bindCalls())
			if !slices.Equal(got, want) {
				t.Errorf("calls:\n got  %q\n want %q", got, want)
			}
		})
	}
}

func TestOpenRejoinRefusedThenAccepted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.unsealErr = errSealPolicy
		f.cfg.RefusedBackoff = time.Second
		refused := errors.New("joinservice refused: attestation")
		f.scriptRejoin(t, rejoinAnswer{err: refused}, rejoinAnswer{err: refused}, rejoinAnswer{key: key, cluster: cluster})
		f.cfg.Recover = f.waitingRecovery()

		start := time.Now()
		res, err := New(f.cfg).Open(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		if res.Source != SourceRejoin {
			t.Errorf("source = %q; want rejoin", res.Source)
		}
		if n := f.rec.count("rejoin"); n != 3 {
			t.Errorf("rejoin called %d times; want 3 (two refusals retried)", n)
		}
		// Two waits of RefusedBackoff, jittered up to half of it again.
		if took < 2*time.Second || took > 3*time.Second {
			t.Errorf("took %v; want between 2 s and 3 s of backoff", took)
		}
		if n := f.logs.FilterMessageSnippet("rejoin refused").Len(); n != 2 {
			t.Errorf("%d refusals logged; want 2", n)
		}
		if f.rec.count("disk.Open") != 1 {
			t.Errorf("calls = %q", f.rec.list())
		}
	})
}

func TestOpenRejoinTicketOfAnotherClusterNotUsed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.unsealErr = errSealPolicy
		f.cfg.RefusedBackoff = time.Second
		// The first ticket carries the right key, but for another cluster: it must not be tried.
		f.scriptRejoin(t, rejoinAnswer{key: key, cluster: randomBytes(t, 32)}, rejoinAnswer{key: key, cluster: cluster})
		f.cfg.Recover = f.waitingRecovery()

		res, err := New(f.cfg).Open(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if res.Source != SourceRejoin || !bytes.Equal(res.ClusterID, cluster) {
			t.Errorf("result = %+v", res)
		}
		if f.rec.count("rejoin") != 2 || len(f.disk.openKeys) != 1 {
			t.Errorf("rejoins %d, disk opens %d; want 2 and 1: %q", f.rec.count("rejoin"), len(f.disk.openKeys), f.rec.list())
		}
		if f.logs.FilterMessageSnippet("another cluster").Len() != 1 {
			t.Error("the ticket of another cluster was not logged")
		}
	})
}

func TestOpenRejoinKeyThatDoesNotOpenNotAccepted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.unsealErr = errSealPolicy
		f.cfg.RefusedBackoff = time.Second
		wrong := randomBytes(t, 32)
		f.scriptRejoin(t, rejoinAnswer{key: wrong, cluster: cluster}, rejoinAnswer{key: key, cluster: cluster})
		f.cfg.Recover = f.waitingRecovery()

		res, err := New(f.cfg).Open(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if res.Source != SourceRejoin {
			t.Errorf("source = %q", res.Source)
		}
		if f.rec.count("disk.Open wrong-key") != 1 || f.rec.count("disk.Open") != 1 || f.rec.count("rejoin") != 2 {
			t.Errorf("calls = %q; want a wrong-key open, a second rejoin, one open", f.rec.list())
		}
		if s := f.sealer.sealedSecrets(); len(s) != 1 || !bytes.Equal(s[0], key) {
			t.Errorf("sealed %d keys; want only the key that opened the disk", len(s))
		}
		if f.logs.FilterMessageSnippet("does not open the state disk").Len() != 1 {
			t.Error("the useless ticket was not logged")
		}
	})
}

func TestOpenRecoveryWinsWhileRejoinFails(t *testing.T) {
	f := newFixture(t)
	key, cluster := randomBytes(t, 32), randomBytes(t, 32)
	f.boundDisk(key, cluster)
	f.sealer.unsealErr = errSealPolicy
	// The rejoin never gets an answer (no joinservice is up): it blocks until cancelled.
	rejoinStarted := make(chan struct{})
	f.cfg.Rejoin = func(ctx context.Context, _ string, _ []byte) ([]byte, []byte, error) {
		f.rec.add("rejoin")
		close(rejoinStarted)
		<-ctx.Done()
		f.rec.add("rejoin.Stopped")
		return nil, nil, ctx.Err()
	}
	var wrongErr, againErr error
	wrong := randomBytes(t, 32)
	f.cfg.Recover = func(ctx context.Context, uuid string, clusterID, _ []byte, open func(context.Context, []byte) error) error {
		<-rejoinStarted
		if uuid != testUUID || !bytes.Equal(clusterID, cluster) {
			t.Errorf("recovery serves %s %x; want the header's UUID and cluster ID", uuid, clusterID)
		}
		wrongErr = open(ctx, wrong)
		if f.disk.isOpen() {
			t.Error("a wrong recovery key opened the disk")
		}
		if err := open(ctx, key); err != nil {
			return err
		}
		againErr = open(ctx, key)
		return nil
	}

	res, err := New(f.cfg).Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceRecovery || !bytes.Equal(res.ClusterID, cluster) {
		t.Errorf("result = %+v; want recovery", res)
	}
	if !errors.Is(wrongErr, statedisk.ErrWrongKey) {
		t.Errorf("open with a wrong key = %v; want ErrWrongKey for the recovery server", wrongErr)
	}
	if againErr == nil {
		t.Error("a second recovery open after the win succeeded")
	}
	if f.rec.count("rejoin.Stopped") != 1 {
		t.Error("the rejoin was not stopped when recovery won")
	}
	if f.rec.count("disk.Open") != 1 || f.rec.count("disk.Open wrong-key") != 1 {
		t.Errorf("calls = %q", f.rec.list())
	}
	if s := f.sealer.sealedSecrets(); len(s) != 1 || !bytes.Equal(s[0], key) {
		t.Error("the recovery key was not sealed again")
	}
	goleak.VerifyNone(t)
}

func TestOpenRecoveryWinsWhileRejoinRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.unsealErr = errSealPolicy
		f.cfg.RefusedBackoff = time.Second
		f.scriptRejoin(t, rejoinAnswer{err: errors.New("DISK_NOT_BOUND")})
		f.cfg.Recover = func(ctx context.Context, _ string, _, _ []byte, open func(context.Context, []byte) error) error {
			time.Sleep(30 * time.Second) // the operator runs berth recover half a minute later
			return open(ctx, key)
		}

		res, err := New(f.cfg).Open(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		if res.Source != SourceRecovery {
			t.Errorf("source = %q", res.Source)
		}
		n := f.rec.count("rejoin")
		if n < 2 {
			t.Errorf("rejoin tried %d times in half a minute; want it retried", n)
		}
		// The rejoin loop is gone: no call after the stage returned (synctest also fails the test on
		// a goroutine left behind).
		time.Sleep(time.Minute)
		if m := f.rec.count("rejoin"); m != n {
			t.Errorf("rejoin called %d more times after recovery won", m-n)
		}
	})
}

func TestOpenCancelledWhileWaiting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		f.boundDisk(key, cluster)
		f.sealer.unsealErr = errSealPolicy
		f.cfg.RefusedBackoff = time.Second
		f.scriptRejoin(t, rejoinAnswer{err: errors.New("unavailable")})
		f.cfg.Recover = f.waitingRecovery()

		ctx, cancel := context.WithCancel(t.Context())
		type result struct {
			res Result
			err error
		}
		done := make(chan result)
		go func() {
			res, err := New(f.cfg).Open(ctx)
			done <- result{res, err}
		}()
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if f.rec.count("rejoin") < 2 || f.rec.count("recover.Serve") != 1 {
			t.Errorf("not waiting on both paths: %q", f.rec.list())
		}
		cancel()
		r := <-done
		if !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Open = %v; want context.Canceled", r.err)
		}
		if f.disk.isOpen() || len(f.disk.openKeys) != 0 {
			t.Error("the disk was opened")
		}
		if f.lock.bootstrapped || len(f.mounter.bound) != 0 || len(f.sealer.sealedSecrets()) != 0 {
			t.Error("locked, mounted or sealed without a key")
		}
		if f.rec.count("recover.Stopped") != 1 {
			t.Error("the recovery server was not stopped")
		}
	})
}

func TestOpenLockedWithoutRejoinOrRecovery(t *testing.T) {
	f := newFixture(t)
	f.boundDisk(randomBytes(t, 32), randomBytes(t, 32))
	f.sealer.unsealErr = errSealPolicy
	f.cfg.Rejoin, f.cfg.Recover = nil, nil
	if _, err := New(f.cfg).Open(testCtx(t)); err == nil {
		t.Fatal("Open succeeded without any way to get a key")
	}
	if f.disk.isOpen() || len(f.mounter.bound) != 0 {
		t.Error("disk opened or mounted")
	}
}

func TestOpenWipesUnfinishedJoin(t *testing.T) {
	for _, tc := range []struct {
		name  string
		state *nodestate.State
		wipe  bool
	}{
		{name: "join not done", state: &nodestate.State{Role: nodestate.RoleJoin, ClusterID: "ab"}, wipe: true},
		{name: "join done", state: &nodestate.State{Role: nodestate.RoleJoin, ClusterID: "ab", Done: true}},
		{name: "init not done (resumed by the init)", state: &nodestate.State{Role: nodestate.RoleInit, ClusterID: "ab"}},
		{name: "no node state"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			key, cluster := randomBytes(t, 32), randomBytes(t, 32)
			f.boundDisk(key, cluster)
			f.sealer.key, f.sealer.unsealErr = key, nil
			if tc.state != nil {
				f.writeNodeState(t, tc.state)
			}

			s := New(f.cfg)
			res, err := s.Open(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			st, err := nodestate.NewStore(afero.NewOsFs(), filepath.Join(f.disk.Root(), stateBind, "node-state.json")).Load()
			if err != nil {
				t.Fatal(err)
			}
			if !tc.wipe {
				if res.Source != SourceSealed || res.Wiped != "" {
					t.Errorf("result = %+v; want sealed, nothing wiped", res)
				}
				if (st == nil) != (tc.state == nil) {
					t.Error("node state lost")
				}
				wantCalls(t, f.rec, []string{"sealer.Unseal blob-0", "disk.Open", lockMark(cluster)}, bindCalls())
				return
			}
			if res.Source != SourceFresh || res.Wiped == "" || res.ClusterID != nil || res.UUID == testUUID || s.UUID() != res.UUID {
				t.Errorf("result = %+v; want a fresh disk with a new UUID and Wiped set", res)
			}
			if st != nil {
				t.Errorf("node state survived the wipe: %+v", st)
			}
			// Nothing was mounted yet in this boot, so nothing to unmount; no lock for a fresh node.
			wantCalls(t, f.rec, []string{"sealer.Unseal blob-0", "disk.Open", "disk.Close", "disk.Format"}, bindCalls())
			if f.logs.FilterMessageSnippet("join did not finish").Len() != 1 {
				t.Error("the wipe is not named in the logs")
			}
			// The fresh disk can be bound by the next join.
			if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), []byte("b")); err != nil {
				t.Errorf("Bind after the wipe: %v", err)
			}
		})
	}
}

func TestOpenCorruptNodeState(t *testing.T) {
	f := newFixture(t)
	key := randomBytes(t, 32)
	f.boundDisk(key, randomBytes(t, 32))
	f.sealer.key, f.sealer.unsealErr = key, nil
	path := filepath.Join(f.disk.Root(), stateBind, "node-state.json")
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := New(f.cfg).Open(testCtx(t)); err == nil {
		t.Fatal("Open succeeded with an unreadable node state")
	}
	if f.disk.formats != 0 || f.lock.bootstrapped || len(f.mounter.bound) != 0 {
		t.Error("wiped, locked or mounted on an unreadable node state")
	}
}

// alreadyOpen is the disk of a daemon restarted within the same boot: open, its binds mounted.
func (f *fixture) alreadyOpen(key, cluster []byte) {
	f.disk.bound(key, cluster, []byte("binding-mac"), []byte("blob-0"))
	f.disk.opened = true
	for _, b := range testBinds {
		f.mounter.bound[b.Target] = b.Name
	}
}

func TestOpenAlreadyOpen(t *testing.T) {
	for _, tc := range []struct {
		name         string
		bootstrapped bool
	}{
		{name: "lock register extended", bootstrapped: true},
		{name: "lock register not extended"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			cluster := randomBytes(t, 32)
			f.alreadyOpen(randomBytes(t, 32), cluster)
			f.lock.bootstrapped = tc.bootstrapped

			s := New(f.cfg)
			res, err := s.Open(testCtx(t))
			if err != nil {
				t.Fatal(err)
			}
			if res.Source != SourceAlready || !bytes.Equal(res.ClusterID, cluster) || s.UUID() != testUUID {
				t.Errorf("result = %+v", res)
			}
			// No unseal, no open, no seal, no second mount.
			var mark []string
			if !tc.bootstrapped {
				mark = []string{lockMark(cluster)}
			}
			wantCalls(t, f.rec, mark)
			if err := s.Bind(t.Context(), randomBytes(t, 32), cluster, []byte("b")); err != nil {
				t.Errorf("Bind to the disk's own cluster = %v; want nil", err)
			}
			if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), []byte("b")); !errors.Is(err, ErrAlreadyBound) {
				t.Errorf("Bind to another cluster = %v; want ErrAlreadyBound", err)
			}
			wantCalls(t, f.rec, mark)
		})
	}
}

func TestOpenAlreadyOpenUnbound(t *testing.T) {
	f := newFixture(t)
	f.alreadyOpen(randomBytes(t, 32), nil)

	res, err := New(f.cfg).Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceFresh || res.Wiped == "" {
		t.Errorf("result = %+v; want formatted again", res)
	}
	wantCalls(t, f.rec, unmountCalls(), []string{"disk.Close", "disk.Format"}, bindCalls())
}

func TestOpenAlreadyOpenUnfinishedJoin(t *testing.T) {
	f := newFixture(t)
	f.alreadyOpen(randomBytes(t, 32), randomBytes(t, 32))
	f.lock.bootstrapped = true
	f.writeNodeState(t, &nodestate.State{Role: nodestate.RoleJoin, ClusterID: "ab"})

	res, err := New(f.cfg).Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceFresh || res.Wiped == "" {
		t.Errorf("result = %+v; want wiped", res)
	}
	// The previous process's mounts come off (in reverse) before the disk is closed and formatted.
	wantCalls(t, f.rec, unmountCalls(), []string{"disk.Close", "disk.Format"}, bindCalls())
}

func TestBind(t *testing.T) {
	f := newFixture(t)
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	fresh := f.disk.formatKeys[0]
	diskKey, cluster, binding := randomBytes(t, 32), randomBytes(t, 32), randomBytes(t, 32)
	f.rec.calls = nil

	if err := s.Bind(t.Context(), diskKey, cluster, binding); err != nil {
		t.Fatal(err)
	}
	wantCalls(t, f.rec, []string{"disk.Rekey", "disk.SetBinding", "disk.SetMAC", "sealer.Seal", "disk.SetSealed blob-1"})
	if len(f.disk.rekeys) != 1 || !bytes.Equal(f.disk.rekeys[0][0], fresh) || !bytes.Equal(f.disk.rekeys[0][1], diskKey) {
		t.Error("Rekey was not from the format key to the disk key")
	}
	if !bytes.Equal(f.disk.slotKey(), diskKey) {
		t.Error("the disk does not open with the disk key")
	}
	if h, _ := f.disk.Header(t.Context()); !bytes.Equal(h.ClusterID, cluster) || !bytes.Equal(h.Binding, binding) || string(h.Sealed) != "blob-1" {
		t.Errorf("header = %+v", h)
	}
	if sealed := f.sealer.sealedSecrets(); len(sealed) != 1 || !bytes.Equal(sealed[0], diskKey) {
		t.Error("the disk key was not sealed")
	}
	if s.freshKey != nil {
		t.Error("the fresh key is still kept")
	}

	f.rec.calls = nil
	if err := s.Bind(t.Context(), diskKey, cluster, binding); err != nil {
		t.Errorf("second Bind to the same cluster = %v; want nil", err)
	}
	if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), binding); !errors.Is(err, ErrAlreadyBound) {
		t.Errorf("Bind to another cluster = %v; want ErrAlreadyBound", err)
	}
	wantCalls(t, f.rec)
}

func TestBindNotFresh(t *testing.T) {
	f := newFixture(t)
	s := New(f.cfg)
	if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), []byte("b")); !errors.Is(err, ErrNotFresh) {
		t.Errorf("Bind before Open = %v; want ErrNotFresh", err)
	}
	wantCalls(t, f.rec)
}

func TestBindRekeyFails(t *testing.T) {
	f := newFixture(t)
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	f.rec.calls = nil
	f.disk.rekeyErr = errors.New("cryptsetup failed")
	if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), []byte("b")); !errors.Is(err, f.disk.rekeyErr) {
		t.Fatalf("Bind = %v; want the rekey error", err)
	}
	wantCalls(t, f.rec, []string{"disk.Rekey"})
	// Nothing recorded: a retry still re-keys from the fresh key.
	f.disk.rekeyErr = nil
	if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), []byte("b")); err != nil {
		t.Errorf("Bind retried = %v", err)
	}
}

func TestBindSetBindingFailsCanBeRetried(t *testing.T) {
	f := newFixture(t)
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	diskKey, cluster := randomBytes(t, 32), randomBytes(t, 32)
	f.disk.setBindingErr = errors.New("header write failed")
	if err := s.Bind(t.Context(), diskKey, cluster, []byte("b")); !errors.Is(err, f.disk.setBindingErr) {
		t.Fatalf("Bind = %v; want the header error", err)
	}
	if n := len(f.sealer.sealedSecrets()); n != 0 {
		t.Error("sealed a key of an unbound disk")
	}
	// The disk is keyed with diskKey now; the init that failed is retried within the same boot.
	f.disk.setBindingErr = nil
	if err := s.Bind(t.Context(), diskKey, cluster, []byte("b")); err != nil {
		t.Fatalf("Bind retried = %v", err)
	}
	if last := f.disk.rekeys[len(f.disk.rekeys)-1]; !bytes.Equal(last[0], diskKey) || !bytes.Equal(last[1], diskKey) {
		t.Error("the retry did not re-key from the key the disk has")
	}
	if h, _ := f.disk.Header(t.Context()); !bytes.Equal(h.ClusterID, cluster) || !bytes.Equal(f.disk.slotKey(), diskKey) {
		t.Errorf("header = %+v; want bound, keyed with the disk key", h)
	}
	if s.freshKey != nil {
		t.Error("the key is still kept after the disk was bound")
	}
}

func TestBindSealFailsStillBinds(t *testing.T) {
	f := newFixture(t)
	f.sealer.sealErr = errors.New("TPM busy")
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := s.Bind(t.Context(), randomBytes(t, 32), randomBytes(t, 32), []byte("b")); err != nil {
		t.Fatalf("Bind = %v; a failed seal only means the next boot rejoins", err)
	}
	if h, _ := f.disk.Header(t.Context()); h.ClusterID == nil || h.Sealed != nil {
		t.Errorf("header = %+v; want bound, nothing sealed", h)
	}
	if f.logs.FilterMessageSnippet("sealing the disk key to the TPM failed").Len() != 1 {
		t.Error("the failed seal was not logged")
	}
}

func TestBindWithKeys(t *testing.T) {
	f := newFixture(t)
	identity := []byte("ek-sha256")
	f.cfg.Identity = func(context.Context) ([]byte, error) { return identity, nil }
	s := New(f.cfg)
	res, err := s.Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	keys, err := clusterkeys.New(randomBytes(t, 32), randomBytes(t, 32))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.BindWithKeys(t.Context(), keys); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(f.disk.slotKey(), keys.DiskKey(res.UUID, identity)) {
		t.Error("the disk is not keyed with clusterkeys.DiskKey(uuid, identity)")
	}
	h, _ := f.disk.Header(t.Context())
	if !bytes.Equal(h.ClusterID, keys.ClusterID()) {
		t.Error("the header does not record the cluster ID")
	}
	if !bytes.Equal(h.Binding, keys.DiskBinding(res.UUID, identity)) || !keys.VerifyDiskBinding(res.UUID, identity, h.Binding) {
		t.Error("the header's binding is not DiskBinding(uuid, identity)")
	}
	if keys.VerifyDiskBinding(res.UUID, []byte("another machine"), h.Binding) {
		t.Error("the binding verifies for another machine")
	}
	if sealed := f.sealer.sealedSecrets(); len(sealed) != 1 || !bytes.Equal(sealed[0], keys.DiskKey(res.UUID, identity)) {
		t.Error("the disk key was not sealed")
	}
}

func TestBindWithKeysIdentityFails(t *testing.T) {
	f := newFixture(t)
	idErr := errors.New("metadata unreachable")
	f.cfg.Identity = func(context.Context) ([]byte, error) { return nil, idErr }
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	f.rec.calls = nil
	keys, err := clusterkeys.New(randomBytes(t, 32), randomBytes(t, 32))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.BindWithKeys(t.Context(), keys); !errors.Is(err, idErr) {
		t.Errorf("BindWithKeys = %v; want the identity error", err)
	}
	wantCalls(t, f.rec)
}

func TestInstanceIdentity(t *testing.T) {
	if got := string(InstanceIdentity("worker-1")); got != "instance/worker-1" {
		t.Errorf("InstanceIdentity = %q", got)
	}
}

// secretForms are the ways a key could show up in a log line.
func secretForms(key []byte) []string {
	return []string{
		string(key),
		hex.EncodeToString(key),
		strings.ToUpper(hex.EncodeToString(key)),
		base64.StdEncoding.EncodeToString(key),
		base64.RawStdEncoding.EncodeToString(key),
		base64.URLEncoding.EncodeToString(key),
		base64.RawURLEncoding.EncodeToString(key),
		decimalList(key),
	}
}

// decimalList is how fmt prints a byte slice inside a map or struct: [1 2 3].
func decimalList(b []byte) string {
	parts := make([]string, len(b))
	for i, c := range b {
		parts[i] = strconv.Itoa(int(c))
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// textCore renders every entry as it is written, as JSON and as a map of its fields: the stage
// clears keys after use, so a check of the entries afterwards would miss a key that was logged.
type textCore struct {
	zapcore.LevelEnabler
	fields []zapcore.Field
	mu     *sync.Mutex
	texts  *[]string
}

func newTextCore() *textCore {
	return &textCore{LevelEnabler: zapcore.DebugLevel, mu: &sync.Mutex{}, texts: &[]string{}}
}

func (c *textCore) With(fields []zapcore.Field) zapcore.Core {
	cc := *c
	cc.fields = slices.Concat(c.fields, fields)
	return &cc
}

func (c *textCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	return ce.AddCore(e, c)
}

func (c *textCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	all := slices.Concat(c.fields, fields)
	buf, err := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()).EncodeEntry(e, all)
	if err != nil {
		return err
	}
	defer buf.Free()
	m := zapcore.NewMapObjectEncoder()
	for _, f := range all {
		f.AddTo(m)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	*c.texts = append(*c.texts, buf.String()+fmt.Sprintf("%v", m.Fields))
	return nil
}

func (*textCore) Sync() error { return nil }

func (c *textCore) all() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(*c.texts)
}

// leakedSecrets returns the rendered log entries that hold any of secrets.
func leakedSecrets(texts []string, secrets [][]byte) []string {
	var leaks []string
	for _, text := range texts {
		for i, s := range secrets {
			for _, form := range secretForms(s) {
				if strings.Contains(text, form) {
					leaks = append(leaks, fmt.Sprintf("secret %d in %s", i, text))
				}
			}
		}
	}
	return leaks
}

func TestLeakedSecretsFindsKeys(t *testing.T) {
	key := randomBytes(t, 32)
	for _, field := range []zap.Field{
		zap.String("k", hex.EncodeToString(key)),
		zap.String("k", base64.StdEncoding.EncodeToString(key)),
		zap.Binary("k", key),
		zap.ByteString("k", key),
		zap.Error(fmt.Errorf("bad key %x", key)),
		zap.Any("k", key),
	} {
		core := newTextCore()
		zap.New(core).Info("m", field)
		if len(leakedSecrets(core.all(), [][]byte{key})) == 0 {
			t.Errorf("a key logged as %s (%v) was not found", field.Key, field.Type)
		}
	}
	// A key cleared right after it was logged is still found.
	core := newTextCore()
	cleared := clone(key)
	zap.New(core).Named("stage").With(zap.String("node", "w1")).Info("m", zap.Binary("k", cleared))
	clear(cleared)
	if len(leakedSecrets(core.all(), [][]byte{key})) == 0 {
		t.Error("a key cleared after it was logged was not found")
	}
	core = newTextCore()
	zap.New(core).Info("m", zap.String("k", hex.EncodeToString(randomBytes(t, 32))))
	if leaks := leakedSecrets(core.all(), [][]byte{key}); len(leaks) != 0 {
		t.Errorf("found a key that was not logged: %q", leaks)
	}
}

func TestSecretsNeverLogged(t *testing.T) {
	var secrets [][]byte
	var entries []string

	// A fresh node bound to its cluster with BindWithKeys.
	f := newFixture(t)
	s := New(f.cfg)
	if _, err := s.Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	master := randomBytes(t, 32)
	keys, err := clusterkeys.New(master, randomBytes(t, 32))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.BindWithKeys(t.Context(), keys); err != nil {
		t.Fatal(err)
	}
	secrets = append(secrets, master, keys.DiskKey(s.UUID(), []byte("ek-hash")), keys.MeasurementSecret())
	secrets = append(secrets, f.disk.formatKeys...)
	entries = append(entries, f.texts.all()...)

	// A sealed boot.
	f = newFixture(t)
	key := randomBytes(t, 32)
	f.boundDisk(key, randomBytes(t, 32))
	f.sealer.key, f.sealer.unsealErr = key, nil
	if _, err := New(f.cfg).Open(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	secrets = append(secrets, key)
	entries = append(entries, f.texts.all()...)

	// A boot that unseals a wrong key, gets a useless rejoin ticket, a ticket of another cluster,
	// a refusal, a wrong recovery key, fails to seal, and then rejoins.
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t)
		key, cluster := randomBytes(t, 32), randomBytes(t, 32)
		wrongs := [][]byte{randomBytes(t, 32), randomBytes(t, 32), randomBytes(t, 32), randomBytes(t, 32)}
		f.boundDisk(key, cluster)
		f.sealer.key, f.sealer.unsealErr = wrongs[0], nil
		f.sealer.sealErr = errors.New("TPM busy")
		f.cfg.RefusedBackoff = time.Second
		f.scriptRejoin(t,
			rejoinAnswer{key: wrongs[1], cluster: cluster},
			rejoinAnswer{key: wrongs[2], cluster: randomBytes(t, 32)},
			rejoinAnswer{err: errors.New("refused")},
			rejoinAnswer{key: key, cluster: cluster})
		f.cfg.Recover = func(ctx context.Context, _ string, _, _ []byte, open func(context.Context, []byte) error) error {
			if err := open(ctx, wrongs[3]); err == nil {
				t.Error("a wrong recovery key opened the disk")
			}
			<-ctx.Done()
			return ctx.Err()
		}
		if _, err := New(f.cfg).Open(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		secrets = append(secrets, key)
		secrets = append(secrets, wrongs...)
		entries = append(entries, f.texts.all()...)
	})

	if len(entries) < 10 {
		t.Fatalf("only %d log entries: the scenarios did not run", len(entries))
	}
	if leaks := leakedSecrets(entries, secrets); len(leaks) != 0 {
		t.Errorf("secrets in the logs: %q", leaks)
	}
}

func TestMountRootHas(t *testing.T) {
	for _, tc := range []struct {
		root, name string
		want       bool
	}{
		{"/etc-kubernetes", "etc-kubernetes", true},
		{"/data/etc-kubernetes", "etc-kubernetes", true},
		{"/", "etc-kubernetes", false},
		{"/data/etc-kubernetes-old", "etc-kubernetes", false},
		{"/data/xetc-kubernetes", "etc-kubernetes", false},
		{"/data/etc-kubernetes/manifests", "etc-kubernetes", false},
		{"/data/var-lib-kubelet", "etc-kubernetes", false},
	} {
		if got := mountRootHas(tc.root, tc.name); got != tc.want {
			t.Errorf("mountRootHas(%q, %q) = %v; want %v", tc.root, tc.name, got, tc.want)
		}
	}
}

func TestSysMounterIsBoundNotAMount(t *testing.T) {
	bound, err := sysMounter{}.IsBound(t.TempDir(), "etc-kubernetes")
	if err != nil || bound {
		t.Errorf("IsBound(a plain directory) = %v, %v; want false", bound, err)
	}
}

// TestOpenRefusesHeaderNotAuthentic: the sealed key opens the disk, but its header was not written
// with that key. The node closes the disk, extends nothing and wipes nothing, and asks the cluster,
// whose ticket (for the real cluster) does not match the rewritten header either.
func TestOpenRefusesHeaderNotAuthentic(t *testing.T) {
	for name, rewrite := range map[string]func(h *statedisk.Header, other []byte){
		"cluster ID rewritten":    func(h *statedisk.Header, other []byte) { h.ClusterID = other },
		"binding rewritten":       func(h *statedisk.Header, other []byte) { h.Binding = other },
		"MAC of another header":   func(h *statedisk.Header, other []byte) { h.ClusterID, h.MAC = other, other },
		"MAC stripped, ID copied": func(h *statedisk.Header, other []byte) { h.ClusterID, h.MAC = other, nil },
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t)
				key, cluster, other := randomBytes(t, 32), randomBytes(t, 32), randomBytes(t, 32)
				f.boundDisk(key, cluster)
				f.disk.rewriteHeader(func(h *statedisk.Header) { rewrite(h, other) })
				before, _ := f.disk.Header(t.Context())
				f.sealer.key, f.sealer.unsealErr = key, nil
				f.cfg.RefusedBackoff = time.Second
				// The cluster answers with the real cluster ID (and the key): for a rewritten
				// cluster ID that does not match the header, for a rewritten binding the
				// joinservice refuses.
				answer := rejoinAnswer{err: errors.New("DISK_NOT_BOUND")}
				if !bytes.Equal(before.ClusterID, cluster) {
					answer = rejoinAnswer{key: key, cluster: cluster}
				}
				f.scriptRejoin(t, answer)
				f.cfg.Recover = f.waitingRecovery()

				ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
				defer cancel()
				_, err := New(f.cfg).Open(ctx)
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("Open = %v; want it to wait for a key that vouches for the header", err)
				}
				if f.logs.FilterMessageSnippet("state disk header refused").Len() != 1 {
					t.Error("the refusal was not logged")
				}
				if f.disk.isOpen() || f.rec.count("disk.Close") < 1 {
					t.Errorf("the disk was left open: %q", f.rec.list())
				}
				if f.lock.bootstrapped || f.rec.count(lockMark(other)) != 0 || f.rec.count(lockMark(cluster)) != 0 || len(f.mounter.bound) != 0 {
					t.Errorf("the lock register was extended or the disk mounted: %q", f.rec.list())
				}
				if f.rec.count("disk.Format") != 0 || f.rec.count("disk.SetMAC") != 0 || len(f.sealer.sealedSecrets()) != 0 {
					t.Errorf("the disk was wiped, its header re-authenticated or its key resealed: %q", f.rec.list())
				}
				if after, _ := f.disk.Header(t.Context()); !reflect.DeepEqual(after, before) {
					t.Error("the header changed")
				}
			})
		})
	}
}

// TestOpenLegacyHeaderAuthenticatedByRejoin: a disk bound by an earlier version has no MAC. Its
// sealed key is not trusted for the header; the rejoin ticket vouches for it, the MAC is written
// and the next boot opens with the sealed key.
func TestOpenLegacyHeaderAuthenticatedByRejoin(t *testing.T) {
	f := newFixture(t)
	key, cluster := randomBytes(t, 32), randomBytes(t, 32)
	f.disk.boundLegacy(key, cluster, []byte("binding-mac"), []byte("blob-0"))
	f.sealer.key, f.sealer.unsealErr = key, nil
	f.scriptRejoin(t, rejoinAnswer{key: key, cluster: cluster})
	f.cfg.Recover = f.waitingRecovery()

	res, err := New(f.cfg).Open(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if res.Source != SourceRejoin || !bytes.Equal(res.ClusterID, cluster) {
		t.Fatalf("result = %+v; want rejoin", res)
	}
	h, _ := f.disk.Header(t.Context())
	if !statedisk.VerifyHeaderMAC(key, h) {
		t.Fatal("the header was not authenticated after the rejoin")
	}
	if f.rec.count("disk.SetMAC") != 1 || len(f.sealer.sealedSecrets()) != 1 {
		t.Errorf("calls = %q", f.rec.list())
	}

	// The next boot: the sealed key opens, the header verifies.
	g := newFixture(t)
	g.disk = f.disk
	g.cfg.Disk = f.disk
	_ = f.disk.Close(t.Context())
	g.sealer.key, g.sealer.unsealErr = key, nil
	g.cfg.Sealer = g.sealer
	res, err = New(g.cfg).Open(testCtx(t))
	if err != nil || res.Source != SourceSealed {
		t.Fatalf("next boot: %+v, %v; want sealed", res, err)
	}
}
