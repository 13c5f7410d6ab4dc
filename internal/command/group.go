package command

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

// A daemon's children (kubeadm, the kubelet under the process supervisor) must not outlive it: a
// kubeadm init left running by a crashed daemon races the next attempt's kubeadm reset, and a
// kubelet nobody supervises keeps restarting pods of a control plane that is being rebuilt. Two
// mechanisms, one for each way a child can be left behind:
//
//   - Group puts a child into a process group of its own and asks the kernel to SIGKILL it when
//     the thread that started it ends (Pdeathsig). RunGroup starts and waits for the child on one
//     locked OS thread, so that thread ends only with the daemon: kill -9 of the daemon kills
//     the child at once. A cancelled context signals the whole group, not only its leader.
//   - Pdeathsig is not inherited by grandchildren, and a child may have survived a daemon that
//     died before it could record it. Children keeps a record of every running group (leader PID,
//     process group, session and start time) in a file under the runtime directory (/run, cleared
//     at boot); KillStale, called when the daemon starts again, SIGKILLs every process still in a
//     recorded group. A process counts as a member only when its process group, session and start
//     time all agree with the record, so a reused PID is never hit.
//
// The host's PID 1 may not reap orphans: a killed orphan can stay a zombie, which is dead.

// Group prepares cmd to run in its own process group that is SIGKILLed when the starting thread
// ends, and makes a cancelled context send SIGTERM to the whole group.
func Group(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	cmd.Cancel = func() error {
		if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM); err != nil {
			return cmd.Process.Signal(syscall.SIGTERM)
		}
		return nil
	}
}

// RunGroup starts cmd (prepared with Group) and waits for it on one locked OS thread: the kernel
// delivers Pdeathsig when the thread that forked the child ends, and a locked thread ends only
// when the process does. While cmd runs it is recorded in children (nil: not recorded).
func RunGroup(cmd *exec.Cmd, children *Children) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cmd.Start(); err != nil {
		return err
	}
	pid := cmd.Process.Pid
	if children != nil {
		children.add(pid, filepath.Base(cmd.Path))
		defer children.remove(pid)
	}
	return cmd.Wait()
}

// Children records the process groups a daemon started (see Group), in a file that a restarted
// daemon reads to kill what its predecessor left behind. It is safe for concurrent use. A failure
// to write the record is reported to OnError and never fails the child: Pdeathsig still holds.
type Children struct {
	fs   afero.Fs
	path string
	// OnError, if set, receives failures to update the record.
	OnError func(error)

	mu     sync.Mutex
	groups map[int]Child
}

// Child is one recorded process group.
type Child struct {
	// Name is the program's base name.
	Name string `json:"name"`
	// PID is the group's leader, which is also the process group ID.
	PID int `json:"pid"`
	// Session is the leader's session ID.
	Session int `json:"session"`
	// StartTime is the leader's start time (clock ticks since boot, /proc/PID/stat field 22).
	StartTime uint64 `json:"startTime"`
}

// NewChildren returns the record kept at path (a file under the runtime directory).
func NewChildren(path string) *Children {
	return &Children{fs: afero.NewOsFs(), path: path, groups: map[int]Child{}}
}

// Path is the record's file.
func (c *Children) Path() string { return c.path }

func (c *Children) add(pid int, name string) {
	st, err := readStat(pid)
	if err != nil {
		return // gone already: nothing left to clean up
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.groups[pid] = Child{Name: name, PID: pid, Session: st.session, StartTime: st.startTime}
	c.saveLocked()
}

func (c *Children) remove(pid int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.groups, pid)
	c.saveLocked()
}

func (c *Children) saveLocked() {
	list := make([]Child, 0, len(c.groups))
	for _, g := range c.groups {
		list = append(list, g)
	}
	data, err := json.Marshal(list)
	if err == nil {
		err = atomicfile.Write(c.fs, c.path, data, 0o600)
	}
	if err != nil && c.OnError != nil {
		c.OnError(fmt.Errorf("recording child processes: %w", err))
	}
}

// Killed is a process KillStale killed.
type Killed struct {
	PID int
	// Name is the process's command name (/proc/PID/comm).
	Name string
	// Group is the recorded group it belonged to.
	Group Child
}

// KillStale SIGKILLs every process still in a group a previous daemon recorded, then empties the
// record. Call it once at start, before the daemon starts children of its own.
func (c *Children) KillStale() ([]Killed, error) {
	data, err := afero.ReadFile(c.fs, c.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading child record: %w", err)
	}
	var recorded []Child
	if len(strings.TrimSpace(string(data))) > 0 {
		if err := json.Unmarshal(data, &recorded); err != nil {
			return nil, fmt.Errorf("parsing child record %s: %w", c.path, err)
		}
	}
	killed, err := killMembers(recorded)
	if err != nil {
		return killed, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.groups = map[int]Child{}
	c.saveLocked()
	return killed, nil
}

// killMembers kills every live process that belongs to one of groups.
func killMembers(groups []Child) ([]Killed, error) {
	if len(groups) == 0 {
		return nil, nil
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("listing processes: %w", err)
	}
	self := os.Getpid()
	var killed []Killed
	var errs []error
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 1 || pid == self {
			continue
		}
		st, err := readStat(pid)
		if err != nil || st.state == "Z" || st.state == "X" {
			continue
		}
		for _, g := range groups {
			if !g.owns(st) {
				continue
			}
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				errs = append(errs, fmt.Errorf("killing stale %s (pid %d): %w", st.comm, pid, err))
				break
			}
			killed = append(killed, Killed{PID: pid, Name: st.comm, Group: g})
			break
		}
	}
	return killed, errors.Join(errs...)
}

// owns says whether a process with st belongs to the recorded group: same process group and
// session, started no earlier than the leader.
func (g Child) owns(st procStat) bool {
	return g.PID > 1 && st.pgrp == g.PID && st.session == g.Session && st.startTime >= g.StartTime
}

// procStat is what KillStale reads of /proc/PID/stat.
type procStat struct {
	comm      string
	state     string
	pgrp      int
	session   int
	startTime uint64
}

func readStat(pid int) (procStat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, err
	}
	return parseStat(string(b))
}

// parseStat parses /proc/PID/stat: the command name (field 2) may hold spaces and parentheses, so
// the fields are counted from its closing parenthesis.
func parseStat(s string) (procStat, error) {
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return procStat{}, errors.New("parsing process stat: no command field")
	}
	f := strings.Fields(s[end+1:])
	if len(f) < 20 {
		return procStat{}, errors.New("parsing process stat: too few fields")
	}
	pgrp, err1 := strconv.Atoi(f[2])
	session, err2 := strconv.Atoi(f[3])
	start, err3 := strconv.ParseUint(f[19], 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil {
		return procStat{}, fmt.Errorf("parsing process stat: %w", err)
	}
	return procStat{comm: s[open+1 : end], state: f[0], pgrp: pgrp, session: session, startTime: start}, nil
}
