package recordwriter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// ErrNoMachine is wrapped by StoreTrace when identity has no Machine.
var ErrNoMachine = errors.New("no machine with this identity")

// StoreTrace writes trace onto the Machine of identity, replacing the one it had, in one request
// made at once (a node reports once per join). It patches only that Machine, and only when its
// spec names identity; it never creates one: without a Machine it returns an error wrapping
// ErrNoMachine. It returns the Machine's name.
func (w *Writer) StoreTrace(ctx context.Context, identity string, trace *v1alpha1.JoinTrace) (string, error) {
	name := records.NameFor(identity)
	body, err := json.Marshal([]map[string]any{
		{"op": "test", "path": "/spec/identity", "value": identity},
		{"op": "add", "path": "/status/joinTrace", "value": trace},
	})
	if err != nil {
		return "", fmt.Errorf("encoding the join trace of machine %s: %w", name, err)
	}
	w.requests.Add(1)
	_, err = w.client.RecordsV1alpha1().Machines(w.namespace).Patch(ctx, name, types.JSONPatchType, body, metav1.PatchOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return "", fmt.Errorf("storing the join trace of machine %s: %w", name, ErrNoMachine)
	case err != nil:
		return "", fmt.Errorf("storing the join trace of machine %s: %w", name, err)
	}
	return name, nil
}
