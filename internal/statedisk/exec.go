package statedisk

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/berth-k8s/berth/internal/command"
)

// Exec is the Runner for the real host: os/exec, like command.Runner, plus secrets through pipes.
// A failed program returns an error wrapping *command.ExitError, followed by the last line of its
// error output. The zero value is ready to use.
type Exec struct{}

var _ Runner = Exec{}

// execWaitDelay is how long a program gets after SIGTERM (when ctx ends) before SIGKILL.
const execWaitDelay = 10 * time.Second

// Run implements Runner.
func (Exec) Run(ctx context.Context, c Cmd) error {
	cmd := exec.CommandContext(ctx, c.Name, c.Args...)
	var output bytes.Buffer
	cmd.Stdout = &output
	if c.Stdout != nil {
		cmd.Stdout = c.Stdout
	}
	cmd.Stderr = &output
	if c.Stdin != nil {
		cmd.Stdin = bytes.NewReader(c.Stdin)
	}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = execWaitDelay

	// Each extra file is a pipe whose write end we fill and close before the program starts:
	// the pipe buffer (64 KiB) holds a key many times over, and nothing touches a file system.
	var readEnds []*os.File
	defer func() {
		for _, r := range readEnds {
			r.Close()
		}
	}()
	for _, data := range c.Files {
		r, w, err := os.Pipe()
		if err != nil {
			return fmt.Errorf("creating pipe for %s: %w", c.Name, err)
		}
		readEnds = append(readEnds, r)
		_, werr := w.Write(data)
		cerr := w.Close()
		if werr != nil || cerr != nil {
			return fmt.Errorf("filling pipe for %s: %w", c.Name, errors.Join(werr, cerr))
		}
	}
	cmd.ExtraFiles = readEnds

	err := cmd.Run()
	var exitErr *exec.ExitError
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("running %s: %w", c.Name, ctx.Err())
	case errors.As(err, &exitErr):
		return fmt.Errorf("running %s: %s: %w", c.Name, lastLine(output.String()), &command.ExitError{Name: c.Name, Code: exitErr.ExitCode()})
	default:
		return fmt.Errorf("running %s: %w", c.Name, err)
	}
}

// lastLine returns the last non-empty line of a program's output, for error messages.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	line := strings.TrimSpace(lines[len(lines)-1])
	if line == "" {
		return "no output"
	}
	const maxLen = 300
	if len(line) > maxLen {
		line = line[:maxLen] + "..."
	}
	return line
}

// exitCode returns the exit status of a program that ran and failed, or -1.
func exitCode(err error) int {
	var exitErr *command.ExitError
	if errors.As(err, &exitErr) {
		return exitErr.Code
	}
	return -1
}
