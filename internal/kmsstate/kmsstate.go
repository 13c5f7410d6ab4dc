// Package kmsstate is the contract about the control planes' KMS keys between Berth's binaries: the
// ConfigMap berth-system/berth-kms, which holds generation numbers and reports, never a key.
//
//	data key       written by                      holds
//	spec           berth secrets rotate-key        Spec: the generations every control plane's plugin must
//	                                               hold, the one it encrypts with, and a scan request
//	node.<name>    that control plane's keeper     NodeStatus: what its plugin holds, its health, the key
//	               (bootstrapper/kmskeeper)        its API server encrypts under, its last etcd scan
//
// Each writer server-side applies only its own key with its own field manager. A cluster without
// the ConfigMap (no rotation yet) is at DefaultSpec: generation 1, the key every control plane got at
// init or in its join ticket. The joinservice reads the spec to put every generation into a joining
// control plane's ticket.
//
// A rotation from generation N to N+1 (berth secrets rotate-key) moves the spec through
//
//	{[N], N} -> {[N, N+1], N} -> {[N, N+1], N+1} -> scans and rewrites -> {[N+1], N+1}
//
// and waits at each step until every control plane reports that it got there: a plugin holds the new
// key before any API server encrypts with it (another control plane's API server must read what this
// one writes), and holds the old one until no object is stored under it.
package kmsstate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// ConfigMapName is the ConfigMap in joinconfig.Namespace.
const ConfigMapName = joinconfig.KMSConfigName

// Keys of the ConfigMap's data.
const (
	KeySpec       = "spec"
	NodeKeyPrefix = "node."
)

// Field managers of the ConfigMap's writers.
const (
	// SpecManager is berth secrets rotate-key's.
	SpecManager = "berth-secrets"
	// nodeManagerPrefix + node name is a keeper's.
	nodeManagerPrefix = "berth-kms-keeper-"
)

// ErrInvalidSpec is returned for a spec no control plane can follow.
var ErrInvalidSpec = errors.New("invalid KMS key spec")

// Spec is what every control plane's plugin must hold.
type Spec struct {
	// Generations are the key generations every plugin must be able to decrypt with, ascending.
	Generations []uint32 `json:"generations"`
	// Active is the generation every plugin encrypts with.
	Active uint32 `json:"active"`
	// Scan, when it changes, asks every control plane's keeper to scan its etcd and report what is
	// stored under which key (NodeStatus.Scan answers with the same value).
	Scan string `json:"scan,omitempty"`
}

// DefaultSpec is the spec of a cluster that never rotated: the generation init gave.
func DefaultSpec() Spec { return Spec{Generations: []uint32{1}, Active: 1} }

// Validate checks that generations are ascending, unique, non-zero and hold the active one.
func (s Spec) Validate() error {
	if len(s.Generations) == 0 {
		return fmt.Errorf("%w: no generations", ErrInvalidSpec)
	}
	for i, g := range s.Generations {
		if g == 0 || (i > 0 && g <= s.Generations[i-1]) {
			return fmt.Errorf("%w: generations %v are not ascending from 1", ErrInvalidSpec, s.Generations)
		}
	}
	if !slices.Contains(s.Generations, s.Active) {
		return fmt.Errorf("%w: active generation %d is not among %v", ErrInvalidSpec, s.Active, s.Generations)
	}
	return nil
}

// Holds reports whether a plugin that holds generations (ascending) and encrypts with active holds
// exactly the spec's generations with its active one.
func (s Spec) Holds(generations []uint32, active uint32) bool {
	return active == s.Active && slices.Equal(generations, s.Generations)
}

// Latest is the newest generation of the spec.
func (s Spec) Latest() uint32 { return s.Generations[len(s.Generations)-1] }

// NodeStatus is what one control plane's keeper reports.
type NodeStatus struct {
	// Generations and Active are what its plugin holds.
	Generations []uint32 `json:"generations"`
	Active      uint32   `json:"active"`
	// KeyIDs are the key IDs of Generations, by generation.
	KeyIDs map[string]string `json:"keyIDs,omitempty"`
	// Healthy is the plugin's last Status: its self-test passed and it reported ActiveKeyID.
	Healthy bool `json:"healthy"`
	// Message says why the plugin is unhealthy, or what the keeper waits for or refused.
	Message string `json:"message,omitempty"`
	// ActiveKeyID is the key ID the plugin's Status reported.
	ActiveKeyID string `json:"activeKeyID,omitempty"`
	// EncryptKeyID is the key ID of the plugin's last Encrypt: the key the control plane's API server
	// encrypts new objects under (it calls Encrypt when it makes a data-encryption key).
	EncryptKeyID string `json:"encryptKeyID,omitempty"`
	// Scan is the keeper's last etcd scan.
	Scan *ScanResult `json:"scan,omitempty"`
	// Updated is when the keeper wrote the report.
	Updated time.Time `json:"updated"`
}

