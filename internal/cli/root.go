// Package cli implements the berth command line: one file per command, wired together by NewRootCmd.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/internal/logging"
	"github.com/berth-k8s/berth/internal/version"
)

// Exit codes shared by every berth command.
const (
	exitOK       = 0
	exitFailure  = 1
	exitUsage    = 2
	exitRejected = 3 // attestation or policy said no
)

// exitError carries a specific exit code up to Execute.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// diagnostics is how the CLI logs (--log-level, --log-format) to stderr: client-go's and gRPC's
// lines and the mini cluster's progress. What a command reports is plain text on stdout.
var diagnostics = logging.Config{Level: "info", Format: logging.FormatConsole}

// NewRootCmd builds the berth command tree.
func NewRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "berth",
		Short: "Attested node bootstrapping for Kubernetes",
		Long: `berth is the operator's tool for Berth clusters.

Every node runs the bootstrapper daemon. berth init checks the first node's attestation and
sends it the secrets it needs to run kubeadm init; every later node proves itself to the
cluster's joinservice and joins on its own.`,
		Version:       version.Version,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if _, err := logging.New(diagnostics, cmd.ErrOrStderr()); err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			return nil
		},
	}
	diagnostics.AddFlags(root.PersistentFlags())
	root.AddCommand(
		newInitCmd(), newRecoverCmd(),
		newMiniCmd(),
		newVerifyCmd(), newPolicyCmd(),
		newStatusCmd(),
	)
	return root
}

// Execute runs the CLI with args and returns the process exit code.
func Execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := NewRootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	_, _ = fmt.Fprintf(stderr, "Error: %v\n", err)
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	return exitFailure
}
