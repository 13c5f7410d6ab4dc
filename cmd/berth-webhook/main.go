// Command berth-webhook serves Berth's image-policy validating admission webhook (see internal/webhook).
//
// The first SIGTERM or SIGINT starts the drain (readiness fails, connections are closed after each
// response, serving continues for --shutdown-delay, then a graceful shutdown); a second one exits at
// once with status 1.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/logging"
	"github.com/berth-k8s/berth/internal/webhook"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "berth-webhook:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		listen, probeListen string
		cfg                 webhook.Config
		exempt              string
		logCfg              = logging.Defaults()
	)
	flag.StringVar(&listen, "listen", ":8443", "address of the admission (HTTPS) listener")
	flag.StringVar(&probeListen, "probe-listen", ":8081", "address of the plain-HTTP listener for /readyz, /livez and /metrics")
	flag.StringVar(&cfg.CertFile, "cert-file", "/etc/berth-webhook/tls/tls.crt", "serving certificate (PEM), hot-reloaded")
	flag.StringVar(&cfg.KeyFile, "key-file", "/etc/berth-webhook/tls/tls.key", "serving key (PEM), hot-reloaded")
	flag.StringVar(&cfg.PolicyFile, "policy-file", "/etc/berth-webhook/policy/policy.yaml", "image policy (YAML), hot-reloaded")
	flag.DurationVar(&cfg.ReloadInterval, "reload-interval", 2*time.Second, "how often the files are checked for changes")
	flag.DurationVar(&cfg.ShutdownDelay, "shutdown-delay", 10*time.Second, "how long to keep serving after SIGTERM")
	flag.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "bound of the graceful shutdown after the delay")
	flag.DurationVar(&cfg.HandlerDeadline, "handler-deadline", 4*time.Second, "deadline of one decision: the webhook configuration's timeoutSeconds minus 1 s")
	flag.StringVar(&exempt, "exempt-namespaces", "kube-system,kube-node-lease,kube-public", "comma-separated namespaces that are always allowed (the pod's own namespace is added)")
	logCfg.AddGoFlags(flag.CommandLine)
	flag.Parse()

	for _, ns := range strings.Split(exempt, ",") {
		if ns = strings.TrimSpace(ns); ns != "" {
			cfg.ExemptNamespaces = append(cfg.ExemptNamespaces, ns)
		}
	}
	if own := os.Getenv("POD_NAMESPACE"); own != "" {
		cfg.ExemptNamespaces = append(cfg.ExemptNamespaces, own)
	}
	logCfg.Sample = true // the API server's requests can make it log
	log, err := logging.New(logCfg, os.Stderr)
	if err != nil {
		return fmt.Errorf("creating logger: %w", err)
	}
	defer func() { _ = log.Sync() }()

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", listen)
	if err != nil {
		return fmt.Errorf("listening for admission reviews: %w", err)
	}
	probeLn, err := lc.Listen(ctx, "tcp", probeListen)
	if err != nil {
		ln.Close()
		return fmt.Errorf("listening for probes: %w", err)
	}

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-sigs
		log.Info("stop requested, draining", zap.String("signal", sig.String()))
		stop()
		sig = <-sigs
		log.Warn("second stop request, exiting at once", zap.String("signal", sig.String()))
		_ = log.Sync()
		os.Exit(1)
	}()
	return webhook.New(cfg, log).Serve(ctx, ln, probeLn)
}
