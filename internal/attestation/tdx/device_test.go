package tdx

import (
	"bytes"
	"context"
	"crypto/sha512"
	"errors"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/edgelesssys/go-tdx-qpl/blobs"
	"github.com/spf13/afero"
)

// fakeFd stands in for the opened guest device file.
type fakeFd struct{ closed bool }

func (f *fakeFd) Fd() uintptr  { return ^uintptr(0) }
func (f *fakeFd) Close() error { f.closed = true; return nil }

// fakeLegacy records what the legacy backend asks of go-tdx-qpl and simulates the registers.
type fakeLegacy struct {
	reportData []byte
	regs       [5][48]byte
	extendTo   int // register the simulated driver extends; -1 uses the requested index
	err        error
}

func (f *fakeLegacy) ops() legacyOps {
	return legacyOps{
		quote: func(_ fdDevice, rd []byte) ([]byte, error) {
			f.reportData = append([]byte{}, rd...)
			if f.err != nil {
				return nil, f.err
			}
			return []byte("quote"), nil
		},
		extend: func(_ fdDevice, data []byte, index uint8) error {
			if f.err != nil {
				return f.err
			}
			reg := int(index)
			if f.extendTo >= 0 {
				reg = f.extendTo
			}
			f.regs[reg+1] = extendedValue(f.regs[reg+1], data)
			return nil
		},
		measure: func(fdDevice) ([5][48]byte, error) { return f.regs, f.err },
	}
}

