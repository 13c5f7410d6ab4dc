package kubeadm

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
)

// Runner runs the kubeadm binary.
type Runner struct {
	// Path is the kubeadm binary; empty means "kubeadm" from PATH.
	Path string
	// IgnorePreflightErrors is passed to every command that runs preflight checks.
	IgnorePreflightErrors []string
	Exec                  commander
}

func (r *Runner) run(ctx context.Context, out io.Writer, args ...string) error {
	path := r.Path
	if path == "" {
		path = "kubeadm"
	}
	if err := r.Exec.Run(ctx, out, path, args...); err != nil {
		return fmt.Errorf("kubeadm %s: %w", strings.Join(subcommand(args), " "), err)
	}
	return nil
}

// subcommand returns the leading non-flag arguments, for error messages that never echo values.
func subcommand(args []string) []string {
	for i, a := range args {
		if strings.HasPrefix(a, "-") {
			return args[:i]
		}
	}
	return args
}

func (r *Runner) ignoreFlag(extra ...string) []string {
	checks := r.IgnorePreflightErrors
	if !slices.ContainsFunc(checks, func(c string) bool { return strings.EqualFold(c, "all") }) {
		// kubeadm refuses "all" beside named checks; "all" covers them.
		checks = append(slices.Clone(checks), extra...)
	}
	if len(checks) == 0 {
		return nil
	}
	return []string{"--ignore-preflight-errors=" + strings.Join(checks, ",")}
}

// EtcdDataCheck is kubeadm's preflight check that etcd's data directory is empty.
const EtcdDataCheck = "DirAvailable--var-lib-etcd"

// InitOnEtcdData runs `kubeadm init` as Init does on a node whose etcd data directory already holds
// the member kubeadm's local etcd is to run (a restore): EtcdDataCheck is passed over.
func (r *Runner) InitOnEtcdData(ctx context.Context, out io.Writer, configPath string, skip ...string) error {
	phases := append([]string{"certs"}, skip...)
	args := []string{"init", "--config", configPath, "--skip-token-print", "--skip-phases=" + strings.Join(phases, ",")}
	return r.run(ctx, out, append(args, r.ignoreFlag(EtcdDataCheck)...)...)
}

// Version writes kubeadm's version ("v1.37.2") to out.
func (r *Runner) Version(ctx context.Context, out io.Writer) error {
	return r.run(ctx, out, "version", "-o", "short")
}

// Certs generates the cluster's certificates (idempotent: existing valid certificates are kept).
func (r *Runner) Certs(ctx context.Context, out io.Writer, configPath string) error {
	return r.run(ctx, out, "init", "phase", "certs", "all", "--config", configPath)
}

// Init runs `kubeadm init`, skipping the certs phase (Berth runs it first) and any in skip.
func (r *Runner) Init(ctx context.Context, out io.Writer, configPath string, skip ...string) error {
	phases := append([]string{"certs"}, skip...)
	args := []string{"init", "--config", configPath, "--skip-token-print", "--skip-phases=" + strings.Join(phases, ",")}
	return r.run(ctx, out, append(args, r.ignoreFlag()...)...)
}

// Join runs `kubeadm join`.
func (r *Runner) Join(ctx context.Context, out io.Writer, configPath string) error {
	return r.run(ctx, out, append([]string{"join", "--config", configPath}, r.ignoreFlag()...)...)
}

// CertsRenew renews every certificate of this control plane that kubeadm can renew with its local
// CAs (`kubeadm certs renew all`): the API server's, etcd's, the front proxy client's and the client
// certificates in the kubeconfigs under kubernetesDir, each for the validity the cluster's kubeadm
// configuration gives (read through kubeconfig). The components must be restarted to use them.
func (r *Runner) CertsRenew(ctx context.Context, out io.Writer, kubernetesDir string) error {
	return r.run(ctx, out, "certs", "renew", "all",
		"--kubeconfig", filepath.Join(kubernetesDir, "admin.conf"), "--cert-dir", filepath.Join(kubernetesDir, "pki"))
}

// Reset undoes what init or join did to the node.
func (r *Runner) Reset(ctx context.Context, out io.Writer, criSocket string) error {
	args := []string{"reset", "--force"}
	if criSocket != "" {
		args = append(args, "--cri-socket", criSocket)
	}
	return r.run(ctx, out, args...)
}

// commander runs an external program.
type commander interface {
	// Run runs name with args and copies its stdout and stderr to out.
	Run(ctx context.Context, out io.Writer, name string, args ...string) error
}
