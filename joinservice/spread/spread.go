// Package spread keeps the image-policy webhook's replicas on different nodes, so that losing one
// node cannot take every replica away.
//
// The scheduler spreads the replicas when it places them (the Deployment's topology spread
// constraint), but it never moves a pod it placed, and the webhook is installed during init, when
// often only the first control plane is Ready: both replicas land there. Every joinservice replica
// therefore checks every Interval: when the Deployment is stable (no rollout in progress, every
// replica available), two of its ready pods share a node, and a Ready, schedulable node whose taints
// the pods tolerate runs none, it evicts the newest pod of the crowded node through the eviction
// API, so the webhook's PodDisruptionBudget (at most one replica unavailable) decides. The Deployment
// replaces the pod and the spread constraint places the new one on a node without one. Replicas
// that check at once cannot evict two pods: the budget refuses the second eviction (429), which
// this package takes as "not now".
package spread

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/go-logr/logr"
	"go.uber.org/zap"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// DefaultInterval is how often each replica checks the webhook's placement.
const DefaultInterval = 15 * time.Second

// Keeper evicts a webhook replica that shares a node while another node could run it.
type Keeper struct {
	client     kubernetes.Interface
	namespace  string
	deployment string
	log        *zap.Logger
	// Interval is the time between two checks of Run.
	Interval time.Duration
}

// New returns a Keeper of Deployment deployment in namespace.
func New(client kubernetes.Interface, namespace, deployment string, log *zap.Logger) *Keeper {
	if log == nil {
		log = zap.NewNop()
	}
	return &Keeper{client: client, namespace: namespace, deployment: deployment, log: log, Interval: DefaultInterval}
}

// Run checks every Interval until ctx ends. Failures are logged: the next check tries again. It
// returns nil when ctx ends.
func (k *Keeper) Run(ctx context.Context) error {
	t := time.NewTicker(k.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if _, err := k.Check(ctx); err != nil && ctx.Err() == nil {
			k.log.Warn("checking the webhook replicas' placement", zap.Error(err))
		}
	}
}

// Check makes one check and returns the pod it evicted, if any.
func (k *Keeper) Check(ctx context.Context) (string, error) {
	dep, err := k.client.AppsV1().Deployments(k.namespace).Get(ctx, k.deployment, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", nil // no webhook in this cluster
	}
	if err != nil {
		return "", fmt.Errorf("reading deployment %s: %w", k.deployment, err)
	}
	if !stable(dep) {
		return "", nil
	}
	sel, err := metav1.LabelSelectorAsSelector(dep.Spec.Selector)
	if err != nil {
		return "", fmt.Errorf("reading deployment %s's selector: %w", k.deployment, err)
	}
	pods, err := k.client.CoreV1().Pods(k.namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return "", fmt.Errorf("listing the webhook's pods: %w", err)
	}
	nodes, err := k.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return "", fmt.Errorf("listing nodes: %w", err)
	}
	victim, free := crowded(pods.Items, nodes.Items, dep.Spec.Template.Spec.Tolerations)
	if victim == nil {
		return "", nil
	}
	ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: victim.Name, Namespace: victim.Namespace}}
	err = k.client.CoreV1().Pods(victim.Namespace).EvictV1(ctx, ev)
	switch {
	case apierrors.IsTooManyRequests(err), apierrors.IsNotFound(err):
		return "", nil // the budget says not now, or it is gone already
	case err != nil:
		return "", fmt.Errorf("evicting pod %s: %w", victim.Name, err)
	}
	k.log.Info("webhook replicas shared a node: evicted one so that it is placed on another",
		zap.String("pod", victim.Name), zap.String("node", victim.Spec.NodeName), zap.String("freeNode", free))
	return victim.Name, nil
}

// stable reports whether dep is not rolling out and every replica is available.
func stable(dep *appsv1.Deployment) bool {
	want := int32(1)
	if dep.Spec.Replicas != nil {
		want = *dep.Spec.Replicas
	}
	s := dep.Status
	return s.ObservedGeneration >= dep.Generation && s.Replicas == want && s.UpdatedReplicas == want && s.AvailableReplicas == want
}

// crowded returns the newest of the ready pods on a node that runs more than one (of two created in
// the same second, the later name), when an eligible node runs none, and that node's name.
func crowded(pods []corev1.Pod, nodes []corev1.Node, tolerations []corev1.Toleration) (*corev1.Pod, string) {
	byNode := map[string][]*corev1.Pod{}
	for i := range pods {
		p := &pods[i]
		if p.DeletionTimestamp == nil && p.Spec.NodeName != "" && podReady(p) {
			byNode[p.Spec.NodeName] = append(byNode[p.Spec.NodeName], p)
		}
	}
	free := ""
	for i := range nodes {
		n := &nodes[i]
		if len(byNode[n.Name]) == 0 && eligible(n, tolerations) {
			free = n.Name
			break
		}
	}
	if free == "" {
		return nil, ""
	}
	names := make([]string, 0, len(byNode))
	for name := range byNode {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		ps := byNode[name]
		if len(ps) < 2 {
			continue
		}
		newest := ps[0]
		for _, p := range ps[1:] {
			if c := p.CreationTimestamp.Compare(newest.CreationTimestamp.Time); c > 0 || c == 0 && p.Name > newest.Name {
				newest = p
			}
		}
		return newest, free
	}
	return nil, ""
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// eligible reports whether the scheduler could place a pod with tolerations on n: Ready,
// schedulable, and every NoSchedule or NoExecute taint tolerated.
func eligible(n *corev1.Node, tolerations []corev1.Toleration) bool {
	if n.Spec.Unschedulable {
		return false
	}
	ready := false
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			ready = c.Status == corev1.ConditionTrue
		}
	}
	if !ready {
		return false
	}
	for i := range n.Spec.Taints {
		taint := &n.Spec.Taints[i]
		if taint.Effect == corev1.TaintEffectPreferNoSchedule {
			continue
		}
		// As the scheduler matches them with its TaintTolerationComparisonOperators gate at its
		// default (off, alpha): Lt and Gt tolerate nothing. The logger would only report those.
		if !slices.ContainsFunc(tolerations, func(t corev1.Toleration) bool { return t.ToleratesTaint(logr.Discard(), taint, false) }) {
			return false
		}
	}
	return true
}
