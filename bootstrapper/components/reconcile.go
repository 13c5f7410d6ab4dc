package components

import (
	"context"
	"io"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// RestartBudget bounds the webhook check after the daemon restarts on an initialized control plane:
// after a power cut of every node the API server, the pod network and the webhook pods all have to
// come back first (B11).
const RestartBudget = 10 * time.Minute

// Reconcile runs after the daemon restarts on the node that initialized the cluster. It never
// disarms anything: it waits for the webhook to serve again, probes every endpoint against the
// published CA, proves enforcement end to end, and repairs only what differs (a deleted
// configuration, a changed caBundle) once those checks pass. On a healthy cluster it writes
// nothing. The image policy is the one in the cluster (ConfigMap berth-webhook-policy); the node
// keeps no copy. Progress goes to out.
func (i *Installer) Reconcile(ctx context.Context, kubeconfigPath string, out io.Writer) error {
	if i.cfg.WebhookImage == "" {
		return nil
	}
	kube, dyn, err := clients(kubeconfigPath)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, RestartBudget)
	defer cancel()
	policy, err := clusterPolicy(ctx, kube)
	if err != nil {
		return err
	}
	w := NewWebhookInstaller(WebhookConfig{Image: i.cfg.WebhookImage, ImagePullPolicy: i.cfg.ImagePullPolicy, Policy: policy, Budget: RestartBudget}, kube, dyn, out)
	_, err = w.Install(ctx)
	return err
}

// clusterPolicy reads the image policy from its ConfigMap, retrying while the API server is not up.
func clusterPolicy(ctx context.Context, kube kubernetes.Interface) ([]byte, error) {
	wait := 500 * time.Millisecond
	for {
		cm, err := kube.CoreV1().ConfigMaps(Namespace).Get(ctx, WebhookPolicyConfigMap, metav1.GetOptions{})
		switch {
		case err == nil:
			p, ok := cm.Data["policy.yaml"]
			if !ok {
				return nil, failure(ErrWebhookInvalidConfiguration, "restore the policy (key policy.yaml) in ConfigMap "+Namespace+"/"+WebhookPolicyConfigMap, "the ConfigMap has no policy.yaml")
			}
			return []byte(p), nil
		case apierrors.IsNotFound(err):
			return nil, failure(ErrWebhookInvalidConfiguration, "restore ConfigMap "+Namespace+"/"+WebhookPolicyConfigMap+" or re-install the webhook", "the image policy ConfigMap is gone")
		}
		select {
		case <-ctx.Done():
			return nil, failure(ErrWebhookAPINotReady, "check that the control plane came back", "reading the image policy: %v", err)
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}
