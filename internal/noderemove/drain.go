package noderemove

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/kubectl/pkg/drain"
)

// evictRetry is how often an eviction a disruption budget refused is tried again on a node that is
// not Ready (on a Ready node kubectl's drain retries every 5 s).
const evictRetry = time.Second

// drainNode cordons node and evicts its pods through kubectl's drain: in parallel, disruption
// budgets respected (a refused eviction is retried), then waiting until the pods are gone. On a
// node that is not Ready (a dead machine cannot stop its pods) it evicts without waiting.
//
// Which pods go is Berth's rule, kept from before the move to kubectl's drain and wider than
// kubectl's defaults: every pod on the node but DaemonSet pods, static (mirror) pods and pods
// already terminating. Pods without a controller and pods with emptyDir data are evicted without
// asking for a force flag (kubectl drain refuses them unless --force and
// --delete-emptydir-data); a pod with any DaemonSet owner stays, controller or not. Evictions use
// the pods' own termination grace periods.
func drainNode(ctx context.Context, client kubernetes.Interface, node *corev1.Node, say func(string, ...any)) error {
	h := &drain.Helper{
		Ctx:                 ctx,
		Client:              client,
		Force:               true, // evict pods without a controller, as Berth always did
		IgnoreAllDaemonSets: true,
		DeleteEmptyDirData:  true,
		GracePeriodSeconds:  -1, // the pod's own grace period, as a plain eviction
		AdditionalFilters:   []drain.PodFilter{berthFilter(node.Name)},
		Out:                 io.Discard, // progress is said below, one line per step
		ErrOut:              io.Discard,
	}
	if deadline, ok := ctx.Deadline(); ok {
		h.Timeout = time.Until(deadline)
	}
	if err := drain.RunCordonOrUncordon(h, node, true); err != nil {
		return fmt.Errorf("cordoning %s: %w", node.Name, err)
	}
	say("cordoned %s", node.Name)
	list, errs := h.GetPodsForDeletion(node.Name)
	if len(errs) > 0 {
		return fmt.Errorf("listing pods of %s: %w", node.Name, errors.Join(errs...))
	}
	pods := list.Pods()
	if !nodeReady(node) {
		if err := evictAll(ctx, h, pods); err != nil {
			return err
		}
		say("evicted %d pods from %s", len(pods), node.Name)
		say("%s is not Ready: not waiting for its evicted pods to stop", node.Name)
		return nil
	}
	if err := h.DeleteOrEvictPods(pods); err != nil {
		return fmt.Errorf("evicting the pods of %s: %w", node.Name, err)
	}
	say("evicted %d pods from %s", len(pods), node.Name)
	return nil
}

// berthFilter keeps on the node what Berth's drain never evicted: pods with any DaemonSet owner,
// pods already terminating, and pods of another node.
func berthFilter(nodeName string) drain.PodFilter {
	return func(p corev1.Pod) drain.PodDeleteStatus {
		if p.DeletionTimestamp != nil || p.Spec.NodeName != nodeName {
			return drain.MakePodDeleteStatusSkip()
		}
		for _, o := range p.OwnerReferences {
			if o.Kind == "DaemonSet" {
				return drain.MakePodDeleteStatusSkip()
			}
		}
		return drain.MakePodDeleteStatusOkay()
	}
}

// evictAll evicts pods in parallel through policy/v1, retrying the evictions a disruption budget
// refuses, and does not wait for the pods to stop.
func evictAll(ctx context.Context, h *drain.Helper, pods []corev1.Pod) error {
	g, ctx := errgroup.WithContext(ctx)
	for _, p := range pods {
		g.Go(func() error {
			err := wait.PollUntilContextCancel(ctx, evictRetry, true, func(context.Context) (bool, error) {
				err := h.EvictPod(p, policyv1.SchemeGroupVersion)
				switch {
				case err == nil, apierrors.IsNotFound(err):
					return true, nil
				case apierrors.IsTooManyRequests(err): // a disruption budget says not now
					return false, nil
				}
				return false, err
			})
			if err != nil {
				return fmt.Errorf("evicting pod %s/%s: %w", p.Namespace, p.Name, err)
			}
			return nil
		})
	}
	return g.Wait()
}
