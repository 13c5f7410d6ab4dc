package install

import (
	"context"
	"fmt"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	admissionv1ac "k8s.io/client-go/applyconfigurations/admissionregistration/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	admissionregistrationv1 "k8s.io/client-go/kubernetes/typed/admissionregistration/v1"

	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/webhook"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// Arming: the configuration goes live in two stages (the canary namespace, then every namespace but
// the exempt ones), each proven end to end through the API server and rolled back when the proof
// fails, so that a fail-closed configuration never points at a backend that failed its check.

// endToEndPoll is the pause between end-to-end attempts while the API server picks up a new
// configuration.
const endToEndPoll = 500 * time.Millisecond

// ValidatingWebhookConfiguration returns the configuration: the final one, or with canaryOnly the
// first stage, which matches only the canary namespace.
func (w *Installer) ValidatingWebhookConfiguration(caPEM []byte, canaryOnly bool) *unstructured.Unstructured {
	selector := metav1ac.LabelSelector().WithMatchExpressions(metav1ac.LabelSelectorRequirement().
		WithKey("kubernetes.io/metadata.name").WithOperator(metav1.LabelSelectorOpNotIn).WithValues(w.exemptNamespaces()...))
	if canaryOnly {
		selector = metav1ac.LabelSelector().WithMatchExpressions(metav1ac.LabelSelectorRequirement().
			WithKey("kubernetes.io/metadata.name").WithOperator(metav1.LabelSelectorOpIn).WithValues(webhookconfig.CanaryNamespace))
	}
	rule := func(group string, resources ...string) *admissionv1ac.RuleWithOperationsApplyConfiguration {
		return admissionv1ac.RuleWithOperations().
			WithAPIGroups(group).WithAPIVersions("v1").WithOperations(admissionv1.Create, admissionv1.Update).
			WithResources(resources...).WithScope(admissionv1.NamespacedScope)
	}
	return typed(admissionv1ac.ValidatingWebhookConfiguration(webhookconfig.ConfigName).
		WithLabels(ownLabels()).
		WithWebhooks(admissionv1ac.ValidatingWebhook().
			WithName(webhookconfig.HookName).
			WithAdmissionReviewVersions("v1").
			WithSideEffects(admissionv1.SideEffectClassNone).
			WithTimeoutSeconds(int32(w.cfg.TimeoutSeconds)).
			WithFailurePolicy(admissionv1.Fail).
			WithMatchPolicy(admissionv1.Equivalent).
			WithClientConfig(admissionv1ac.WebhookClientConfig().
				WithCABundle(caPEM...).
				WithService(admissionv1ac.ServiceReference().WithName(webhookconfig.Name).WithNamespace(namespace).WithPath(webhook.Path).WithPort(443))).
			WithRules(
				rule("", "pods", "pods/ephemeralcontainers", "replicationcontrollers"),
				rule("apps", "deployments", "replicasets", "statefulsets", "daemonsets"),
				rule("batch", "jobs", "cronjobs"),
			).
			WithNamespaceSelector(selector).
			WithObjectSelector(metav1ac.LabelSelector()).
			// Evaluated by the API server, so they hold with every webhook pod gone. Null-safe:
			// oldObject is null on CREATE, and an evaluation error would reject under Fail.
			WithMatchConditions(
				admissionv1ac.MatchCondition().WithName("not-terminating").
					WithExpression("oldObject == null || !has(oldObject.metadata.deletionTimestamp)"),
				admissionv1ac.MatchCondition().WithName("not-node-lease-csr").
					WithExpression("!(request.resource.resource in ['nodes', 'leases', 'certificatesigningrequests', 'events', 'namespaces'])"),
				admissionv1ac.MatchCondition().WithName("not-a-node").
					WithExpression("!has(request.userInfo.groups) || !('system:nodes' in request.userInfo.groups)"),
			)))
}

func (w *Installer) vwcs() admissionregistrationv1.ValidatingWebhookConfigurationInterface {
	return w.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()
}

func (w *Installer) arm(ctx context.Context, caPEM []byte) error {
	final := w.ValidatingWebhookConfiguration(caPEM, false)
	live, err := w.get(ctx, final)
	if err != nil {
		return failure(ErrApply, "check the API server and retry", "%v", err)
	}
	if live != nil && live.GetAnnotations()[webhookconfig.PausedAnnotation] == "true" {
		w.say("configuration %s is paused by the operator (annotation %s): left alone", webhookconfig.ConfigName, webhookconfig.PausedAnnotation)
		return nil
	}
	if live != nil && contains(live.Object, final.Object) {
		// Already armed: prove it end to end (dry-run, no write) and stop.
		return w.endToEnd(ctx)
	}
	if live != nil && contains(live.Object, withBundleOf(final, live).Object) {
		// Armed, and only the CA bundle changes (a rotation step): narrowing to the canary namespace
		// would stop enforcement elsewhere for a moment, so swap the bundle in place and prove it.
		return w.armStage(ctx, final, live)
	}
	// Stage 1: only the canary namespace. Stage 2: everything but the exempt namespaces.
	if err := w.armStage(ctx, w.ValidatingWebhookConfiguration(caPEM, true), live); err != nil {
		return err
	}
	return w.armStage(ctx, final, live)
}

// armStage applies cfg and proves it end to end; when either fails it restores live, or deletes the
// configuration when there was none: never leave a fail-closed configuration the check did not pass.
func (w *Installer) armStage(ctx context.Context, cfg, live *unstructured.Unstructured) error {
	if err := w.applyConfig(ctx, cfg); err != nil {
		w.rollback(ctx, live)
		return err
	}
	if err := w.endToEnd(ctx); err != nil {
		w.rollback(ctx, live)
		return err
	}
	return nil
}

// withBundleOf returns a copy of cfg whose webhooks carry the CA bundles of live's.
func withBundleOf(cfg, live *unstructured.Unstructured) *unstructured.Unstructured {
	out := cfg.DeepCopy()
	liveHooks, _, _ := unstructured.NestedSlice(live.Object, "webhooks")
	hooks, _, _ := unstructured.NestedSlice(out.Object, "webhooks")
	for n := range hooks {
		if n >= len(liveHooks) {
			break
		}
		bundle, _, _ := unstructured.NestedString(liveHooks[n].(map[string]any), "clientConfig", "caBundle")
		_ = unstructured.SetNestedField(hooks[n].(map[string]any), bundle, "clientConfig", "caBundle")
	}
	_ = unstructured.SetNestedSlice(out.Object, hooks, "webhooks")
	return out
}

func (w *Installer) applyConfig(ctx context.Context, cfg *unstructured.Unstructured) error {
	if err := w.objects.Apply(ctx, cfg); err != nil {
		return failure(ErrApply, "check the API server and retry", "%v", err)
	}
	stage := "armed for every namespace but the exempt ones"
	if sel, _, _ := unstructured.NestedSlice(cfg.Object, "webhooks"); len(sel) > 0 {
		if ms, _, _ := unstructured.NestedSlice(sel[0].(map[string]any), "namespaceSelector", "matchExpressions"); len(ms) > 0 && ms[0].(map[string]any)["operator"] == "In" {
			stage = "armed for the canary namespace " + webhookconfig.CanaryNamespace
		}
	}
	w.result.Writes = append(w.result.Writes, "apply ValidatingWebhookConfiguration "+cfg.GetName())
	w.say("configuration %s %s", cfg.GetName(), stage)
	return nil
}

// rollback restores the configuration as it was before this run, or deletes it when there was none:
// never leave a fail-closed configuration pointing at a backend that failed its check.
func (w *Installer) rollback(ctx context.Context, previous *unstructured.Unstructured) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if previous == nil {
		err := w.vwcs().Delete(ctx, webhookconfig.ConfigName, metav1.DeleteOptions{})
		if apierrors.IsNotFound(err) {
			return // nothing was created
		}
		if err != nil {
			w.say("rolling back: deleting configuration %s failed: %v; delete it by hand", webhookconfig.ConfigName, err)
			return
		}
		w.result.Writes = append(w.result.Writes, "delete ValidatingWebhookConfiguration "+webhookconfig.ConfigName)
		w.say("rolled back: configuration %s deleted", webhookconfig.ConfigName)
		return
	}
	restored := &unstructured.Unstructured{Object: map[string]any{"webhooks": previous.Object["webhooks"]}}
	restored.SetGroupVersionKind(previous.GroupVersionKind())
	restored.SetName(previous.GetName())
	restored.SetLabels(previous.GetLabels())
	if err := w.objects.Apply(ctx, restored); err != nil {
		w.say("rolling back: restoring configuration %s failed: %v", webhookconfig.ConfigName, err)
		return
	}
	w.result.Writes = append(w.result.Writes, "apply ValidatingWebhookConfiguration "+webhookconfig.ConfigName+" (rollback)")
	w.say("rolled back: configuration %s restored", webhookconfig.ConfigName)
}

