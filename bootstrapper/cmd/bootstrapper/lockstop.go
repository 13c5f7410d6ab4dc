package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/berth-k8s/berth/bootstrapper/podstop"
)

// podStopTimeout bounds stopping and removing the pod sandboxes of a locked node: a runtime that
// does not answer leaves the state disk open rather than the lock hanging.
const podStopTimeout = 2 * time.Minute

// runtimeStopTimeout bounds the wait for the container runtime to end after SIGTERM.
const runtimeStopTimeout = time.Minute

// lockStop is the stop callback of bootstage.Stage.KeepCheckingIn: it stops everything that keeps
// files open on the state disk of a node locked while it runs, in order: the kubelet, the pod
// sandboxes through the runtime's CRI, the daemon's own handle on the kubelet's log (process mode),
// and, where the runtime keeps its root on the state disk, the runtime itself. The first failure
// ends it; the boot stage then leaves the disk open.
type lockStop struct {
	log       *zap.Logger
	kubelet   interface{ Stop(context.Context) error }
	criSocket string
	// closeLog closes the kubelet's log file on the state directory (nil: none).
	closeLog func() error
	// runtime stops the container runtime (nil: its root is not on the state disk).
	runtime interface{ Stop(context.Context) error }
}

func (l *lockStop) Stop(ctx context.Context) error {
	if err := l.kubelet.Stop(ctx); err != nil {
		return fmt.Errorf("stopping the kubelet: %w", err)
	}
	l.log.Info("kubelet stopped; stopping its pod sandboxes")
	rt, closeConn, err := podstop.Dial(l.criSocket)
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, podStopTimeout)
	n, err := podstop.StopAll(pctx, rt, l.log.Named("podstop"))
	cancel()
	_ = closeConn()
	if err != nil {
		return fmt.Errorf("stopping the pod sandboxes: %w", err)
	}
	l.log.Info("pod sandboxes stopped and removed", zap.Int("sandboxes", n))
	if l.closeLog != nil {
		if err := l.closeLog(); err != nil && !errors.Is(err, os.ErrClosed) {
			return fmt.Errorf("closing the kubelet's log: %w", err)
		}
	}
	if l.runtime != nil {
		if err := l.runtime.Stop(ctx); err != nil {
			return fmt.Errorf("stopping the container runtime: %w", err)
		}
		l.log.Info("container runtime stopped")
	}
	return nil
}

// ErrRuntimeStillRunning is returned when the container runtime did not end in time after SIGTERM.
var ErrRuntimeStillRunning = errors.New("the container runtime is still running")

// pidFileRuntime stops the container runtime whose process ID its own start wrote to a file (the
// mini cluster's containerd, whose root is on the node's state disk): SIGTERM through a pidfd,
// then a wait for the process to end. A missing file means no runtime runs.
type pidFileRuntime struct {
	path    string
	timeout time.Duration
}

func (p pidFileRuntime) Stop(ctx context.Context) error {
	b, err := os.ReadFile(p.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading the runtime's pid file: %w", err)
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil || pid <= 1 {
		return fmt.Errorf("the runtime's pid file %s holds no process ID", p.path)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening process %d: %w", pid, err)
	}
	defer func() { _ = unix.Close(fd) }()
	if err := unix.PidfdSendSignal(fd, unix.SIGTERM, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("signalling process %d: %w", pid, err)
	}
	timeout := p.timeout
	if timeout == 0 {
		timeout = runtimeStopTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// The pidfd turns readable when the process ends; poll in short slices to honour ctx.
	for {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 100)
		switch {
		case err != nil && !errors.Is(err, unix.EINTR):
			return fmt.Errorf("waiting for process %d: %w", pid, err)
		case n > 0:
			return nil
		case ctx.Err() != nil:
			return fmt.Errorf("process %d after SIGTERM: %w: %w", pid, ErrRuntimeStillRunning, ctx.Err())
		}
	}
}
