package statedisk

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/berth-k8s/berth/internal/command"
)

// fakeCryptsetup models one LUKS2 device, its mapper device and the mount point the way
// cryptsetup, mkfs.ext4, mount and umount behave, records every command, and fails the test if a
// key ever shows up in a command line or anywhere but standard input or /dev/fd/3.
type fakeCryptsetup struct {
	t                        *testing.T
	errorf                   func(format string, args ...any) // t.Errorf, or a collector in the negative test
	device, name, mountpoint string
	mountinfo                string

	mu        sync.Mutex
	calls     []Cmd
	secrets   [][]byte
	formatted bool
	key       []byte
	token     []byte
	active    bool
	mounted   bool
	failMkfs  bool
	// deviceError makes isLuks fail as cryptsetup does for a missing or unreadable device.
	deviceError bool
}

func newFakeLUKS(t *testing.T) (*LUKS, *fakeCryptsetup) {
	dir := t.TempDir()
	f := &fakeCryptsetup{
		t:          t,
		device:     "/dev/vdb",
		name:       "berth-state",
		mountpoint: filepath.Join(dir, "mnt"),
		mountinfo:  filepath.Join(dir, "mountinfo"),
	}
	f.errorf = t.Errorf
	f.writeMountinfo()
	l := NewLUKS(f.device, f.name, f.mountpoint, f, zaptest.NewLogger(t))
	l.mountinfo = f.mountinfo
	return l, f
}

// secret registers a key the fake must never see in a command line.
func (f *fakeCryptsetup) secret(k []byte) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.secrets = append(f.secrets, k)
	return k
}

func (f *fakeCryptsetup) writeMountinfo() {
	content := "22 1 252:1 / / rw - ext4 /dev/vda rw\n"
	if f.mounted {
		content += fmt.Sprintf("50 22 253:0 / %s rw - ext4 /dev/mapper/%s rw\n", f.mountpoint, f.name)
	}
	if err := os.WriteFile(f.mountinfo, []byte(content), 0o600); err != nil {
		f.t.Fatal(err)
	}
}

func exitErr(name string, code int) error {
	return fmt.Errorf("running %s: %w", name, &command.ExitError{Name: name, Code: code})
}

