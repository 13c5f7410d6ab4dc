package mini

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
)

// Cmd is one command line to run on the host.
type Cmd struct {
	Path string
	Args []string
	// Env is added to the environment of the berth process.
	Env []string
	// Log is the file a daemon's stdout and stderr are appended to (Start only).
	Log string
	// Cgroups are cgroup.procs files the daemon joins before it executes (Start only), so that
	// nothing it forks can escape them.
	Cgroups []string
}

func (c Cmd) String() string { return strings.Join(append([]string{c.Path}, c.Args...), " ") }

// Proc identifies a started daemon; StartTime (clock ticks since boot, field 22 of
// /proc/PID/stat) guards against PID reuse.
type Proc struct {
	Name      string `json:"name"`
	PID       int    `json:"pid"`
	StartTime uint64 `json:"startTime"`
}

// Runner runs commands and daemons on the host. Exec is the real one.
type Runner interface {
	// Run runs cmd to completion and returns its combined output.
	Run(ctx context.Context, cmd Cmd) ([]byte, error)
	// Start starts cmd as a detached daemon in its own session that outlives the berth process.
	Start(cmd Cmd) (Proc, error)
	// Alive reports whether p still runs (a zombie does not count).
	Alive(p Proc) bool
	// Signal sends sig to p if p is still the process that was started.
	Signal(p Proc, sig syscall.Signal) error
}

// Exec is the Runner for the real host.
type Exec struct{}

var _ Runner = Exec{}

// Run implements Runner.
func (Exec) Run(ctx context.Context, cmd Cmd) ([]byte, error) {
	c := exec.CommandContext(ctx, cmd.Path, cmd.Args...)
	c.Env = append(os.Environ(), cmd.Env...)
	var out bytes.Buffer
	c.Stdout = &out
	c.Stderr = &out
	if err := c.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("running %s: %w: %s", cmd, err, strings.TrimSpace(out.String()))
	}
	return out.Bytes(), nil
}

// Start implements Runner.
func (Exec) Start(cmd Cmd) (Proc, error) {
	path, args := cmd.Path, cmd.Args
	if len(cmd.Cgroups) > 0 {
		// sh joins the cgroups with its own PID, then execs the daemon under that same PID.
		args = append(append([]string{"-c", joinCgroupsScript, "sh", strconv.Itoa(len(cmd.Cgroups))}, cmd.Cgroups...), append([]string{cmd.Path}, cmd.Args...)...)
		path = "/bin/sh"
	}
	c := exec.Command(path, args...) //nolint:noctx // a detached daemon that outlives the berth process, so no context may end it
	c.Env = append(os.Environ(), cmd.Env...)
	c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if cmd.Log != "" {
		f, err := os.OpenFile(cmd.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return Proc{}, fmt.Errorf("opening log %s: %w", cmd.Log, err)
		}
		defer f.Close()
		c.Stdout = f
		c.Stderr = f
	}
	if err := c.Start(); err != nil {
		return Proc{}, fmt.Errorf("starting %s: %w", cmd, err)
	}
	pid := c.Process.Pid
	st, err := procStartTime(pid)
	if err != nil {
		return Proc{}, fmt.Errorf("reading start time of %s: %w", cmd.Path, err)
	}
	if err := c.Process.Release(); err != nil {
		return Proc{}, fmt.Errorf("releasing %s: %w", cmd.Path, err)
	}
	return Proc{Name: cmd.Path, PID: pid, StartTime: st}, nil
}

// joinCgroupsScript takes N, N cgroup.procs files and a command line.
const joinCgroupsScript = `n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 1; shift; n=$((n-1)); done; exec "$@"`

// Alive implements Runner.
func (Exec) Alive(p Proc) bool {
	state, st, err := procStat(p.PID)
	return err == nil && st == p.StartTime && state != "Z" && state != "X"
}

// Signal implements Runner.
func (e Exec) Signal(p Proc, sig syscall.Signal) error {
	if p.PID <= 1 {
		return fmt.Errorf("signalling pid %d: refusing", p.PID)
	}
	_, st, err := procStat(p.PID)
	if err != nil || st != p.StartTime {
		return nil // gone, or the PID now belongs to someone else
	}
	if err := syscall.Kill(p.PID, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("signalling pid %d: %w", p.PID, err)
	}
	return nil
}

func procStartTime(pid int) (uint64, error) {
	_, st, err := procStat(pid)
	return st, err
}

// procStat returns the state letter and start time of pid from /proc/PID/stat.
func procStat(pid int) (string, uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return "", 0, fmt.Errorf("reading stat of %d: %w", pid, err)
	}
	return parseStat(string(b))
}

// parseStat parses the state (field 3) and start time (field 22) of a /proc/PID/stat line; the
// command name (field 2) may contain spaces and parentheses, so fields are counted from its end.
func parseStat(s string) (string, uint64, error) {
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return "", 0, errors.New("parsing stat: no command field")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return "", 0, errors.New("parsing stat: too few fields")
	}
	st, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("parsing stat start time: %w", err)
	}
	return f[0], st, nil
}
