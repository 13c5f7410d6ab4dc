package main

import (
	"errors"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/logging"
)

// pluginCommand is the name the daemon runs itself under as the KMS plugin.
const pluginCommand = "kms-plugin"

// newKMSPluginCmd is the KMS plugin process a control plane's daemon runs as its child.
// Its failures (not its usage errors) are stored in *runErr, for the exit code.
func newKMSPluginCmd(runErr *error) *cobra.Command {
	cfg := kmsplugin.PluginConfig{Socket: kmsplugin.DefaultSocket}
	logCfg := logging.Defaults()
	cmd := &cobra.Command{
		Use:   pluginCommand,
		Short: "The KMS v2 plugin a control plane's bootstrapper runs as its child (not for direct use)",
		Long: `kms-plugin serves the KMS v2 API on a unix socket for the control plane's API server, which
encrypts Secrets at rest through it. The bootstrapper runs it as its child and writes it the
cluster's key-encryption keys on its standard input; it reports on its standard output which key
its API server encrypts under. It exits when its standard input ends, so it never outlives the
bootstrapper that holds its keys. Its log goes to standard error.`,
		Example: `  # what the bootstrapper runs on a control plane (keys arrive on stdin):
  bootstrapper kms-plugin --socket /run/berth/kms/kms.sock --metrics-listen :9004`,
		Hidden:        true,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := logCfg.Validate(); err != nil {
				return &configError{err}
			}
			log, err := logging.New(logCfg, os.Stderr)
			if err != nil {
				return &configError{err}
			}
			defer func() { _ = log.Sync() }()
			log = log.Named("kmsplugin")
			in, err := kmsplugin.Stdin()
			if err != nil {
				return err
			}
			err = kmsplugin.RunPlugin(cmd.Context(), cfg, in, os.Stdout, log)
			if errors.Is(err, kmsplugin.ErrParentGone) || err == nil {
				return nil
			}
			log.Error("KMS plugin failed", zap.Error(err))
			*runErr = err
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Socket, "socket", cfg.Socket, "unix socket to serve the KMS v2 API on")
	f.StringVar(&cfg.MetricsListen, "metrics-listen", cfg.MetricsListen, "HOST:PORT to serve /metrics on; empty serves none")
	logCfg.AddFlags(f)
	return cmd
}

// kmsPluginArgs are the arguments the daemon runs its plugin child with.
func kmsPluginArgs(cfg *config) []string {
	return []string{pluginCommand, "--socket", cfg.kmsSocket, "--metrics-listen", cfg.kmsMetrics,
		"--" + logging.LevelFlag, cfg.log.Level, "--" + logging.FormatFlag, cfg.log.Format}
}

// selfPath is the daemon's own binary, which runs the plugin.
func selfPath() (string, error) {
	p, err := os.Executable()
	if err != nil {
		return "", err
	}
	// A binary replaced while the daemon ran shows as "path (deleted)"; the plugin runs what is
	// installed now.
	return strings.TrimSuffix(p, " (deleted)"), nil
}
