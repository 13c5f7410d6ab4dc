package main

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/bootstrapper/components"
)

// TestLoadKeysPatiently: while the API server is unreachable (as before kube-proxy runs) the
// joinservice keeps trying instead of exiting; it gives up with the last error when patience ends.
func TestLoadKeysPatiently(t *testing.T) {
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: components.SecretName, Namespace: components.Namespace},
		Data: map[string][]byte{"masterSecret": bytes.Repeat([]byte{1}, 32), "salt": bytes.Repeat([]byte{2}, 32)}}
	client := fake.NewClientset(secret)
	failures := 3
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failures > 0 {
			failures--
			return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
		}
		return false, nil, nil
	})
	keys, salt, err := loadKeysPatiently(context.Background(), client, components.Namespace, time.Minute, zap.NewNop())
	if err != nil || keys == nil || len(salt) != 32 || failures != 0 {
		t.Fatalf("loadKeysPatiently = %v, %d bytes of salt, %v; %d failures left", keys, len(salt), err, failures)
	}

	down := fake.NewClientset()
	down.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
	})
	if _, _, err := loadKeysPatiently(context.Background(), down, components.Namespace, 300*time.Millisecond, zap.NewNop()); err == nil {
		t.Fatal("loadKeysPatiently succeeded without an API server")
	}
}
