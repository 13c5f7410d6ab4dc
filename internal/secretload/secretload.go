// Package secretload reads and writes Kubernetes Secrets without pause, as an application does,
// and counts the requests and the failures: the traffic under which the tests of encryption at
// rest rotate the KMS key (bootstrapper/kmskeeper against a real API server, e2e on a cluster).
package secretload

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Secrets is the part of a typed Secrets client the load uses, as
// kubernetes.Interface.CoreV1().Secrets(namespace) returns it.
type Secrets interface {
	Create(context.Context, *corev1.Secret, metav1.CreateOptions) (*corev1.Secret, error)
	Get(context.Context, string, metav1.GetOptions) (*corev1.Secret, error)
	Patch(context.Context, string, types.PatchType, []byte, metav1.PatchOptions, ...string) (*corev1.Secret, error)
	Delete(context.Context, string, metav1.DeleteOptions) error
}

// Load counts what Run did. Its zero value is ready; read it once Run returned.
type Load struct {
	ops, failures atomic.Int64
	mu            sync.Mutex
	errs          []string
}

// Run creates, reads, patches (a merge patch without a resourceVersion precondition), reads back and
// deletes Secrets named load-0, load-1, ... through s, one request after the other, until ctx ends.
// A request that fails is counted and its error kept; a request cut short by ctx's end is not
// counted.
func (l *Load) Run(ctx context.Context, s Secrets) {
	for i := 0; ctx.Err() == nil; i++ {
		name := fmt.Sprintf("load-%d", i)
		for _, step := range []func() error{
			func() error {
				_, err := s.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string][]byte{"v": []byte("1")}}, metav1.CreateOptions{})
				return err
			},
			func() error { _, err := s.Get(ctx, name, metav1.GetOptions{}); return err },
			func() error {
				_, err := s.Patch(ctx, name, types.MergePatchType, []byte(`{"data":{"v":"Mg=="}}`), metav1.PatchOptions{})
				return err
			},
			func() error {
				got, err := s.Get(ctx, name, metav1.GetOptions{})
				if err == nil && string(got.Data["v"]) != "2" {
					err = fmt.Errorf("read back %q", got.Data["v"])
				}
				return err
			},
			func() error { return s.Delete(ctx, name, metav1.DeleteOptions{}) },
		} {
			err := step()
			if ctx.Err() != nil {
				return
			}
			l.ops.Add(1)
			if err != nil {
				l.failures.Add(1)
				l.mu.Lock()
				l.errs = append(l.errs, err.Error())
				l.mu.Unlock()
			}
		}
	}
}

// Ops is how many requests Run made.
func (l *Load) Ops() int64 { return l.ops.Load() }

// Failures is how many of them failed.
func (l *Load) Failures() int64 { return l.failures.Load() }

// Errors are the failed requests' errors, in order.
func (l *Load) Errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.errs)
}