func (f *fakeCryptsetup) Run(_ context.Context, c Cmd) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	c.Args = slices.Clone(c.Args)
	c.Stdin = bytes.Clone(c.Stdin)
	f.calls = append(f.calls, c)
	for _, s := range f.secrets {
		for _, enc := range []string{string(s), hex.EncodeToString(s), base64.StdEncoding.EncodeToString(s)} {
			if strings.Contains(c.String(), enc) {
				f.errorf("a key is in the command line of %s", c.Args[0])
			}
		}
	}
	// --key-file must name a pipe: "-" (stdin) or /dev/fd/3 (the first extra file).
	if i := slices.Index(c.Args, "--key-file"); i >= 0 {
		switch c.Args[i+1] {
		case "-":
			if c.Stdin == nil {
				f.errorf("%s: --key-file - without stdin", c)
			}
		case "/dev/fd/3":
			if len(c.Files) == 0 {
				f.errorf("%s: --key-file /dev/fd/3 without an extra file", c)
			}
		default:
			f.errorf("%s: key file %s is not a pipe", c, c.Args[i+1])
		}
	}
	last := c.Args[len(c.Args)-1]
	switch c.Name {
	case "mkfs.ext4":
		if !f.active || last != "/dev/mapper/"+f.name || f.failMkfs {
			return exitErr("mkfs.ext4", 1)
		}
		return nil
	case "mount":
		if !f.active || f.mounted {
			return exitErr("mount", 32)
		}
		f.mounted = true
		f.writeMountinfo()
		return nil
	case "umount":
		if !f.mounted {
			return exitErr("umount", 32)
		}
		f.mounted = false
		f.writeMountinfo()
		return nil
	case "cryptsetup":
	default:
		f.t.Errorf("unexpected command %s", c)
		return exitErr(c.Name, 127)
	}
	switch c.Args[0] {
	case "luksFormat":
		if f.active {
			return exitErr("cryptsetup", 5)
		}
		f.formatted, f.key, f.token = true, bytes.Clone(c.Stdin), nil
	case "isLuks":
		if f.deviceError {
			return exitErr("cryptsetup", 4)
		}
		if !f.formatted {
			return exitErr("cryptsetup", 1)
		}
	case "status":
		if !f.active {
			return exitErr("cryptsetup", 4)
		}
	case "token":
		if !f.formatted {
			return exitErr("cryptsetup", 1)
		}
		switch c.Args[1] {
		case "export":
			if f.token == nil {
				return exitErr("cryptsetup", 1)
			}
			_, _ = c.Stdout.Write(f.token)
		case "import":
			if f.token != nil && !slices.Contains(c.Args, "--token-replace") {
				return exitErr("cryptsetup", 1)
			}
			var probe map[string]any
			if err := json.Unmarshal(c.Stdin, &probe); err != nil || probe["type"] != LUKSTokenType || probe["keyslots"] == nil {
				f.t.Errorf("token import of %q: not a valid token", c.Stdin)
			}
			f.token = bytes.Clone(c.Stdin)
		}
	case "open":
		if !f.formatted {
			return exitErr("cryptsetup", 1)
		}
		if !bytes.Equal(c.Stdin, f.key) {
			return exitErr("cryptsetup", cryptsetupWrongKey)
		}
		if slices.Contains(c.Args, "--test-passphrase") {
			return nil
		}
		if f.active {
			return exitErr("cryptsetup", 5)
		}
		f.active = true
	case "luksChangeKey":
		if len(c.Files) == 0 || !bytes.Equal(c.Files[0], f.key) {
			return exitErr("cryptsetup", cryptsetupWrongKey)
		}
		f.key = bytes.Clone(c.Stdin)
	case "close":
		if f.mounted {
			return exitErr("cryptsetup", 5)
		}
		if !f.active {
			return exitErr("cryptsetup", 4)
		}
		f.active = false
	default:
		f.t.Errorf("unexpected command %s", c)
		return exitErr("cryptsetup", 1)
	}
	return nil
}

// take returns the recorded commands and forgets them.
func (f *fakeCryptsetup) take() []Cmd {
	f.mu.Lock()
	defer f.mu.Unlock()
	calls := f.calls
	f.calls = nil
	return calls
}

func cmdLines(calls []Cmd) []string {
	var lines []string
	for _, c := range calls {
		lines = append(lines, c.String())
	}
	return lines
}

