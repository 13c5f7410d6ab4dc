package kmsplugin

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
)

// secretData is the payload of every benchmark Secret: 1 KiB, a typical certificate-and-key Secret.
var secretData = map[string][]byte{"data": bytes.Repeat([]byte("x"), 1024)}

// BenchmarkSecrets measures Secret create, get and update latency through a real kube-apiserver and
// etcd, once without encryption ("identity": etcd holds the Secrets in plaintext) and once with
// Secrets encrypted through the plugin ("kms"). Besides ns/op each reports p50 and p99 in
// microseconds. The API server calls the plugin only when it makes or first decrypts a
// data-encryption key, so the difference is the API server's AES-GCM per object, not a call to the
// plugin per request; BenchmarkPlugin measures those calls.
func BenchmarkSecrets(b *testing.B) {
	for _, mode := range []string{"identity", "kms"} {
		b.Run(mode, func(b *testing.B) {
			var env *apiservertest.Env
			if mode == "kms" {
				svc := NewService(nil)
				if err := svc.SetKeys(KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}); err != nil {
					b.Fatal(err)
				}
				env, _, _ = startEncryptingAPIServer(b, svc)
			} else {
				env = apiservertest.Start(b)
			}
			cs := env.Client(b, apiservertest.AdminUser)
			ctx := context.Background()
			secrets := cs.CoreV1().Secrets("default")
			n := 0
			b.Run("create", func(b *testing.B) {
				measure(b, func(int) error {
					n++
					_, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("bench-%d", n)}, Data: secretData}, metav1.CreateOptions{})
					return err
				})
			})
			b.Run("get", func(b *testing.B) {
				measure(b, func(i int) error {
					_, err := secrets.Get(ctx, fmt.Sprintf("bench-%d", 1+i%max(n, 1)), metav1.GetOptions{})
					return err
				})
			})
			b.Run("update", func(b *testing.B) {
				measure(b, func(i int) error {
					return updateSecret(ctx, cs, fmt.Sprintf("bench-%d", 1+i%max(n, 1)), i)
				})
			})
		})
	}
}

func updateSecret(ctx context.Context, cs kubernetes.Interface, name string, i int) error {
	s, err := cs.CoreV1().Secrets("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	s.Data = map[string][]byte{"data": secretData["data"], "n": []byte(fmt.Sprint(i))}
	_, err = cs.CoreV1().Secrets("default").Update(ctx, s, metav1.UpdateOptions{})
	return err
}

// measure runs op b.N times and reports p50 and p99 besides ns/op.
func measure(b *testing.B, op func(i int) error) {
	b.Helper()
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if err := op(i); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}

// BenchmarkPlugin measures the plugin's own calls over its unix socket, as the API server makes them:
// Encrypt when it makes a data-encryption key, Decrypt when it meets one it has not cached, Status
// for its health checks (with the self-test).
func BenchmarkPlugin(b *testing.B) {
	svc := NewService(nil)
	if err := svc.SetKeys(KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}); err != nil {
		b.Fatal(err)
	}
	sock := shortTempDir(b) + "/kms.sock"
	servePlugin(b, sock, svc)
	c, err := NewClient(sock)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	seed := bytes.Repeat([]byte{1}, 32)
	enc, err := c.Encrypt(ctx, seed)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encrypt", func(b *testing.B) {
		measure(b, func(int) error { _, err := c.Encrypt(ctx, seed); return err })
	})
	b.Run("decrypt", func(b *testing.B) {
		measure(b, func(int) error { _, err := c.Decrypt(ctx, enc.GetCiphertext(), enc.GetKeyId()); return err })
	})
	b.Run("status", func(b *testing.B) {
		measure(b, func(int) error { _, err := c.Status(ctx); return err })
	})
}
