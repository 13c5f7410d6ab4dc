package components

import (
	"context"
	"fmt"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/internal/webhook/install"
)

// installWebhook runs the webhook's installer (internal/webhook/install) when Config.WebhookImage
// names an image; the policy comes from the init request.
func (i *Installer) installWebhook(ctx context.Context, kubeconfigPath string, job *initcluster.Job) error {
	if i.cfg.WebhookImage == "" {
		_, _ = fmt.Fprintln(job.Out, "[berth] image-policy webhook not installed: no webhook image configured (--webhook-image)")
		return nil
	}
	w, err := install.NewFromKubeconfig(install.Config{Image: i.cfg.WebhookImage, ImagePullPolicy: i.cfg.ImagePullPolicy, Policy: job.Req.ImagePolicy}, kubeconfigPath, job.Out)
	if err != nil {
		return err
	}
	_, err = w.Install(ctx)
	return err
}