func TestLUKSFormatCommands(t *testing.T) {
	ctx := context.Background()
	l, f := newFakeLUKS(t)
	key := f.secret(randomKey(t))
	h, err := l.Format(ctx, key)
	if err != nil {
		t.Fatalf("Format() = %v", err)
	}
	calls := f.take()
	want := []string{
		"cryptsetup status berth-state",
		"cryptsetup luksFormat --batch-mode --type luks2 --cipher aes-xts-plain64 --integrity hmac-sha256 --sector-size 4096 " +
			"--pbkdf pbkdf2 --pbkdf-force-iterations 1000 --uuid " + h.UUID + " --label berth-state --key-file - /dev/vdb",
		"cryptsetup token import --token-id 0 --json-file - /dev/vdb",
		"cryptsetup open --type luks2 --key-file - /dev/vdb berth-state",
		"mkfs.ext4 -q -F -L berth-state /dev/mapper/berth-state",
		"mount -t ext4 /dev/mapper/berth-state " + f.mountpoint,
	}
	if got := cmdLines(calls); !slices.Equal(got, want) {
		t.Fatalf("Format() ran\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if !bytes.Equal(calls[1].Stdin, key) || !bytes.Equal(calls[3].Stdin, key) {
		t.Error("luksFormat and open did not get the key on stdin")
	}
	var token luksToken
	if err := json.Unmarshal(calls[2].Stdin, &token); err != nil || token.UUID != h.UUID || token.Type != "berth-state" {
		t.Errorf("imported token %s: %v", calls[2].Stdin, err)
	}
	for i, c := range calls {
		if i != 1 && i != 3 && bytes.Contains(c.Stdin, key) || len(c.Files) > 0 {
			t.Errorf("%s got the key", c)
		}
	}
	if l.Root() != f.mountpoint {
		t.Errorf("Root() = %s, want the mount point", l.Root())
	}
}

func TestLUKSRoundTrip(t *testing.T) {
	ctx := context.Background()
	l, f := newFakeLUKS(t)
	k1, k2, wrong := f.secret(randomKey(t)), f.secret(randomKey(t)), f.secret(randomKey(t))
	h, err := l.Format(ctx, k1)
	if err != nil {
		t.Fatalf("Format() = %v", err)
	}
	wantOpened(t, l, true)
	if got, err := l.Header(ctx); err != nil || !headersEqual(got, h) {
		t.Fatalf("Header() = %+v, %v; want %+v", got, err, h)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if f.active || f.mounted {
		t.Fatalf("after Close: active %v, mounted %v", f.active, f.mounted)
	}
	wantOpened(t, l, false)
	if err := l.Close(ctx); err != nil {
		t.Fatalf("Close() of a closed disk = %v", err)
	}

	if err := l.Open(ctx, wrong); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(wrong key) = %v, want ErrWrongKey", err)
	}
	if f.active || f.mounted {
		t.Fatal("Open with a wrong key changed something")
	}
	if err := l.Open(ctx, k1); err != nil {
		t.Fatalf("Open() = %v", err)
	}
	wantOpened(t, l, true)
	// Open again (daemon restart): the key is still checked, nothing is opened twice.
	if err := l.Open(ctx, wrong); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(wrong key) on an open disk = %v, want ErrWrongKey", err)
	}
	f.take()
	if err := l.Open(ctx, k1); err != nil {
		t.Fatalf("Open() of an open disk = %v", err)
	}
	if got := cmdLines(f.take()); !slices.Contains(got, "cryptsetup open --test-passphrase --type luks2 --key-file - /dev/vdb") {
		t.Fatalf("Open() of an open disk ran %q, want a --test-passphrase check", got)
	}

	if err := l.Rekey(ctx, wrong, k2); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Rekey(wrong old key) = %v, want ErrWrongKey", err)
	}
	f.take()
	if err := l.Rekey(ctx, k1, k2); err != nil {
		t.Fatalf("Rekey() = %v", err)
	}
	calls := f.take()
	want := "cryptsetup luksChangeKey --batch-mode --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file /dev/fd/3 /dev/vdb -"
	if len(calls) != 1 || calls[0].String() != want {
		t.Fatalf("Rekey() ran %q, want %q", cmdLines(calls), want)
	}
	if len(calls[0].Files) != 1 || !bytes.Equal(calls[0].Files[0], k1) || !bytes.Equal(calls[0].Stdin, k2) {
		t.Fatal("Rekey(): the old key must go through /dev/fd/3 and the new one through stdin")
	}

	if err := l.SetBinding(ctx, []byte("cluster"), []byte("binding")); err != nil {
		t.Fatalf("SetBinding() = %v", err)
	}
	if err := l.SetSealed(ctx, []byte("sealed")); err != nil {
		t.Fatalf("SetSealed() = %v", err)
	}
	if got := cmdLines(f.take()); !slices.Contains(got, "cryptsetup token import --token-id 0 --json-file - --token-replace /dev/vdb") {
		t.Fatalf("SetBinding/SetSealed ran %q, want a token replace", got)
	}
	got, err := l.Header(ctx)
	if want := (Header{UUID: h.UUID, ClusterID: []byte("cluster"), Binding: []byte("binding"), Sealed: []byte("sealed")}); err != nil || !headersEqual(got, want) {
		t.Fatalf("Header() = %+v, %v; want %+v", got, err, want)
	}

	if err := l.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}
	if err := l.Open(ctx, k1); !errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(key before rekey) = %v, want ErrWrongKey", err)
	}
	if err := l.Open(ctx, k2); err != nil {
		t.Fatalf("Open(new key) = %v", err)
	}
	if err := l.Open(ctx, []byte("short")); err == nil || errors.Is(err, ErrWrongKey) {
		t.Fatalf("Open(5-byte key) = %v, want a key length error", err)
	}
}

