// Package upgradeplan works out what an upgrade of a running cluster would do, without changing
// anything (`berth upgrade plan`):
//
//   - versions: the API server's and each node's kubelet's Kubernetes version, the target release
//     (internal/k8sversion; the default unless one is asked for), the etcd and CoreDNS versions the
//     cluster runs and those the target's kubeadm names. A target Berth does not build
//     (k8sversion.ErrUnsupported), older than what runs (ErrDowngrade) or more than one minor ahead
//     of the API server or of a kubelet (ErrMinorSkip) is refused;
//   - the order: the control planes one at a time, each holding the control-plane slot (the Lease
//     internal/cpslot owns, the one that control-plane joins and certificate renewals take), then
//     the workers, every node named;
//   - the measurement policy before (the join ConfigMap's) and after (the operator's new one), index
//     by index, and which admitted machines the new policy would refuse, judged on the evidence the
//     record API recorded for each (internal/attestation/policy/policydiff).
//
// It reads the cluster only: Nodes, the join ConfigMap, the Machines, and in kube-system the etcd
// pods and the CoreDNS Deployment. Berth's own objects in berth-system are not compared: building
// them takes the cluster Secret, which a read-only plan does not read.
package upgradeplan

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/policy/policydiff"
	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/records/clientset"
)

// Errors of a target the plan refuses; k8sversion.ErrUnsupported is the third.
var (
	// ErrDowngrade: the target is older than a version the cluster runs.
	ErrDowngrade = errors.New("the target Kubernetes version is older than the cluster's: downgrades are not supported")
	// ErrMinorSkip: the target is more than one minor ahead of the API server or of a kubelet.
	ErrMinorSkip = errors.New("the target Kubernetes version skips a minor: upgrade one minor at a time")
)

// ErrNoJoinPolicy is returned when the cluster's join ConfigMap holds no usable policy.
var ErrNoJoinPolicy = errors.New("no usable join policy in the cluster")

// Step kinds of Report.Order.
const (
	GateControlPlaneSlot = "control-plane-slot"
	GateDrain            = "drain"
)

// Change kinds of Versions.Change.
const (
	ChangeNone  = "none"
	ChangePatch = "patch"
	ChangeMinor = "minor"
)

// controlPlaneLabel marks a control-plane Node (kubeadm sets it).
const controlPlaneLabel = "node-role.kubernetes.io/control-plane"

// Options say what to plan.
type Options struct {
	// Namespace is Berth's namespace (joinconfig.Namespace).
	Namespace string
	// Target is the Kubernetes version or minor to move to; "" is k8sversion.Default.
	Target string
	// NewPolicy is the measurement policy the upgrade would put in force; nil keeps the cluster's.
	NewPolicy *policy.Policy
	// NewPolicySource names NewPolicy in the report (its file).
	NewPolicySource string
}

// Report is the plan. Its JSON field names are stable; slices are never null and are sorted, so that
// the same cluster gives the same document.
type Report struct {
	Kubernetes Versions     `json:"kubernetes"`
	Order      []Step       `json:"order"`
	Policy     PolicyChange `json:"policy"`
	Omitted    []string     `json:"omitted"`
}

// Versions are the cluster's Kubernetes versions and the target's.
type Versions struct {
	// APIServer is the version the API server reports.
	APIServer string `json:"apiServer"`
	// Target is the release the upgrade moves to.
	Target string `json:"target"`
	// Change is none, patch or minor: the step from APIServer to Target.
	Change string `json:"change"`
	// Nodes are every Node's kubelet, by name.
	Nodes []NodeVersion `json:"nodes"`
	// Components are etcd and CoreDNS: what runs and what the target's kubeadm names.
	Components []Component `json:"components"`
}

// NodeVersion is one Node's kubelet.
type NodeVersion struct {
	Node    string `json:"node"`
	Role    string `json:"role"`
	Kubelet string `json:"kubelet"`
}

// Component is one component kubeadm runs. Current lists the distinct versions running ("" when none
// was found); Target is the version the target's kubeadm names.
type Component struct {
	Name    string   `json:"name"`
	Current []string `json:"current"`
	Target  string   `json:"target"`
}

// Step is one node's turn in the upgrade, in order.
type Step struct {
	Step int    `json:"step"`
	Node string `json:"node"`
	Role string `json:"role"`
	// Gate is what the node's turn waits for: the control-plane slot (Lease) or a drain.
	Gate string `json:"gate"`
	// Lease is the control-plane slot's Lease (namespace/name) for a control plane.
	Lease string `json:"lease,omitempty"`
}

// PolicyChange is the measurement policy before and after, and its judgement of the admitted machines.
type PolicyChange struct {
	// Changed says whether a new policy was given and differs in any expectation.
	Changed bool `json:"changed"`
	// Source is where the new policy came from; "" when the cluster's is kept.
	Source string `json:"source,omitempty"`
	// Variant before and after.
	Variant    string `json:"variant"`
	NewVariant string `json:"newVariant"`
	// Measurements are the expectations by index, before and after.
	Measurements []MeasurementChange `json:"measurements"`
	// Machines judges every admitted machine's recorded evidence; nil when the policy is kept.
	Machines *policydiff.Report `json:"machines,omitempty"`
}

