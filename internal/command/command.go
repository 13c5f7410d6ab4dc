// Package command runs external programs (kubeadm, systemctl) for packages that declare a narrow
// interface for it, so tests can swap in commandtest.Recorder.
package command

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"syscall"
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
}

// Run runs name with args, copying its stdout and stderr to out (which may be nil). When ctx ends
// the program gets SIGTERM, and SIGKILL 10 s later.
func (r Runner) Run(ctx context.Context, out io.Writer, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = r.Env
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
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