func TestLUKSNotFormatted(t *testing.T) {
	ctx := context.Background()
	l, f := newFakeLUKS(t)
	key := f.secret(randomKey(t))
	if _, err := l.Header(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() = %v, want ErrNotFormatted", err)
	}
	if err := l.Open(ctx, key); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Open() = %v, want ErrNotFormatted", err)
	}
	// luksFormat done, token import not: a format cut short.
	f.formatted, f.key = true, key
	if _, err := l.Header(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() without the token = %v, want ErrNotFormatted", err)
	}
	if f.active || f.mounted {
		t.Fatal("opened a disk that is not formatted")
	}
}

// TestLUKSFormatFailure: a format that fails after the device was opened closes it again.
func TestLUKSFormatFailure(t *testing.T) {
	ctx := context.Background()
	l, f := newFakeLUKS(t)
	f.failMkfs = true
	if _, err := l.Format(ctx, f.secret(randomKey(t))); err == nil {
		t.Fatal("Format() with a failing mkfs.ext4 = nil")
	}
	if f.active || f.mounted {
		t.Fatalf("after a failed Format: active %v, mounted %v", f.active, f.mounted)
	}
	wantOpened(t, l, false)
}

// TestLUKSForeignMount: another file system at the mount point is an error.
func TestLUKSForeignMount(t *testing.T) {
	l, f := newFakeLUKS(t)
	content := fmt.Sprintf("50 22 0:51 / %s rw - tmpfs tmpfs rw\n", f.mountpoint)
	if err := os.WriteFile(f.mountinfo, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	f.active = true
	if _, err := l.Opened(context.Background()); err == nil {
		t.Fatal("Opened() with a tmpfs at the mount point = nil error")
	}
}

// TestFakeCatchesKeyLeaks shows that the fake's checks fail a test whose commands carry a key in
// argv or in a key file that is not a pipe.
func TestFakeCatchesKeyLeaks(t *testing.T) {
	_, f := newFakeLUKS(t)
	key := f.secret(randomKey(t))
	var reports []string
	f.errorf = func(format string, args ...any) { reports = append(reports, fmt.Sprintf(format, args...)) }
	ctx := context.Background()
	_ = f.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"open", "--key-file", "/run/key", "/dev/vdb", "x"}})
	_ = f.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"open", "--key-file", "-", "/dev/vdb", hex.EncodeToString(key)}, Stdin: key})
	_ = f.Run(ctx, Cmd{Name: "cryptsetup", Args: []string{"luksChangeKey", "--key-file", "/dev/fd/3", "/dev/vdb", "-"}, Stdin: key})
	if len(reports) != 3 {
		t.Fatalf("the fake reported %q, want 3 reports (a file key, a key in argv, /dev/fd/3 without a pipe)", reports)
	}
}

// TestLUKSDeviceErrorIsNotBlank: a device error is an error, never "not formatted" (which would make
// the boot stage format, and so wipe, a disk bound to a cluster).
func TestLUKSDeviceErrorIsNotBlank(t *testing.T) {
	l, f := newFakeLUKS(t)
	f.formatted, f.deviceError = true, true
	_, err := l.Header(context.Background())
	if err == nil || errors.Is(err, ErrNotFormatted) {
		t.Fatalf("Header() on a failing device = %v, want an error other than ErrNotFormatted", err)
	}
}
