// Command bootstrapper is the daemon every Berth node runs: it waits for `berth init` or a join
// ticket, bootstraps the node with kubeadm, and keeps the kubelet running where no systemd does.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitConfig  = 2
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:])
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string) int {
	cfg := defaultConfig()
	var runErr error
	cmd := &cobra.Command{
		Use:   "bootstrapper",
		Short: "Berth's node daemon: initializes or joins a Kubernetes cluster, once",
		Long: `bootstrapper runs on every Berth node. On a fresh node it serves the InitServer (for
'berth init') and runs the JoinClient (asking the cluster's joinservice for a join ticket) at the
same time; whichever takes the node's one-way lock first wins and the other stops. A node that was
bootstrapped before neither initializes nor joins again: it starts the kubelet.

Every flag can also be set through the environment: --state-dir is BERTH_STATE_DIR, and so on.
A flag on the command line wins over the environment.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			return applyEnv(cmd.Flags(), os.Getenv)
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := cfg.validate(); err != nil {
				return &configError{err}
			}
			runErr = daemon(cmd.Context(), cfg)
			return runErr
		},
	}
	cfg.register(cmd.Flags())
	cmd.AddCommand(newRenewCertsCmd(&runErr))
	cmd.AddCommand(newKMSPluginCmd(&runErr))
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	fmt.Fprintf(os.Stderr, "bootstrapper: %v\n", err)
	var ce *configError
	if errors.As(err, &ce) || runErr == nil {
		return exitConfig
	}
	return exitFailure
}

type configError struct{ err error }

func (e *configError) Error() string { return "configuration: " + e.err.Error() }
func (e *configError) Unwrap() error { return e.err }

// applyEnv sets every flag not given on the command line from BERTH_<FLAG_NAME>.
func applyEnv(flags *pflag.FlagSet, getenv func(string) string) error {
	var errs []error
	flags.VisitAll(func(f *pflag.Flag) {
		if f.Changed || f.Name == "help" {
			return
		}
		env := "BERTH_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(env); v != "" {
			if err := flags.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", env, err))
			}
		}
	})
	if len(errs) > 0 {
		return &configError{errors.Join(errs...)}
	}
	return nil
}