// ScanResult answers a Spec.Scan request.
type ScanResult struct {
	// Request is the Spec.Scan value it answers.
	Request string `json:"request"`
	// Time is when the scan ran.
	Time time.Time `json:"time"`
	// Error says why the scan failed; Report is empty then.
	Error  string     `json:"error,omitempty"`
	Report ScanReport `json:"report"`
}

// ScanReport is what a scan of a control plane's etcd found (internal/etcdscan scans).
type ScanReport struct {
	// Objects counts the values read.
	Objects int `json:"objects"`
	// ByKeyID counts the values encrypted under each key ID.
	ByKeyID map[string]int `json:"byKeyID"`
	// NotEncrypted counts the values not encrypted by the provider (plaintext, or another
	// transformer's prefix).
	NotEncrypted int `json:"notEncrypted"`
	// Listed are the objects that are not under the keep key IDs Scan was given (at most the limit
	// it was given), for a rotation to rewrite.
	Listed []StoredObject `json:"listed,omitempty"`
	// Truncated says more objects than Listed matched.
	Truncated bool `json:"truncated,omitempty"`
}

// StoredObject names one object stored in etcd by its etcd key.
type StoredObject struct {
	// Key is the etcd key, e.g. "/registry/secrets/berth-system/berth-cluster-secrets".
	Key string `json:"key"`
	// Resource, Namespace and Name are parsed from Key ("secrets", "berth-system", ...);
	// Namespace is empty for a cluster-scoped object.
	Resource  string `json:"resource,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	// KeyID is the key the object is encrypted under, empty when the provider did not encrypt it.
	KeyID string `json:"keyID,omitempty"`
}

// State is the ConfigMap decoded.
type State struct {
	// Found is false when the ConfigMap does not exist (Spec is DefaultSpec then).
	Found bool
	Spec  Spec
	// Nodes are the control planes' reports, by node name.
	Nodes map[string]NodeStatus
}

// Decode decodes a ConfigMap's data. A missing spec is DefaultSpec; a report that does not decode is
// left out (its writer replaces it within a minute).
func Decode(data map[string]string) (State, error) {
	st := State{Found: true, Spec: DefaultSpec(), Nodes: map[string]NodeStatus{}}
	if raw, ok := data[KeySpec]; ok {
		var s Spec
		if err := json.Unmarshal([]byte(raw), &s); err != nil {
			return State{}, fmt.Errorf("%w: %s does not decode: %w", ErrInvalidSpec, KeySpec, err)
		}
		if err := s.Validate(); err != nil {
			return State{}, err
		}
		st.Spec = s
	}
	for k, raw := range data {
		node, ok := strings.CutPrefix(k, NodeKeyPrefix)
		if !ok || node == "" {
			continue
		}
		var ns NodeStatus
		if json.Unmarshal([]byte(raw), &ns) == nil {
			st.Nodes[node] = ns
		}
	}
	return st, nil
}

// Read reads the ConfigMap; a cluster without it is at DefaultSpec.
func Read(ctx context.Context, client kubernetes.Interface) (State, error) {
	cm, err := client.CoreV1().ConfigMaps(joinconfig.Namespace).Get(ctx, ConfigMapName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return State{Spec: DefaultSpec(), Nodes: map[string]NodeStatus{}}, nil
	}
	if err != nil {
		return State{}, fmt.Errorf("reading %s/%s: %w", joinconfig.Namespace, ConfigMapName, err)
	}
	return Decode(cm.Data)
}

// ApplySpec writes spec as berth secrets rotate-key's.
func ApplySpec(ctx context.Context, client kubernetes.Interface, spec Spec) error {
	if err := spec.Validate(); err != nil {
		return err
	}
	b, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("encoding the KMS key spec: %w", err)
	}
	return apply(ctx, client, SpecManager, KeySpec, string(b))
}

// ApplyNodeStatus writes node's report as that node's keeper's.
func ApplyNodeStatus(ctx context.Context, client kubernetes.Interface, node string, st NodeStatus) error {
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("encoding the KMS report: %w", err)
	}
	return apply(ctx, client, nodeManagerPrefix+node, NodeKeyPrefix+node, string(b))
}

func apply(ctx context.Context, client kubernetes.Interface, manager, key, value string) error {
	cm := corev1ac.ConfigMap(ConfigMapName, joinconfig.Namespace).
		WithLabels(map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf}).
		WithData(map[string]string{key: value})
	if _, err := client.CoreV1().ConfigMaps(joinconfig.Namespace).Apply(ctx, cm, metav1.ApplyOptions{FieldManager: manager, Force: true}); err != nil {
		return fmt.Errorf("writing %s of %s/%s: %w", key, joinconfig.Namespace, ConfigMapName, err)
	}
	return nil
}
