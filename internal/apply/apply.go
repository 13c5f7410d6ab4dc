// Package apply server-side applies Kubernetes objects with one fixed field manager, so that
// re-applying the same objects is a no-op and conflicts with other managers are visible.
package apply

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// FieldManager is the field manager of every object Berth applies.
const FieldManager = "berth-bootstrapper"

// ErrUnknownKind is returned for an object whose kind Applier has no resource mapping for.
var ErrUnknownKind = errors.New("unknown kind")

// resources maps the kinds Berth applies to their resources, so that applying needs no discovery.
var resources = map[schema.GroupVersionKind]struct {
	resource   string
	namespaced bool
}{
	{Version: "v1", Kind: "Namespace"}:                                                               {"namespaces", false},
	{Version: "v1", Kind: "ConfigMap"}:                                                               {"configmaps", true},
	{Version: "v1", Kind: "Secret"}:                                                                  {"secrets", true},
	{Version: "v1", Kind: "Service"}:                                                                 {"services", true},
	{Version: "v1", Kind: "ServiceAccount"}:                                                          {"serviceaccounts", true},
	{Group: "apps", Version: "v1", Kind: "DaemonSet"}:                                                {"daemonsets", true},
	{Group: "apps", Version: "v1", Kind: "Deployment"}:                                               {"deployments", true},
	{Group: "policy", Version: "v1", Kind: "PodDisruptionBudget"}:                                    {"poddisruptionbudgets", true},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRole"}:                         {"clusterroles", false},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRoleBinding"}:                  {"clusterrolebindings", false},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "Role"}:                                {"roles", true},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "RoleBinding"}:                         {"rolebindings", true},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "ValidatingWebhookConfiguration"}:   {"validatingwebhookconfigurations", false},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "ValidatingAdmissionPolicy"}:        {"validatingadmissionpolicies", false},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "ValidatingAdmissionPolicyBinding"}: {"validatingadmissionpolicybindings", false},
	{Group: "admissionregistration.k8s.io", Version: "v1", Kind: "MutatingWebhookConfiguration"}:     {"mutatingwebhookconfigurations", false},
}

// Applier applies objects through a dynamic client.
type Applier struct {
	client dynamic.Interface
}

// New returns an Applier for client.
func New(client dynamic.Interface) *Applier { return &Applier{client: client} }

// NewFromKubeconfig returns an Applier for the cluster named by the kubeconfig at path.
func NewFromKubeconfig(path string) (*Applier, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("loading kubeconfig: %w", err)
	}
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating client: %w", err)
	}
	return New(client), nil
}

// ClientsFromKubeconfig returns a typed and a dynamic client for the cluster named by the
// kubeconfig at path, for callers that read objects as well as apply them.
func ClientsFromKubeconfig(path string) (kubernetes.Interface, dynamic.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, nil, fmt.Errorf("loading kubeconfig: %w", err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("creating client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("creating client: %w", err)
	}
	return kube, dyn, nil
}

// Apply server-side applies objs in order and stops at the first failure.
func (a *Applier) Apply(ctx context.Context, objs ...*unstructured.Unstructured) error {
	for _, obj := range objs {
		ri, err := a.Resource(obj)
		if err != nil {
			return fmt.Errorf("applying %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
		if _, err := ri.Apply(ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: FieldManager, Force: true}); err != nil {
			return fmt.Errorf("applying %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	return nil
}

// Resource returns the client for obj's resource (in obj's namespace when the kind is namespaced),
// to read or delete the live object.
func (a *Applier) Resource(obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	res, ok := resources[gvk]
	if !ok {
		return nil, ErrUnknownKind
	}
	gvr := gvk.GroupVersion().WithResource(res.resource)
	if !res.namespaced {
		return a.client.Resource(gvr), nil
	}
	ns := obj.GetNamespace()
	if ns == "" {
		return nil, errors.New("namespaced object without namespace")
	}
	return a.client.Resource(gvr).Namespace(ns), nil
}

// Decode parses a multi-document YAML or JSON stream into objects, skipping empty documents.
func Decode(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, fmt.Errorf("decoding manifest: %w", err)
		}
		if len(m) == 0 {
			continue
		}
		obj := &unstructured.Unstructured{Object: m}
		if obj.GetKind() == "" || obj.GetName() == "" {
			return nil, errors.New("decoding manifest: object without kind or name")
		}
		objs = append(objs, obj)
	}
}