func TestLegacyDevice(t *testing.T) {
	ctx := context.Background()
	fake := &fakeLegacy{extendTo: -1}
	fd := &fakeFd{}
	dev, err := openLegacyWith(func() (fdDevice, error) { return fd, nil }, fake.ops())()
	if err != nil {
		t.Fatal(err)
	}
	rd := ReportData([]byte("u"), []byte("n"))
	q, err := dev.Quote(ctx, rd)
	if err != nil || string(q) != "quote" || !bytes.Equal(fake.reportData, rd[:]) {
		t.Fatalf("Quote() = %q, %v with report data %x; want the fake's quote over %x", q, err, fake.reportData, rd)
	}
	if err := dev.ExtendRTMR(ctx, 3, []byte("event")); err != nil {
		t.Fatalf("ExtendRTMR() = %v", err)
	}
	m, err := dev.Measurements(ctx)
	if err != nil || m[4] != extendedValue([48]byte{}, []byte("event")) {
		t.Fatalf("Measurements() = %x, %v; want RTMR3 extended", m[4], err)
	}
	if err := dev.ExtendRTMR(ctx, 4, nil); err == nil {
		t.Error("ExtendRTMR(4) = nil error")
	}
	fake.extendTo = 2
	if err := dev.ExtendRTMR(ctx, 3, []byte("event")); err == nil || !strings.Contains(err.Error(), "another register") {
		t.Errorf("ExtendRTMR() when the driver extends RTMR2 = %v, want an error naming another register", err)
	}
	fake.err = syscall.ENOTTY
	if _, err := dev.Quote(ctx, rd); !errors.Is(err, syscall.ENOTTY) {
		t.Errorf("Quote() with failing ioctl = %v, want ENOTTY", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := dev.Quote(cancelled, rd); !errors.Is(err, context.Canceled) {
		t.Errorf("Quote(cancelled) = %v", err)
	}
	if err := dev.Close(); err != nil || !fd.closed {
		t.Errorf("Close() = %v, closed %v", err, fd.closed)
	}
}

// fakeConfigfs simulates configfs-tsm and the measurement-register files on an in-memory filesystem: creating a
// report directory populates its attributes, writing inblob bumps generation and produces outblob, and writing a
// 48-byte digest to an RTMR file extends it.
type fakeConfigfs struct {
	afero.Fs
	reportDir, mrDir string
	provider         string
	quote            func(inblob []byte) []byte
	extraGeneration  bool // simulate a concurrent writer

	mu      sync.Mutex
	removed []string
}

func newFakeConfigfs(t *testing.T, withMRs bool) *fakeConfigfs {
	t.Helper()
	f := &fakeConfigfs{
		Fs: afero.NewMemMapFs(), reportDir: "/sys/kernel/config/tsm/report", mrDir: "/sys/class/misc/tdx_guest/measurements",
		provider: "tdx_guest\n",
		quote:    func(in []byte) []byte { return append([]byte("QUOTE:"), in...) },
	}
	if err := f.MkdirAll(f.reportDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if withMRs {
		for _, n := range []string{"mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3"} {
			v := make([]byte, 48)
			if n == "mrtd" {
				v = bytes.Repeat([]byte{0x42}, 48)
			}
			if err := afero.WriteFile(f.Fs, path.Join(f.mrDir, n+":sha384"), v, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return f
}

func (f *fakeConfigfs) Mkdir(name string, perm os.FileMode) error {
	if err := f.Fs.Mkdir(name, perm); err != nil {
		return err
	}
	for attr, v := range map[string]string{"provider": f.provider, "generation": "0\n", "inblob": "", "outblob": ""} {
		if err := afero.WriteFile(f.Fs, path.Join(name, attr), []byte(v), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeConfigfs) Remove(name string) error {
	f.mu.Lock()
	f.removed = append(f.removed, name)
	f.mu.Unlock()
	return f.RemoveAll(name)
}

func (f *fakeConfigfs) OpenFile(name string, flag int, perm os.FileMode) (afero.File, error) {
	file, err := f.Fs.OpenFile(name, flag, perm)
	if err != nil || flag&(os.O_WRONLY|os.O_RDWR) == 0 {
		return file, err
	}
	if flag&(os.O_CREATE|os.O_TRUNC) != 0 {
		return nil, errors.New("configfs and sysfs attributes are not created or truncated")
	}
	return &attrWriter{File: file, fs: f, name: name}, nil
}

// attrWriter applies an attribute's effect when the write is committed at close.
type attrWriter struct {
	afero.File
	fs   *fakeConfigfs
	name string
	buf  []byte
}

func (w *attrWriter) Write(b []byte) (int, error) {
	w.buf = append(w.buf, b...)
	return len(b), nil
}

func (w *attrWriter) Close() error {
	if err := w.File.Close(); err != nil {
		return err
	}
	fs, dir, base := w.fs, path.Dir(w.name), path.Base(w.name)
	switch {
	case base == "inblob":
		if len(w.buf) > 64 {
			return syscall.EINVAL
		}
		gen := 1
		if fs.extraGeneration {
			gen = 2
		}
		if err := afero.WriteFile(fs.Fs, path.Join(dir, "generation"), []byte(strconv.Itoa(gen)+"\n"), 0o644); err != nil {
			return err
		}
		return afero.WriteFile(fs.Fs, path.Join(dir, "outblob"), fs.quote(w.buf), 0o644)
	case strings.HasPrefix(base, "rtmr") && dir == fs.mrDir:
		if len(w.buf) != 48 {
			return syscall.EINVAL
		}
		old, err := afero.ReadFile(fs.Fs, w.name)
		if err != nil {
			return err
		}
		v := sha512.Sum384(append(old, w.buf...))
		return afero.WriteFile(fs.Fs, w.name, v[:], 0o644)
	}
	return syscall.EACCES
}

func TestTSMDeviceQuote(t *testing.T) {
	ctx := context.Background()
	rd := ReportData([]byte("user"), []byte("nonce"))

	testCases := map[string]struct {
		mutate  func(*fakeConfigfs)
		wantErr string
	}{
		"quote":             {},
		"wrong provider":    {mutate: func(f *fakeConfigfs) { f.provider = "sev_guest\n" }, wantErr: "provider"},
		"concurrent writer": {mutate: func(f *fakeConfigfs) { f.extraGeneration = true }, wantErr: "concurrently"},
		"empty outblob":     {mutate: func(f *fakeConfigfs) { f.quote = func([]byte) []byte { return nil } }, wantErr: "empty outblob"},
		"oversized outblob": {mutate: func(f *fakeConfigfs) { f.quote = func([]byte) []byte { return make([]byte, 33<<10) } }, wantErr: "more than"},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			fs := newFakeConfigfs(t, true)
			if tc.mutate != nil {
				tc.mutate(fs)
			}
			dev, err := OpenTSM(fs, fs.reportDir, fs.mrDir)()
			if err != nil {
				t.Fatalf("OpenTSM() = %v", err)
			}
			defer dev.Close()
			q, err := dev.Quote(ctx, rd)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Quote() = %v, want error containing %q", err, tc.wantErr)
				}
			} else if err != nil || !bytes.Equal(q, append([]byte("QUOTE:"), rd[:]...)) {
				t.Fatalf("Quote() = %q, %v; want the quote over the report data", q, err)
			}
			if len(fs.removed) != 1 {
				t.Errorf("report directories removed: %v, want exactly the one created", fs.removed)
			}
			entries, _ := afero.ReadDir(fs.Fs, fs.reportDir)
			if len(entries) != 0 {
				t.Errorf("%d report directories left behind", len(entries))
			}
		})
	}
}

func TestTSMDeviceRegisters(t *testing.T) {
	ctx := context.Background()
	fs := newFakeConfigfs(t, true)
	dev, err := OpenTSM(fs, fs.reportDir, fs.mrDir)()
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.ExtendRTMR(ctx, 3, []byte("cluster")); err != nil {
		t.Fatalf("ExtendRTMR() = %v", err)
	}
	m, err := dev.Measurements(ctx)
	if err != nil {
		t.Fatalf("Measurements() = %v", err)
	}
	if m[0] != [48]byte(bytes.Repeat([]byte{0x42}, 48)) {
		t.Errorf("MRTD = %x", m[0])
	}
	if m[4] != extendedValue([48]byte{}, []byte("cluster")) || m[1] != [48]byte{} {
		t.Errorf("RTMR3 = %x, RTMR0 = %x; want RTMR3 extended with the event, RTMR0 untouched", m[4], m[1])
	}
	if err := dev.ExtendRTMR(ctx, -1, nil); err == nil {
		t.Error("ExtendRTMR(-1) = nil error")
	}

	// The lock register works through the same files.
	lock, err := NewLockRegister(OpenTSM(fs, fs.reportDir, fs.mrDir), 2)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := lock.Bootstrapped(ctx); err != nil || ok {
		t.Fatalf("Bootstrapped() = %v, %v; want false", ok, err)
	}
	if err := lock.MarkBootstrapped(ctx, []byte("id")); err != nil {
		t.Fatal(err)
	}
	if ok, err := lock.Bootstrapped(ctx); err != nil || !ok {
		t.Fatalf("Bootstrapped() after mark = %v, %v; want true", ok, err)
	}
}

// Without the measurement-register files (kernels before 6.16) measurements come from a quote and RTMR extend
// fails.
func TestTSMDeviceWithoutRegisterFiles(t *testing.T) {
	ctx := context.Background()
	fs := newFakeConfigfs(t, false)
	fs.quote = func([]byte) []byte { return blobs.TDXQuote() }
	dev, err := OpenTSM(fs, fs.reportDir, fs.mrDir)()
	if err != nil {
		t.Fatal(err)
	}
	m, err := dev.Measurements(ctx)
	if err != nil {
		t.Fatalf("Measurements() = %v", err)
	}
	q, _ := ParseQuote(blobs.TDXQuote())
	if m != q.Measurements() {
		t.Error("Measurements() differ from the quote's")
	}
	if err := dev.ExtendRTMR(ctx, 3, nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ExtendRTMR() without register files = %v, want not exist", err)
	}
}

func TestOpenTSMWithoutConfigfs(t *testing.T) {
	if _, err := OpenTSM(afero.NewMemMapFs(), TSMReportDir, MeasurementsDir)(); !errors.Is(err, ErrNoDevice) {
		t.Errorf("OpenTSM() without report dir = %v, want %v", err, ErrNoDevice)
	}
}

// OpenAutoUnder finds the interfaces under another root: configfs-tsm first, then the legacy device, else
// ErrNoDevice naming the root.
func TestOpenAutoUnder(t *testing.T) {
	root := t.TempDir()
	if _, err := OpenAutoUnder(root)(); !errors.Is(err, ErrNoDevice) || !strings.Contains(err.Error(), root) {
		t.Fatalf("OpenAutoUnder(empty root) = %v, want %v naming %s", err, ErrNoDevice, root)
	}

	legacy := filepath.Join(root, LegacyGuestDevice)
	if err := os.MkdirAll(filepath.Dir(legacy), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(legacy, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// Without berth_qpl the legacy backend refuses, naming the device; with it the file opens.
	dev, err := OpenAutoUnder(root)()
	if err != nil && !strings.Contains(err.Error(), legacy) {
		t.Fatalf("OpenAutoUnder(root with %s) = %v, want the legacy backend", LegacyGuestDevice, err)
	}
	if err == nil {
		if _, ok := dev.(*legacyDevice); !ok {
			t.Fatalf("OpenAutoUnder(root with %s) = %T, want the legacy backend", LegacyGuestDevice, dev)
		}
		_ = dev.Close()
	}

	if err := os.MkdirAll(filepath.Join(root, TSMReportDir), 0o755); err != nil {
		t.Fatal(err)
	}
	dev, err = OpenAutoUnder(root)()
	if err != nil {
		t.Fatalf("OpenAutoUnder(root with configfs-tsm) = %v", err)
	}
	defer dev.Close()
	tsm, ok := dev.(*tsmDevice)
	if !ok || tsm.reportDir != filepath.Join(root, TSMReportDir) || tsm.mrDir != filepath.Join(root, MeasurementsDir) {
		t.Fatalf("OpenAutoUnder(root with configfs-tsm) = %#v, want configfs-tsm under %s", dev, root)
	}
}
