package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"
)

// Exit codes shared by every berth command; exitCodesHelp documents them in the root's --help.
const (
	exitOK       = 0
	exitFailure  = 1
	exitUsage    = 2
	exitRejected = 3 // attestation or policy said no
	// exitInterrupted is the shell's code for a process ended by SIGINT (128+2); berth uses it for
	// SIGTERM too, so that a script tells "stopped" from "failed".
	exitInterrupted = 130
)

// exitCodesHelp is the exit-code table of the root command's help.
const exitCodesHelp = `Exit codes:
  0    success (verify, policy check: the node or the evidence was accepted)
  1    failure: the work could not be done (node or API server unreachable, I/O, a timeout)
  2    usage: unknown command or flag, wrong arguments, a missing or invalid flag value, or an
       input file (config, policy, evidence, kubeconfig) that cannot be read or is invalid
  3    rejected: attestation or policy said no (verify, policy check, init, recover, kubeconfig),
       the master secret is not the cluster's (recover, kubeconfig), or etcd's
       quorum would not survive the removal (node remove)
  130  interrupted by SIGINT or SIGTERM`

// exitError carries a specific exit code up to Execute.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// usageErr is a usage error (exit code 2) with a formatted message.
func usageErr(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

// groupHelp is the RunE of a command that only groups others: without arguments it prints its
// help; with one (an unknown subcommand) its Args (cobra.NoArgs) fail first, a usage error.
func groupHelp(cmd *cobra.Command, _ []string) error { return cmd.Help() }

// Execute runs the CLI with args and returns the process exit code. When ctx ends (SIGINT, SIGTERM
// in cmd/berth) while a command fails, the code is exitInterrupted.
func Execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := NewRootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	ran := markRun(root)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return exitOK
	}
	code := exitCode(err, *ran)
	if ctx.Err() != nil {
		code = exitInterrupted
	}
	_, _ = fmt.Fprintf(stderr, "Error: %v\n", err)
	if code == exitUsage && cmd != nil {
		_, _ = fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", cmd.CommandPath())
	}
	return code
}

// exitCode maps err to an exit code: the code it carries, else exitUsage when the command never
// ran (cobra refused the command line: unknown command or flag, a bad flag value, wrong arguments,
// a required flag missing), else exitFailure.
func exitCode(err error, ran bool) int {
	var ee *exitError
	switch {
	case errors.As(err, &ee):
		return ee.code
	case !ran:
		return exitUsage
	}
	return exitFailure
}

// markRun wraps the Run and RunE of every command under root so that the returned flag says
// whether one of them started. Cobra checks the command line (flags, arguments, required flags,
// flag groups) before it calls them, so an error while the flag is false is cobra's refusal of
// the command line.
func markRun(root *cobra.Command) *bool {
	ran := new(bool)
	var walk func(*cobra.Command)
	walk = func(c *cobra.Command) {
		if run := c.RunE; run != nil {
			c.RunE = func(cmd *cobra.Command, args []string) error {
				*ran = true
				return run(cmd, args)
			}
		}
		if run := c.Run; run != nil {
			c.Run = func(cmd *cobra.Command, args []string) {
				*ran = true
				run(cmd, args)
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
	return ran
}