// MeasurementChange is one index's expectation before and after ("" where there is none).
type MeasurementChange struct {
	Index   uint32 `json:"index"`
	Before  string `json:"before"`
	After   string `json:"after"`
	Changed bool   `json:"changed"`
}

// Plan reads the cluster through kube and rc and returns what an upgrade with opts would do.
// Errors of the target (ErrDowngrade, ErrMinorSkip, k8sversion.ErrUnsupported) are the operator's
// input; every other error is the cluster's.
func Plan(ctx context.Context, kube kubernetes.Interface, rc clientset.Interface, opts Options) (Report, error) {
	target, err := k8sversion.Lookup(opts.Target)
	if err != nil {
		return Report{}, err
	}
	r := Report{Order: []Step{}, Omitted: []string{
		"berth-system objects: comparing them needs the cluster Secret to build them, and a plan reads no Secret",
	}}
	sv, err := kube.Discovery().ServerVersion()
	if err != nil {
		return Report{}, fmt.Errorf("reading the API server's version: %w", err)
	}
	nodes, err := kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return Report{}, fmt.Errorf("listing nodes: %w", err)
	}
	if r.Kubernetes, err = versions(sv.GitVersion, nodes.Items, target); err != nil {
		return Report{}, err
	}
	if r.Kubernetes.Components, err = components(ctx, kube, target); err != nil {
		return Report{}, err
	}
	r.Order = order(r.Kubernetes.Nodes, opts.Namespace)
	if r.Policy, err = policyChange(ctx, kube, rc, opts); err != nil {
		return Report{}, err
	}
	return r, nil
}

// versions checks target against the API server's version and every kubelet's.
func versions(apiServer string, nodes []corev1.Node, target k8sversion.Release) (Versions, error) {
	tv, err := version.ParseSemantic(target.Kubernetes)
	if err != nil {
		return Versions{}, fmt.Errorf("target version %q: %w", target.Kubernetes, err)
	}
	v := Versions{APIServer: apiServer, Target: target.Kubernetes, Nodes: []NodeVersion{}}
	check := func(who, running string) (*version.Version, error) {
		cv, err := version.ParseGeneric(running)
		if err != nil {
			return nil, fmt.Errorf("%s reports version %q: %w", who, running, err)
		}
		switch {
		case tv.LessThan(cv):
			return nil, fmt.Errorf("%s runs %s, the target is %s: %w", who, running, target.Kubernetes, ErrDowngrade)
		case tv.Major() != cv.Major() || tv.Minor() > cv.Minor()+1:
			return nil, fmt.Errorf("%s runs %s, the target is %s: %w", who, running, target.Kubernetes, ErrMinorSkip)
		}
		return cv, nil
	}
	cv, err := check("the API server", apiServer)
	if err != nil {
		return Versions{}, err
	}
	switch {
	case tv.Minor() > cv.Minor():
		v.Change = ChangeMinor
	case tv.Patch() > cv.Patch():
		v.Change = ChangePatch
	default:
		v.Change = ChangeNone
	}
	for _, n := range nodes {
		nv := NodeVersion{Node: n.Name, Role: role(n), Kubelet: n.Status.NodeInfo.KubeletVersion}
		if _, err := check("node "+n.Name+"'s kubelet", nv.Kubelet); err != nil {
			return Versions{}, err
		}
		v.Nodes = append(v.Nodes, nv)
	}
	sort.Slice(v.Nodes, func(i, j int) bool { return v.Nodes[i].Node < v.Nodes[j].Node })
	return v, nil
}

func role(n corev1.Node) string {
	if _, ok := n.Labels[controlPlaneLabel]; ok {
		return "control-plane"
	}
	return "worker"
}

// components reads the etcd and CoreDNS versions running in kube-system: the etcd static pods'
// images and the CoreDNS Deployment's.
func components(ctx context.Context, kube kubernetes.Interface, target k8sversion.Release) ([]Component, error) {
	etcd := Component{Name: "etcd", Current: []string{}, Target: target.Etcd}
	pods, err := kube.CoreV1().Pods(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{LabelSelector: "component=etcd,tier=control-plane"})
	if err != nil {
		return nil, fmt.Errorf("listing etcd pods: %w", err)
	}
	for _, p := range pods.Items {
		etcd.Current = addTags(etcd.Current, p.Spec.Containers, "etcd", func(tag string) string {
			// kubeadm's etcd image is tagged VERSION-REVISION ("3.6.8-0"); the table names VERSION.
			v, _, _ := strings.Cut(tag, "-")
			return v
		})
	}
	coredns := Component{Name: "coredns", Current: []string{}, Target: target.CoreDNS}
	dep, err := kube.AppsV1().Deployments(metav1.NamespaceSystem).Get(ctx, "coredns", metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return nil, fmt.Errorf("reading the CoreDNS deployment: %w", err)
	default:
		coredns.Current = addTags(coredns.Current, dep.Spec.Template.Spec.Containers, "coredns", func(tag string) string { return tag })
	}
	return []Component{etcd, coredns}, nil
}

