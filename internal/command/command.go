// Package command runs external programs (kubeadm, systemctl) for packages that declare a narrow
// interface for it, so tests can swap in commandtest.Recorder. Every program runs in a process
// group of its own that dies with the daemon (group.go). Supervise keeps a long-running child (the
// kubelet, the KMS plugin) running: it starts it again with capped backoff whenever it exits.
package command

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"time"
)

// ExitError is returned when the program ran and exited non-zero.
type ExitError struct {
	Name string
	Code int
}

func (e *ExitError) Error() string { return fmt.Sprintf("%s exited with status %d", e.Name, e.Code) }

// Runner runs programs with os/exec. The zero value is ready to use.
type Runner struct {
	// Env, if non-nil, replaces the environment of every program.
	Env []string
	// Children, if set, records every running program so that a restarted daemon can kill what a
	// crashed one left behind (see Children.KillStale).
	Children *Children
}

// Run runs name with args, copying its stdout and stderr to out (which may be nil). When ctx ends
// the program's process group gets SIGTERM, and the program SIGKILL 10 s later. The program dies
// with this process (Group).
func (r Runner) Run(ctx context.Context, out io.Writer, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = r.Env
	cmd.Stdout = out
	cmd.Stderr = out
	Group(cmd)
	cmd.WaitDelay = 10 * time.Second
	err := RunGroup(cmd, r.Children)
	var exitErr *exec.ExitError
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("running %s: %w", name, ctx.Err())
	case errors.As(err, &exitErr):
		return &ExitError{Name: name, Code: exitErr.ExitCode()}
	default:
		return fmt.Errorf("running %s: %w", name, err)
	}
}
