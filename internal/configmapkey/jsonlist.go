package configmapkey

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// ReadList returns the JSON list in ref's key (the join ledger, the machine record); what names it
// in errors. A missing ConfigMap is notFound, returned as it is, so that
// each contract keeps its own named error; a missing or blank key is an empty list.
func ReadList[T any](ctx context.Context, client kubernetes.Interface, ref Ref, what string, notFound error) ([]T, error) {
	cm, err := client.CoreV1().ConfigMaps(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, notFound
	}
	if err != nil {
		return nil, fmt.Errorf("reading ConfigMap %s/%s: %w", ref.Namespace, ref.Name, err)
	}
	return DecodeList[T](cm.Data[ref.Key], what)
}

// DecodeList parses a key's value; a blank value is an empty list.
func DecodeList[T any](s, what string) ([]T, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var list []T
	if err := json.Unmarshal([]byte(s), &list); err != nil {
		return nil, fmt.Errorf("decoding %s: %w", what, err)
	}
	return list, nil
}

// EncodeList returns a key's value for list.
func EncodeList[T any](list []T, what string) (string, error) {
	data, err := json.Marshal(list)
	if err != nil {
		return "", fmt.Errorf("encoding %s: %w", what, err)
	}
	return string(data), nil
}
