package mini

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap/zaptest"
)

func TestParseLosetupJ(t *testing.T) {
	out := "/dev/loop3: [64769]:1234 (/var/lib/berth-mini/nodes/w1/state.img)\n/dev/loop12: []: (/x/state.img (deleted))\n\n"
	if got := parseLosetupJ(out); !slices.Equal(got, []string{"/dev/loop3", "/dev/loop12"}) {
		t.Errorf("parseLosetupJ = %v", got)
	}
	if got := parseLosetupJ(""); len(got) != 0 {
		t.Errorf("parseLosetupJ(empty) = %v", got)
	}
}

// loopFake simulates `losetup` for one image: attached lists the devices `-j` reports; `-d`
// detaches a device unless stuck.
type loopFake struct {
	attached []string
	stuck    bool
	detached []string
}

func (f *loopFake) respond(cmd Cmd) ([]byte, error) {
	if cmd.Path != "losetup" {
		return nil, nil
	}
	switch cmd.Args[0] {
	case "-j":
		var b strings.Builder
		for _, d := range f.attached {
			b.WriteString(d + ": [2049]:77 (" + cmd.Args[1] + ")\n")
		}
		return []byte(b.String()), nil
	case "-d":
		f.detached = append(f.detached, cmd.Args[1])
		if !f.stuck {
			f.attached = slices.DeleteFunc(f.attached, func(d string) bool { return d == cmd.Args[1] })
		}
	}
	return nil, nil
}

func diskCluster(t *testing.T, f *loopFake) (*Cluster, Node, *recorder) {
	cfg := testConfig(t.TempDir())
	rec := &recorder{respond: f.respond}
	cl := New(cfg, fakeEnv(t), rec, zaptest.NewLogger(t))
	n := cfg.Nodes()[1]
	if err := cl.createStateDisk(n); err != nil {
		t.Fatal(err)
	}
	return cl, n, rec
}

// A loop device that outlives the node's mounts is detached by name, after a bounded wait.
func TestDetachStateDiskLeftover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &loopFake{attached: []string{"/dev/loop7"}}
		cl, n, _ := diskCluster(t, f)
		start := time.Now()
		if err := cl.detachStateDisk(context.Background(), n); err != nil {
			t.Fatalf("detachStateDisk: %v", err)
		}
		if !slices.Equal(f.detached, []string{"/dev/loop7"}) {
			t.Errorf("detached %v, want /dev/loop7", f.detached)
		}
		if took := time.Since(start); took < loopSettle {
			t.Errorf("detached after %s, before the %s the kernel gets to detach it itself", took, loopSettle)
		}
	})
}

// No loop device: nothing is detached, no wait.
func TestDetachStateDiskNone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &loopFake{}
		cl, n, rec := diskCluster(t, f)
		start := time.Now()
		if err := cl.detachStateDisk(context.Background(), n); err != nil {
			t.Fatalf("detachStateDisk: %v", err)
		}
		if time.Since(start) != 0 || len(f.detached) != 0 || !strings.Contains(rec.all(), "losetup -j "+cl.cfg.StateDisk(n.Name)) {
			t.Errorf("took %s, detached %v, commands %q", time.Since(start), f.detached, rec.all())
		}
	})
}

// A loop device that cannot be detached stops the node from booting.
func TestDetachStateDiskStuck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &loopFake{attached: []string{"/dev/loop7"}, stuck: true}
		cl, n, _ := diskCluster(t, f)
		err := cl.detachStateDisk(context.Background(), n)
		if !errors.Is(err, ErrStateDiskAttached) || !strings.Contains(err.Error(), "/dev/loop7") {
			t.Fatalf("detachStateDisk = %v, want ErrStateDiskAttached naming /dev/loop7", err)
		}
	})
}

func TestCreateStateDiskKeepsExisting(t *testing.T) {
	cl, n, _ := diskCluster(t, &loopFake{})
	img := cl.cfg.StateDisk(n.Name)
	if err := os.WriteFile(img, []byte("formatted"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := cl.createStateDisk(n); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(img); string(b) != "formatted" {
		t.Errorf("existing disk overwritten: %q", b)
	}
	if filepath.Base(img) != "state.img" || filepath.Dir(img) != cl.cfg.NodeDir(n.Name) {
		t.Errorf("StateDisk = %s", img)
	}
}

func TestConfigRejectsDirHiddenInNodes(t *testing.T) {
	for _, dir := range []string{"/var/lib/berth/mini", "/var/lib/berth", "/run/mini", "/etc/kubernetes/x", "/var/lib/etcd/m"} {
		c := testConfig(dir)
		if err := c.Validate(); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("dir %s: Validate() = %v, want ErrInvalidConfig", dir, err)
		}
	}
	for _, dir := range []string{DefaultDir, "/var/lib/berthx", "/tmp/c", "/runner"} {
		if err := testConfig(dir).Validate(); err != nil {
			t.Errorf("dir %s: Validate() = %v", dir, err)
		}
	}
}