// addTags adds the normalized image tag of the container named name to seen, once, sorted.
func addTags(seen []string, cs []corev1.Container, name string, norm func(string) string) []string {
	for _, c := range cs {
		if c.Name != name {
			continue
		}
		i := strings.LastIndexByte(c.Image, ':')
		if i < 0 || strings.Contains(c.Image[i:], "/") {
			continue
		}
		tag := norm(c.Image[i+1:])
		if !contains(seen, tag) {
			seen = append(seen, tag)
		}
	}
	sort.Strings(seen)
	return seen
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// order is the upgrade's order: control planes one at a time through the slot, then workers, each
// group by name.
func order(nodes []NodeVersion, namespace string) []Step {
	out := []Step{}
	for _, want := range []string{"control-plane", "worker"} {
		for _, n := range nodes {
			if n.Role != want {
				continue
			}
			s := Step{Step: len(out) + 1, Node: n.Node, Role: n.Role, Gate: GateDrain}
			if n.Role == "control-plane" {
				s.Gate, s.Lease = GateControlPlaneSlot, namespace+"/"+cpslot.LeaseName
			}
			out = append(out, s)
		}
	}
	return out
}

// policyChange compares the cluster's join policy with opts.NewPolicy and judges the admitted
// machines' recorded evidence under both.
func policyChange(ctx context.Context, kube kubernetes.Interface, rc clientset.Interface, opts Options) (PolicyChange, error) {
	cm, err := kube.CoreV1().ConfigMaps(opts.Namespace).Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
	if err != nil {
		return PolicyChange{}, fmt.Errorf("reading the join ConfigMap %s/%s: %w", opts.Namespace, joinconfig.JoinConfigName, err)
	}
	jc, err := joinconfig.DecodeConfig(cm.Data)
	if err != nil {
		return PolicyChange{}, fmt.Errorf("decoding the join ConfigMap: %w", err)
	}
	if len(jc.AttestationPolicy) == 0 {
		return PolicyChange{}, fmt.Errorf("key %s of %s is empty: %w", joinconfig.KeyAttestationPolicy, joinconfig.JoinConfigName, ErrNoJoinPolicy)
	}
	current, err := policy.Parse(jc.AttestationPolicy, joinconfig.JoinConfigName, nil)
	if err != nil {
		return PolicyChange{}, fmt.Errorf("parsing the cluster's join policy: %w: %w", ErrNoJoinPolicy, err)
	}
	next := opts.NewPolicy
	if next == nil {
		next = current
	}
	pc := PolicyChange{Variant: current.Variant, NewVariant: next.Variant, Measurements: measurementChanges(current, next)}
	pc.Changed = current.Variant != next.Variant
	for _, m := range pc.Measurements {
		pc.Changed = pc.Changed || m.Changed
	}
	if opts.NewPolicy == nil {
		return pc, nil
	}
	pc.Source = opts.NewPolicySource
	ms, err := policydiff.ListMachines(ctx, rc, opts.Namespace)
	if err != nil {
		return PolicyChange{}, err
	}
	judged := policydiff.Judge(current, next, ms)
	pc.Machines = &judged
	return pc, nil
}

func measurementChanges(before, after *policy.Policy) []MeasurementChange {
	byIndex := map[uint32]*MeasurementChange{}
	get := func(i uint32) *MeasurementChange {
		if byIndex[i] == nil {
			byIndex[i] = &MeasurementChange{Index: i}
		}
		return byIndex[i]
	}
	for _, e := range before.Expectations {
		get(e.Index).Before = expected(e)
	}
	for _, e := range after.Expectations {
		get(e.Index).After = expected(e)
	}
	out := []MeasurementChange{}
	for _, m := range byIndex {
		m.Changed = m.Before != m.After
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out
}

// expected renders what an expectation accepts, with its mode: "any non-zero value (enforce)",
// "HEX (warn)", "one of [HEX, HEX] (enforce)".
func expected(e policy.Expectation) string {
	var s string
	switch {
	case e.NonZero:
		s = "any non-zero value"
	case len(e.AnyOf) == 1:
		s = hex.EncodeToString(e.AnyOf[0])
	default:
		vals := make([]string, len(e.AnyOf))
		for i, v := range e.AnyOf {
			vals[i] = hex.EncodeToString(v)
		}
		sort.Strings(vals)
		s = "one of [" + strings.Join(vals, ", ") + "]"
	}
	return s + " (" + e.Mode.String() + ")"
}
