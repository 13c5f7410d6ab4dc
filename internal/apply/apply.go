// Package apply server-side applies Kubernetes objects with one fixed field manager, so that
// re-applying the same objects is a no-op and conflicts with other managers are visible.
//
// The resource of each object's kind is found through the API server's discovery (a RESTMapper over
// a memory-cached discovery client), so any kind the API server serves applies, custom resources
// included: an applied CustomResourceDefinition is waited for until it is established, then the
// cached discovery is dropped, so that its custom resources later in the same manifests find their
// resource. A kind the API server does not serve fails with ErrUnknownKind.
//
// Berth's own objects are built with client-go's typed apply configurations
// (k8s.io/client-go/applyconfigurations) and turned into the unstructured objects Apply takes with
// Unstructured.
package apply

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/berth-k8s/berth/internal/kubeclient"
)

// FieldManager is the field manager of every object Berth applies.
const FieldManager = "berth-bootstrapper"

// ErrUnknownKind is returned for an object whose kind the API server does not serve (after a fresh
// discovery).
var ErrUnknownKind = errors.New("unknown kind")

// ErrNotEstablished is returned when an applied CustomResourceDefinition is not established in time.
var ErrNotEstablished = errors.New("custom resource definition not established")

// How long an applied CustomResourceDefinition gets to be established, and how often it is read
// meanwhile. The API server establishes a new CRD within a second or two.
const (
	establishTimeout = time.Minute
	establishPoll    = 200 * time.Millisecond
)

var crdKind = schema.GroupKind{Group: "apiextensions.k8s.io", Kind: "CustomResourceDefinition"}

// Applier applies objects through a dynamic client.
type Applier struct {
	client dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

// New returns an Applier for client that maps kinds to resources with disc's discovery, cached in
// memory.
func New(client dynamic.Interface, disc discovery.DiscoveryInterface) *Applier {
	return &Applier{client: client, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))}
}

// NewForConfig returns an Applier for the cluster of cfg.
func NewForConfig(cfg *rest.Config) (*Applier, error) {
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating client: %w", err)
	}
	disc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("creating discovery client: %w", err)
	}
	return New(client, disc), nil
}

// NewFromKubeconfig returns an Applier for the cluster named by the kubeconfig at path.
func NewFromKubeconfig(path string) (*Applier, error) {
	cfg, err := kubeclient.FromFile(path)
	if err != nil {
		return nil, fmt.Errorf("loading kubeconfig: %w", err)
	}
	return NewForConfig(cfg)
}

// ClientsFromKubeconfig returns a typed and a dynamic client for the cluster named by the
// kubeconfig at path, for callers that read objects as well as apply them.
func ClientsFromKubeconfig(path string) (kubernetes.Interface, dynamic.Interface, error) {
	cfg, err := kubeclient.FromFile(path)
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

// Apply server-side applies objs in order and stops at the first failure. After a
// CustomResourceDefinition it waits until the definition is established, so that its custom
// resources can follow.
func (a *Applier) Apply(ctx context.Context, objs ...*unstructured.Unstructured) error {
	for _, obj := range objs {
		ri, err := a.Resource(obj)
		if err != nil {
			return fmt.Errorf("applying %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
		if _, err := ri.Apply(ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: FieldManager, Force: true}); err != nil {
			return fmt.Errorf("applying %s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
		if obj.GroupVersionKind().GroupKind() == crdKind {
			if err := a.waitEstablished(ctx, ri, obj.GetName()); err != nil {
				return fmt.Errorf("applying %s %s: %w", obj.GetKind(), obj.GetName(), err)
			}
			// Its resource is new to discovery: drop what the mapper cached.
			a.mapper.Reset()
		}
	}
	return nil
}

// waitEstablished waits until the CRD name has the condition Established.
func (a *Applier) waitEstablished(ctx context.Context, crds dynamic.ResourceInterface, name string) error {
	var last string
	err := wait.PollUntilContextTimeout(ctx, establishPoll, establishTimeout, true, func(ctx context.Context) (bool, error) {
		live, err := crds.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		conds, _, _ := unstructured.NestedSlice(live.Object, "status", "conditions")
		for _, c := range conds {
			m, ok := c.(map[string]any)
			if !ok || m["type"] != "Established" {
				continue
			}
			if m["status"] == "True" {
				return true, nil
			}
			last = fmt.Sprintf("Established is %v: %v", m["status"], m["message"])
		}
		return false, nil
	})
	if err != nil {
		if last != "" {
			return fmt.Errorf("%w (%s): %w", ErrNotEstablished, last, err)
		}
		return fmt.Errorf("%w: %w", ErrNotEstablished, err)
	}
	return nil
}

// Resource returns the client for obj's resource (in obj's namespace when the kind is namespaced),
// to read or delete the live object. A kind discovery does not know is looked up once more with a
// fresh discovery before it fails with ErrUnknownKind.
func (a *Applier) Resource(obj *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	mapping, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		a.mapper.Reset()
		mapping, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if meta.IsNoMatchError(err) {
		return nil, fmt.Errorf("%w: the API server serves no %s in %s (is its CustomResourceDefinition applied?)", ErrUnknownKind, gvk.Kind, gvk.GroupVersion())
	}
	if err != nil {
		return nil, fmt.Errorf("finding the resource of %s: %w", gvk, err)
	}
	if mapping.Scope.Name() != meta.RESTScopeNameNamespace {
		return a.client.Resource(mapping.Resource), nil
	}
	ns := obj.GetNamespace()
	if ns == "" {
		return nil, fmt.Errorf("%s %s is namespaced but names no namespace", gvk.Kind, obj.GetName())
	}
	return a.client.Resource(mapping.Resource).Namespace(ns), nil
}

// Unstructured turns a typed apply configuration (k8s.io/client-go/applyconfigurations) into the
// object Apply takes. The configuration must name its kind and name.
func Unstructured(applyConfiguration any) (*unstructured.Unstructured, error) {
	data, err := json.Marshal(applyConfiguration)
	if err != nil {
		return nil, fmt.Errorf("encoding apply configuration: %w", err)
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(data); err != nil {
		return nil, fmt.Errorf("decoding apply configuration: %w", err)
	}
	if obj.GetName() == "" {
		return nil, fmt.Errorf("decoding apply configuration: %s without a name", obj.GetKind())
	}
	return obj, nil
}

// Decode parses a multi-document YAML or JSON stream into objects, skipping empty documents; a List's
// items count as objects of their own.
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
		if obj.IsList() {
			// A v1 List (kubectl get -o json, berth manifests -o json): its items.
			err := obj.EachListItem(func(item runtime.Object) error {
				u, ok := item.(*unstructured.Unstructured)
				if !ok || u.GetKind() == "" || u.GetName() == "" {
					return errors.New("decoding manifest: list item without kind or name")
				}
				objs = append(objs, u)
				return nil
			})
			if err != nil {
				return nil, err
			}
			continue
		}
		if obj.GetKind() == "" || obj.GetName() == "" {
			return nil, errors.New("decoding manifest: object without kind or name")
		}
		objs = append(objs, obj)
	}
}
