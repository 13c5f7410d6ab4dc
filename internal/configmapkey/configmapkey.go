// Package configmapkey changes one key of a ConfigMap that several writers share (the join ledger,
// the machine record) without losing any writer's change: Update reads the ConfigMap, lets the
// caller change the key's value, and writes the result with the resourceVersion it read, creating
// the ConfigMap when there is none; when another writer got there first (a conflict, or a
// concurrent create) it reads again and calls the change again (client-go's retry.OnError).
// ReadList, DecodeList and EncodeList are the JSON-list codec both shared keys use.
package configmapkey

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
)

// Ref names one key of one ConfigMap.
type Ref struct {
	Namespace, Name string
	// Key is the data key Update changes.
	Key string
	// Labels are the labels of a ConfigMap Update creates; an existing one keeps its own.
	Labels map[string]string
	// Derived, when set, returns keys computed from Key's new value; Update writes them in the same
	// write as Key, so a reader never sees one without the other.
	Derived func(value string) map[string]string
}

// lostRace is a write another writer got in before: Update tries again.
type lostRace struct{ err error }

func (e *lostRace) Error() string { return e.err.Error() }

// Update sets ref's key to what change makes of its value ("" when the ConfigMap or the key is
// missing) and returns the ConfigMap as written. It writes with the resourceVersion it read, and
// creates the ConfigMap (with ref.Labels) when there is none; when the write conflicts with another
// writer's, or another writer created the ConfigMap first, it reads again and calls change again,
// spaced by backoff, for at most backoff's steps. An error of change ends Update with that error,
// unwrapped, and nothing written.
func Update(ctx context.Context, client kubernetes.Interface, ref Ref, backoff wait.Backoff, change func(value string) (string, error)) (*corev1.ConfigMap, error) {
	cms := client.CoreV1().ConfigMaps(ref.Namespace)
	var written *corev1.ConfigMap
	attempts := 0
	err := retry.OnError(backoff, func(err error) bool {
		var lost *lostRace
		return errors.As(err, &lost)
	}, func() error {
		attempts++
		cm, err := cms.Get(ctx, ref.Name, metav1.GetOptions{})
		create := apierrors.IsNotFound(err)
		if err != nil && !create {
			return fmt.Errorf("reading ConfigMap %s/%s: %w", ref.Namespace, ref.Name, err)
		}
		if create {
			cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: ref.Name, Namespace: ref.Namespace, Labels: ref.Labels}}
		}
		value, err := change(cm.Data[ref.Key])
		if err != nil {
			return err
		}
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		cm.Data[ref.Key] = value
		if ref.Derived != nil {
			for k, v := range ref.Derived(value) {
				cm.Data[k] = v
			}
		}
		if create {
			written, err = cms.Create(ctx, cm, metav1.CreateOptions{})
		} else {
			written, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
		}
		if apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err) {
			return &lostRace{err}
		}
		if err != nil {
			return fmt.Errorf("writing ConfigMap %s/%s: %w", ref.Namespace, ref.Name, err)
		}
		return nil
	})
	var lost *lostRace
	if errors.As(err, &lost) {
		return nil, fmt.Errorf("writing ConfigMap %s/%s: still conflicting after %d attempts: %w", ref.Namespace, ref.Name, attempts, lost.err)
	}
	if err != nil {
		return nil, err
	}
	return written, nil
}
