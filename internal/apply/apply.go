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

// Apply server-side applies objs in order and stops at the first failure.
func (a *Applier) Apply(ctx context.Context, objs ...*unstructured.Unstructured) error {
	for _, obj := range objs {
		gvk := obj.GroupVersionKind()
		res, ok := resources[gvk]
		if !ok {
			return fmt.Errorf("applying %s %s: %w", gvk.Kind, obj.GetName(), ErrUnknownKind)
		}
		gvr := gvk.GroupVersion().WithResource(res.resource)
		var ri dynamic.ResourceInterface = a.client.Resource(gvr)
		if res.namespaced {
			ns := obj.GetNamespace()
			if ns == "" {
				return fmt.Errorf("applying %s %s: namespaced object without namespace", gvk.Kind, obj.GetName())
			}
			ri = a.client.Resource(gvr).Namespace(ns)
		}
		if _, err := ri.Apply(ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: FieldManager, Force: true}); err != nil {
			return fmt.Errorf("applying %s %s: %w", gvk.Kind, obj.GetName(), err)
		}
	}
	return nil
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