// endToEnd proves through the API server that the webhook is invoked: a server-side dry-run create of
// a pod with a denied image in the canary namespace must be denied by the webhook naming a rule, and
// one with an allowed image must be admitted. The configuration may take a moment to reach the API
// server's webhook cache, so "not invoked" is retried for a few seconds.
func (w *Installer) endToEnd(ctx context.Context) error {
	pods := w.kube.CoreV1().Pods(webhookconfig.CanaryNamespace)
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldManager: apply.FieldManager}
	var last *Error
	// The window bounds the retries only; each attempt's calls run under ctx.
	_ = wait.PollUntilContextTimeout(ctx, endToEndPoll, w.cfg.EndToEndWindow, true, func(context.Context) (bool, error) {
		last = nil
		_, err := pods.Create(ctx, canaryPod("berth-webhook-canary-denied", canaryDeniedImage), dry)
		switch {
		case err == nil:
			last = failure(ErrConfigNotHonored, "check that the API server reaches the webhook (kube-apiserver logs, the configuration's namespaceSelector)",
				"a dry-run pod with image %s in namespace %s was admitted", canaryDeniedImage, webhookconfig.CanaryNamespace)
		case strings.Contains(err.Error(), "failed calling webhook"):
			last = failure(ErrCallFailed, "check the route from the API server to the webhook pods and the CA bundle", "%v", err)
			if w.bundleChanged(ctx) {
				// Waiting cannot help: the keeper's next pass (a change of the configuration
				// starts one at once) checks the new bundle.
				last.Detail += " (the configuration's caBundle changed during the check)"
				return true, nil
			}
		case !strings.Contains(err.Error(), webhookconfig.HookName) || !strings.Contains(err.Error(), "image policy rule"):
			last = failure(ErrConfigNotHonored, "check the admission chain of the API server", "the dry-run pod was rejected, but not by the webhook: %v", err)
		}
		if last == nil {
			if allowed := w.canaryAllowedImage(); allowed != "" {
				if _, err := pods.Create(ctx, canaryPod("berth-webhook-canary-allowed", allowed), dry); err != nil {
					last = failure(ErrUnexpectedDenial, "check the image policy and the webhook's logs", "a dry-run pod with image %s was rejected: %v", allowed, err)
				}
			}
		}
		return last == nil, nil
	})
	if last != nil {
		return last
	}
	w.say("end-to-end check passed: the API server sent the canary pods to the webhook")
	return nil
}

// Uninstall removes the configuration first and confirms it is gone, then the backend.
func (w *Installer) Uninstall(ctx context.Context) error {
	if err := w.vwcs().Delete(ctx, webhookconfig.ConfigName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting configuration %s: %w", webhookconfig.ConfigName, err)
	}
	err := retry(ctx, w.cfg.MaxBackoff, func() (bool, error) {
		_, err := w.vwcs().Get(ctx, webhookconfig.ConfigName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, fmt.Errorf("configuration %s still there: %w", webhookconfig.ConfigName, err)
		}
		return false, fmt.Errorf("configuration %s still there", webhookconfig.ConfigName)
	})
	if err != nil {
		return err
	}
	backend := []*unstructured.Unstructured{w.deployment(), w.pdb(), w.service(), w.policyConfigMap(),
		typed(corev1ac.Secret(webhookconfig.TLSSecret, namespace)), w.serviceAccount()}
	for _, o := range append(append(backend, keeperRBAC()...), w.canaryNamespace()) {
		res, err := w.objects.Resource(o)
		if err != nil {
			return fmt.Errorf("deleting %s %s: %w", o.GetKind(), o.GetName(), err)
		}
		if err := res.Delete(ctx, o.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("deleting %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return nil
}
