package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/afero"
	"github.com/spf13/cobra"

	"github.com/berth-k8s/berth/bootstrapper/certrenew"
	"github.com/berth-k8s/berth/internal/command"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/logging"
)

// newRenewCertsCmd is `bootstrapper renew-certs`: one check of this control plane's certificates,
// renewing them when due. The OS image's berth-cert-renew.timer runs it every hour; on hosts without
// systemd the daemon runs the same check itself. runErr receives the check's failure.
func newRenewCertsCmd(runErr *error) *cobra.Command {
	kubernetesDir, kubeadmPath, logCfg := "/etc/kubernetes", "kubeadm", logging.Defaults()
	cmd := &cobra.Command{
		Use:   "renew-certs",
		Short: "Renew this control plane's kubeadm certificates when they are due (one check)",
		Long: `renew-certs checks this node's control-plane certificates (kubeadm's PKI directory and the
kubeconfigs' client certificates) against the validity in the cluster's kubeadm configuration.
When one has less than a third of it left, or is valid for longer than it allows, it renews them
all with 'kubeadm certs renew all' and restarts kube-apiserver, kube-controller-manager and
kube-scheduler, waiting for each to be ready, under the control-plane slot (Lease
berth-system/berth-control-plane-slot, shared with control-plane joins): one such operation at a
time in the cluster. On a node that is not a control plane it does
nothing. It prints the earliest expiry; exit status 0 when the certificates are fine or were
renewed, 1 when the check or the renewal failed.

--kubernetes-dir, --kubeadm-path, --log-level and --log-format default to BERTH_KUBERNETES_DIR,
BERTH_KUBEADM_PATH, BERTH_LOG_LEVEL and BERTH_LOG_FORMAT.`,
		Example: `  bootstrapper renew-certs
  systemctl list-timers berth-cert-renew.timer`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags(), os.Getenv); err != nil {
				return err
			}
			if err := logCfg.Validate(); err != nil {
				return &configError{err}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := logging.New(logCfg, os.Stderr)
			if err != nil {
				return &configError{err}
			}
			defer func() { _ = log.Sync() }()
			r := certrenew.New(certrenew.Config{KubernetesDir: kubernetesDir}, log.Named("certrenew"), afero.NewOsFs(),
				&kubeadm.Runner{Path: kubeadmPath, Exec: command.Runner{}})
			res, err := r.Check(cmd.Context())
			switch {
			case errors.Is(err, certrenew.ErrNotControlPlane):
				_, _ = fmt.Fprintln(cmd.OutOrStdout(), "not a control plane: nothing to renew")
				return nil
			case err != nil:
				*runErr = err
				return err
			}
			action := "none due"
			if res.Renewed {
				action = "renewed"
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "control-plane certificates %s; earliest expiry %s (%s); validity %s\n",
				action, res.Earliest().UTC().Format("2006-01-02T15:04:05Z"), res.Certs[0].Name, res.Validity)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&kubernetesDir, "kubernetes-dir", kubernetesDir, "kubeadm's configuration directory")
	f.StringVar(&kubeadmPath, "kubeadm-path", kubeadmPath, "kubeadm binary")
	logCfg.AddFlags(f)
	return cmd
}
