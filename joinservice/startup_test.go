package joinservice

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// TestLoadKeysPatiently: while the API server is unreachable (as before kube-proxy runs) the
// joinservice keeps trying instead of exiting, backing off from 200 ms; it gives up with the last
// error when patience ends.
func TestLoadKeysPatiently(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.SecretName, Namespace: joinconfig.Namespace},
			Data: joinconfig.ClusterSecrets{MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32)}.Data()}
		client := fake.NewClientset(secret)
		failures := 3
		client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
			if failures > 0 {
				failures--
				return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
			}
			return false, nil, nil
		})
		start := time.Now()
		keys, salt, err := loadKeysPatiently(context.Background(), client, joinconfig.Namespace, time.Minute, zap.NewNop(), nil)
		if err != nil || keys == nil || len(salt) != 32 || failures != 0 {
			t.Fatalf("loadKeysPatiently = %v, %d bytes of salt, %v; %d failures left", keys, len(salt), err, failures)
		}
		if waited, want := time.Since(start), (200+400+800)*time.Millisecond; waited != want {
			t.Fatalf("three failures cost %v, want %v", waited, want)
		}

		down := fake.NewClientset()
		down.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, errors.New("dial tcp 10.96.0.1:443: connect: connection refused")
		})
		start = time.Now()
		if _, _, err := loadKeysPatiently(context.Background(), down, joinconfig.Namespace, time.Minute, zap.NewNop(), nil); err == nil {
			t.Fatal("loadKeysPatiently succeeded without an API server")
		}
		if waited := time.Since(start); waited != time.Minute {
			t.Fatalf("gave up after %v, want the patience of %v", waited, time.Minute)
		}
	})
}
