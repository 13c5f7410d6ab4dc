package command

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"k8s.io/apimachinery/pkg/util/wait"
)

// daemonEnv makes the test binary act as a daemon that starts one child through Runner and then
// waits to be killed (TestChildrenDieWithDaemon).
const daemonEnv = "BERTH_COMMAND_TEST_DAEMON"

func TestMain(m *testing.M) {
	if dir := os.Getenv(daemonEnv); dir != "" {
		r := Runner{Children: NewChildren(filepath.Join(dir, "children.json"))}
		// The child records its own PID and its background grandchild's, then waits for both.
		_ = r.Run(context.Background(), nil, "sh", "-c",
			`sleep 600 & echo $! > "$0/grandchild.tmp" && mv "$0/grandchild.tmp" "$0/grandchild"; echo $$ > "$0/child.tmp" && mv "$0/child.tmp" "$0/child"; wait`, dir)
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// dead says whether pid is gone or a zombie (this host's PID 1 may not reap orphans).
func dead(pid int) bool {
	st, err := readStat(pid)
	return err != nil || st.state == "Z" || st.state == "X"
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true,
		func(context.Context) (bool, error) { return cond(), nil }); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func readPID(t *testing.T, path string) int {
	t.Helper()
	var pid int
	waitFor(t, path, func() bool {
		b, err := os.ReadFile(path)
		if err != nil {
			return false
		}
		pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err == nil
	})
	return pid
}

// TestChildrenDieWithDaemon kills a daemon with SIGKILL while its child runs: the child dies with it
// (Pdeathsig), the grandchild (which Pdeathsig does not reach) survives until the next daemon's
// KillStale finds it through the record, and KillStale leaves every other process alone.
func TestChildrenDieWithDaemon(t *testing.T) {
	dir := t.TempDir()
	daemon := exec.Command(os.Args[0], "-test.run=^$") //nolint:noctx // killed below, by PID
	daemon.Env = append(os.Environ(), daemonEnv+"="+dir)
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = daemon.Process.Kill(); _ = daemon.Wait() })
	child := readPID(t, filepath.Join(dir, "child"))
	grandchild := readPID(t, filepath.Join(dir, "grandchild"))
	t.Cleanup(func() { _ = syscall.Kill(grandchild, syscall.SIGKILL) })
	waitFor(t, "the child in the record", func() bool {
		b, err := os.ReadFile(filepath.Join(dir, "children.json"))
		return err == nil && strings.Contains(string(b), fmt.Sprintf(`"pid":%d`, child))
	})

	// Bystanders: a process of another group and one of the child's session but not its group.
	other := exec.Command("sleep", "600") //nolint:noctx // killed below, by PID
	other.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })

	if err := daemon.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = daemon.Wait()
	waitFor(t, "the child to die with the daemon", func() bool { return dead(child) })
	if dead(grandchild) {
		t.Fatal("the grandchild died too: this test no longer shows what KillStale is for")
	}

	killed, err := NewChildren(filepath.Join(dir, "children.json")).KillStale()
	if err != nil {
		t.Fatalf("KillStale() = %v", err)
	}
	if len(killed) != 1 || killed[0].PID != grandchild || killed[0].Name != "sleep" || killed[0].Group.PID != child {
		t.Fatalf("KillStale() killed %+v, want only the grandchild %d of group %d", killed, grandchild, child)
	}
	waitFor(t, "the grandchild to die", func() bool { return dead(grandchild) })
	if dead(other.Process.Pid) {
		t.Error("KillStale killed a process of another group")
	}
	// The record is empty now: a second call kills nothing.
	if killed, err := NewChildren(filepath.Join(dir, "children.json")).KillStale(); err != nil || len(killed) != 0 {
		t.Errorf("second KillStale() = %+v, %v; want nothing", killed, err)
	}
}

// TestKillStaleNeedsTheRecordedIdentity: a group whose session or start time differ from the
// record (a reused PID) is not touched; a missing record is no error.
func TestKillStaleNeedsTheRecordedIdentity(t *testing.T) {
	dir := t.TempDir()
	proc := exec.Command("sleep", "600") //nolint:noctx // killed below, by PID
	proc.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proc.Process.Kill(); _ = proc.Wait() })
	st, err := readStat(proc.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "children.json")
	if killed, err := NewChildren(path).KillStale(); err != nil || killed != nil {
		t.Fatalf("KillStale() without a record = %v, %v", killed, err)
	}
	for name, rec := range map[string]Child{
		"other session":    {PID: proc.Process.Pid, Session: st.session + 1, StartTime: st.startTime},
		"later start time": {PID: proc.Process.Pid, Session: st.session, StartTime: st.startTime + 1},
	} {
		data := fmt.Sprintf(`[{"name":"sleep","pid":%d,"session":%d,"startTime":%d}]`, rec.PID, rec.Session, rec.StartTime)
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		if killed, err := NewChildren(path).KillStale(); err != nil || len(killed) != 0 {
			t.Errorf("%s: KillStale() = %+v, %v; want nothing killed", name, killed, err)
		}
	}
	if dead(proc.Process.Pid) {
		t.Fatal("a process whose identity differs from the record was killed")
	}
	// The matching record kills it.
	data := fmt.Sprintf(`[{"name":"sleep","pid":%d,"session":%d,"startTime":%d}]`, proc.Process.Pid, st.session, st.startTime)
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	if killed, err := NewChildren(path).KillStale(); err != nil || len(killed) != 1 {
		t.Fatalf("KillStale() with the matching record = %+v, %v", killed, err)
	}
	_ = proc.Wait()
	if err := os.WriteFile(path, []byte("not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := NewChildren(path).KillStale(); err == nil {
		t.Error("KillStale() on a damaged record: no error")
	}
}

// TestCancelSignalsTheGroup: a cancelled Run terminates the program's background children too.
func TestCancelSignalsTheGroup(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- Runner{}.Run(ctx, nil, "sh", "-c", `sleep 600 & echo $! > "$0/bg.tmp" && mv "$0/bg.tmp" "$0/bg"; wait`, dir)
	}()
	bg := readPID(t, filepath.Join(dir, "bg"))
	t.Cleanup(func() { _ = syscall.Kill(bg, syscall.SIGKILL) })
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run() after cancel = %v", err)
	}
	waitFor(t, "the background child to get the group's SIGTERM", func() bool { return dead(bg) })
}

func TestParseStat(t *testing.T) {
	st, err := parseStat("42 (a (weird) name) S 1 42 40 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 1234 0 0")
	if err != nil || st.comm != "a (weird) name" || st.state != "S" || st.pgrp != 42 || st.session != 40 || st.startTime != 1234 {
		t.Fatalf("parseStat() = %+v, %v", st, err)
	}
	for _, bad := range []string{"", "42 no parens", "42 (x) S 1 2", "42 (x) S 1 a b 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 x 0"} {
		if _, err := parseStat(bad); err == nil {
			t.Errorf("parseStat(%q): no error", bad)
		}
	}
}
