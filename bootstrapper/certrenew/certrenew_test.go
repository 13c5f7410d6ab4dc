package certrenew

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/cpslot"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const dir = "/etc/kubernetes"

func certPEM(t *testing.T, cn string, notAfter time.Time) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn}, NotBefore: notAfter.Add(-time.Hour), NotAfter: notAfter}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func kubeconfig(t *testing.T, cn string, notAfter time.Time) []byte {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.AuthInfos["user"] = &clientcmdapi.AuthInfo{ClientCertificateData: certPEM(t, cn, notAfter), ClientKeyData: []byte("unused")}
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// writeCerts writes every certificate kubeadm renews, valid until notAfter.
func writeCerts(t *testing.T, fsys afero.Fs, notAfter time.Time) {
	t.Helper()
	for name, rel := range pkiLeaves {
		if err := afero.WriteFile(fsys, filepath.Join(dir, "pki", rel), certPEM(t, name, notAfter), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range kubeconfigs {
		if err := afero.WriteFile(fsys, filepath.Join(dir, name), kubeconfig(t, name, notAfter), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// node sets up a control plane: manifests, certificates valid until notAfter, kubelet.conf for cp1.
func node(t *testing.T, notAfter time.Time) afero.Fs {
	t.Helper()
	fsys := afero.NewMemMapFs()
	for _, c := range append(slices.Clone(restartOrder), "etcd") {
		pod := corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"}, ObjectMeta: metav1.ObjectMeta{Name: c, Namespace: "kube-system"},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: c, Image: "registry.k8s.io/" + c + ":v1.34.2"}}}}
		data, err := yaml.Marshal(&pod)
		if err != nil {
			t.Fatal(err)
		}
		if err := afero.WriteFile(fsys, filepath.Join(dir, "manifests", c+".yaml"), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeCerts(t, fsys, notAfter)
	if err := afero.WriteFile(fsys, filepath.Join(dir, "kubelet.conf"), kubeconfig(t, "system:node:cp1", notAfter), 0o600); err != nil {
		t.Fatal(err)
	}
	return fsys
}

// kubeadm renews by writing every certificate anew, valid for validity from now.
type fakeKubeadm struct {
	t        *testing.T
	fs       afero.Fs
	validity time.Duration
	calls    int
	err      error
	// onRenew runs at each call.
	onRenew func()
}

func (k *fakeKubeadm) CertsRenew(_ context.Context, out io.Writer, kubernetesDir string) error {
	k.calls++
	if k.onRenew != nil {
		k.onRenew()
	}
	if k.err != nil {
		return k.err
	}
	if kubernetesDir != dir {
		k.t.Errorf("CertsRenew(%s), want %s", kubernetesDir, dir)
	}
	writeCerts(k.t, k.fs, time.Now().Add(k.validity))
	_, _ = io.WriteString(out, "[renew] done\n")
	return nil
}

// kubelet stands in for the kubelet's static pods: whenever a manifest changes, the mirror pod gets
// its hash and annotations and is ready; it records the order of the restarts.
type kubelet struct {
	mu       sync.Mutex
	restarts []string
	// stuck is a component whose new pod never becomes ready.
	stuck string
	// slow is how long a changed pod takes to come back.
	slow time.Duration
}

func (k *kubelet) run(ctx context.Context, t *testing.T, fsys afero.Fs, client kubernetes.Interface) {
	seen := map[string]string{}
	ticker := time.NewTicker(200 * time.Millisecond)
	defer ticker.Stop()
	for {
		for _, c := range restartOrder {
			data, err := afero.ReadFile(fsys, filepath.Join(dir, "manifests", c+".yaml"))
			if err != nil {
				continue // removed: no pod
			}
			sum := sha256.Sum256(data)
			hash := hex.EncodeToString(sum[:8])
			if seen[c] == hash {
				continue
			}
			var pod corev1.Pod
			if err := yaml.Unmarshal(data, &pod); err != nil {
				t.Error(err)
				return
			}
			k.mu.Lock()
			stuck := k.stuck == c
			k.mu.Unlock()
			if stuck && seen[c] != "" {
				continue // the old pod is gone, the new one does not come
			}
			if seen[c] != "" {
				time.Sleep(k.slow)
			}
			mirror := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: c + "-cp1", Namespace: "kube-system", Annotations: map[string]string{"kubernetes.io/config.hash": hash}},
				Status:     corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
			}
			for k, v := range pod.Annotations {
				mirror.Annotations[k] = v
			}
			pods := client.CoreV1().Pods("kube-system")
			if seen[c] == "" {
				_, err = pods.Create(ctx, mirror, metav1.CreateOptions{})
			} else {
				_, err = pods.Update(ctx, mirror, metav1.UpdateOptions{})
				k.mu.Lock()
				k.restarts = append(k.restarts, c)
				k.mu.Unlock()
			}
			if err != nil {
				t.Error(err)
				return
			}
			seen[c] = hash
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}

func kubeadmConfig(validity string) *corev1.ConfigMap {
	cc := "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: v1.34.2\n"
	if validity != "" {
		cc += "certificateValidityPeriod: " + validity + "\n"
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubeadm-config", Namespace: "kube-system"}, Data: map[string]string{"ClusterConfiguration": cc}}
}

type setup struct {
	fs      afero.Fs
	client  *fake.Clientset
	kubeadm *fakeKubeadm
	kubelet *kubelet
	r       *Renewer
	stop    func()
}

func newSetup(t *testing.T, notAfter time.Time, validity string) *setup {
	t.Helper()
	fsys := node(t, notAfter)
	client := fake.NewClientset(kubeadmConfig(validity), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cp1"}})
	d, _ := time.ParseDuration(validity)
	if d == 0 {
		d = DefaultValidity
	}
	s := &setup{fs: fsys, client: client, kubeadm: &fakeKubeadm{t: t, fs: fsys, validity: d}, kubelet: &kubelet{}}
	s.r = New(Config{KubernetesDir: dir}, zap.NewNop(), fsys, s.kubeadm)
	s.r.client = func() (kubernetes.Interface, error) { return client, nil }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.kubelet.run(ctx, t, fsys, client) }()
	s.stop = func() { cancel(); <-done }
	synctest.Wait()
	return s
}

func (s *setup) annotations(t *testing.T) map[string]string {
	t.Helper()
	n, err := s.client.CoreV1().Nodes().Get(context.Background(), "cp1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n.Annotations
}

// TestCheckLeavesValidCertificatesAlone: certificates with more than a third of their validity left
// are not renewed; the next check is a period away; the Node carries their earliest expiry.
func TestCheckLeavesValidCertificatesAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		notAfter := time.Now().Add(300 * 24 * time.Hour).Truncate(time.Second)
		s := newSetup(t, notAfter, "")
		defer s.stop()
		res, err := s.r.Check(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if res.Renewed || s.kubeadm.calls != 0 || res.Validity != DefaultValidity {
			t.Fatalf("renewed=%v kubeadm calls=%d validity=%s", res.Renewed, s.kubeadm.calls, res.Validity)
		}
		if len(res.Certs) != len(pkiLeaves)+len(kubeconfigs) || !res.Earliest().Equal(notAfter) {
			t.Fatalf("%d certificates, earliest %s", len(res.Certs), res.Earliest())
		}
		if got := time.Until(res.Next); got != DefaultCheckPeriod {
			t.Errorf("next check in %s, want %s", got, DefaultCheckPeriod)
		}
		if got := s.annotations(t)[ExpiryAnnotation]; got != notAfter.UTC().Format(time.RFC3339) {
			t.Errorf("Node annotation %s = %q", ExpiryAnnotation, got)
		}
	})
}

// TestCheckRenewsBeforeExpiry: with a short configured validity, certificates with less than a
// third of it left are renewed, the API server, controller manager and scheduler are restarted in
// that order (etcd is not), each waited for, the control-plane slot is released, and the next check is due when
// the new ones reach two thirds of their life; certificates that outlive a shortened validity are
// renewed at once.
func TestCheckRenewsBeforeExpiry(t *testing.T) {
	for name, left := range map[string]time.Duration{"less than a third left": 100 * time.Second, "outlives the validity": 300 * 24 * time.Hour} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := newSetup(t, time.Now().Add(left), "6m")
				defer s.stop()
				res, err := s.r.Check(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if !res.Renewed || s.kubeadm.calls != 1 || res.Validity != 6*time.Minute {
					t.Fatalf("renewed=%v kubeadm calls=%d validity=%s", res.Renewed, s.kubeadm.calls, res.Validity)
				}
				if got := time.Until(res.Earliest()); got < 5*time.Minute || got > 6*time.Minute {
					t.Errorf("earliest expiry in %s after the renewal, want about 6m", got)
				}
				if got := time.Until(res.Next); got < time.Minute || got > 2*time.Minute {
					t.Errorf("next check in %s, want when 2m of the new 6m are left (about 4m, capped at the 1m period)", got)
				}
				s.kubelet.mu.Lock()
				restarts := slices.Clone(s.kubelet.restarts)
				s.kubelet.mu.Unlock()
				if !slices.Equal(restarts, restartOrder) {
					t.Errorf("restarts %v, want %v", restarts, restartOrder)
				}
				etcd, err := afero.ReadFile(s.fs, filepath.Join(dir, "manifests", "etcd.yaml"))
				if err != nil || strings.Contains(string(etcd), RenewedAnnotation) {
					t.Errorf("etcd was restarted (or its manifest is unreadable: %v)", err)
				}
				if h, held, err := cpslot.New(s.client, cpslot.Namespace, "test", nil, nil).Current(context.Background()); err != nil || held {
					t.Errorf("control-plane slot after the renewal: %+v %v, want released", h, err)
				}
				a := s.annotations(t)
				if a[RenewedAtAnnotation] == "" || a[ExpiryAnnotation] != res.Earliest().UTC().Format(time.RFC3339) {
					t.Errorf("Node annotations %v", a)
				}
			})
		})
	}
}

// TestCheckWaitsForTheSlot: while another control plane's join holds the control-plane slot this
// one waits; when the join never ends, it renews without the slot after LeaseWait, or half of what
// is left of its certificates when that is less.
func TestCheckWaitsForTheSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newSetup(t, time.Now().Add(time.Minute), "6m")
		defer s.stop()
		replica := cpslot.New(s.client, cpslot.Namespace, "cp-0", nil, zap.NewNop())
		held, err := replica.Acquire(context.Background(), cpslot.ControlPlaneJoin, "cp2")
		if err != nil {
			t.Fatal(err)
		}
		if err := held.Joining(context.Background(), "cp2", "198.51.100.2"); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		res, err := s.r.Check(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		// A minute is left: the wait is half of it, not DefaultLeaseWait.
		if waited := time.Since(start); !res.Renewed || waited < 30*time.Second || waited > 40*time.Second {
			t.Fatalf("renewed=%v after %s, want a renewal after waiting 30s (half of what is left) for the slot", res.Renewed, waited)
		}
	})
}

// TestRenewalWaitsForAControlPlaneJoin: a renewal due while a joinservice replica holds the
// control-plane slot for a control plane's join restarts nothing until the slot is freed, then
// renews and restarts under the slot, which names the renewal meanwhile.
func TestRenewalWaitsForAControlPlaneJoin(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newSetup(t, time.Now().Add(100*time.Second), "6m")
		defer s.stop()
		var (
			mu     sync.Mutex
			events []string
		)
		event := func(e string) {
			mu.Lock()
			defer mu.Unlock()
			events = append(events, e)
		}
		replica := cpslot.New(s.client, cpslot.Namespace, "cp-0", nil, zap.NewNop())
		s.kubeadm.onRenew = func() {
			event("renewal: kubeadm certs renew")
			h, held, err := replica.Current(context.Background())
			if err != nil || !held || h.Operation != cpslot.CertRenewal || h.Node != "cp1" || h.Process != "bootstrapper@cp1" {
				t.Errorf("during the renewal the slot is %+v (held %v, %v), want cp1's renewal", h, held, err)
			}
		}
		join, err := replica.Acquire(context.Background(), cpslot.ControlPlaneJoin, "cp2")
		if err != nil {
			t.Fatal(err)
		}
		event("join: slot taken")
		done := make(chan error, 1)
		go func() {
			_, err := s.r.Check(context.Background())
			done <- err
		}()
		time.Sleep(20 * time.Second)
		synctest.Wait()
		event("join: done")
		join.Release()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		want := []string{"join: slot taken", "join: done", "renewal: kubeadm certs renew"}
		if !slices.Equal(events, want) {
			t.Fatalf("events %q, want %q", events, want)
		}
		if h, held, _ := replica.Current(context.Background()); held {
			t.Fatalf("after the renewal the slot is held: %+v", h)
		}
	})
}

// TestMarginFollowsTheRenewalDuration: on a node whose components come back slowly (a renewal takes
// about two minutes), the next renewal is due when twice that is left (capped at half the
// validity), not only at a third of the validity: with 2m50s of a 6m validity left it renews, where
// a node whose renewals are quick waits until 2m are left.
func TestMarginFollowsTheRenewalDuration(t *testing.T) {
	for name, tc := range map[string]struct {
		slow    time.Duration
		renewed bool
	}{"slow components": {40 * time.Second, true}, "quick components": {0, false}} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := newSetup(t, time.Now().Add(100*time.Second), "6m")
				defer s.stop()
				s.kubelet.slow = tc.slow
				res, err := s.r.Check(context.Background())
				if err != nil || !res.Renewed {
					t.Fatalf("first renewal: renewed=%v err=%v", res.Renewed, err)
				}
				time.Sleep(time.Until(res.Earliest().Add(-170 * time.Second)))
				res, err = s.r.Check(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if res.Renewed != tc.renewed || s.kubeadm.calls != 1+map[bool]int{true: 1}[tc.renewed] {
					t.Fatalf("with 2m50s of 6m left after a renewal that took %s: renewed=%v (kubeadm calls %d), want %v",
						s.r.took, res.Renewed, s.kubeadm.calls, tc.renewed)
				}
			})
		})
	}
}

// TestCheckFailures: a failed kubeadm renewal stops before any restart; a worker is not a control
// plane, and Run on it renews once it becomes one.
func TestCheckFailures(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newSetup(t, time.Now().Add(time.Minute), "6m")
		defer s.stop()
		s.kubeadm.err = errors.New("kubeadm certs renew: exit status 1")
		before, err := afero.ReadFile(s.fs, filepath.Join(dir, "manifests", "kube-apiserver.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.r.Check(context.Background()); !errors.Is(err, s.kubeadm.err) {
			t.Fatalf("Check with a failing kubeadm = %v", err)
		}
		after, _ := afero.ReadFile(s.fs, filepath.Join(dir, "manifests", "kube-apiserver.yaml"))
		if string(before) != string(after) {
			t.Error("the API server was restarted after a failed renewal")
		}
		if err := s.fs.Remove(filepath.Join(dir, "manifests", "kube-apiserver.yaml")); err != nil {
			t.Fatal(err)
		}
		if _, err := s.r.Check(context.Background()); !errors.Is(err, ErrNotControlPlane) {
			t.Fatalf("Check on a worker = %v, want ErrNotControlPlane", err)
		}
		// Run on a worker looks once a period and becomes a control plane's renewer when the
		// manifest appears (a join as a control plane).
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- s.r.Run(ctx) }()
		time.Sleep(3 * DefaultCheckPeriod)
		synctest.Wait()
		if s.kubeadm.calls != 1 {
			t.Fatalf("kubeadm calls on a worker: %d, want only the failed one before", s.kubeadm.calls)
		}
		s.kubeadm.err = nil
		if err := afero.WriteFile(s.fs, filepath.Join(dir, "manifests", "kube-apiserver.yaml"), before, 0o600); err != nil {
			t.Fatal(err)
		}
		time.Sleep(DefaultCheckPeriod)
		synctest.Wait()
		if s.kubeadm.calls != 2 {
			t.Fatalf("kubeadm calls after the node became a control plane: %d, want a renewal", s.kubeadm.calls)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run = %v", err)
		}
	})
}

// TestCheckResumesAnUnfinishedRenewal: a renewal whose component restarts did not finish (the
// controller manager did not come back) fails and stays pending; the next check renews again, even
// though the files are fresh, and restarts every component; then nothing is pending.
func TestCheckResumesAnUnfinishedRenewal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newSetup(t, time.Now().Add(time.Minute), "6m")
		defer s.stop()
		s.kubelet.mu.Lock()
		s.kubelet.stuck = "kube-controller-manager"
		s.kubelet.mu.Unlock()
		if _, err := s.r.Check(context.Background()); err == nil || !strings.Contains(err.Error(), "kube-controller-manager") {
			t.Fatalf("Check with a controller manager that does not come back = %v", err)
		}
		if pending, err := s.r.pendingStamp(); err != nil || pending == "" {
			t.Fatalf("no pending renewal after the failed restart: %q %v", pending, err)
		}
		s.kubelet.mu.Lock()
		s.kubelet.stuck = ""
		s.kubelet.mu.Unlock()
		res, err := s.r.Check(context.Background())
		if err != nil || !res.Renewed {
			t.Fatalf("resuming: renewed=%v %v", res.Renewed, err)
		}
		if s.kubeadm.calls != 2 {
			t.Errorf("kubeadm ran %d times, want twice", s.kubeadm.calls)
		}
		s.kubelet.mu.Lock()
		restarts := slices.Clone(s.kubelet.restarts)
		s.kubelet.mu.Unlock()
		// The API server twice, the others last in order; every component runs the second
		// renewal's manifest.
		var lastAt []int
		for _, c := range restartOrder {
			at := -1
			for i, x := range restarts {
				if x == c {
					at = i
				}
			}
			lastAt = append(lastAt, at)
		}
		if n := len(slices.DeleteFunc(slices.Clone(restarts), func(c string) bool { return c != "kube-apiserver" })); n != 2 || !slices.IsSorted(lastAt) {
			t.Errorf("restarts %v, want the API server twice and the components' last restarts in order", restarts)
		}
		var stamps []string
		for _, c := range restartOrder {
			mirror, err := s.client.CoreV1().Pods("kube-system").Get(context.Background(), c+"-cp1", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			stamps = append(stamps, mirror.Annotations[RenewedAnnotation])
		}
		if stamps[0] == "" || stamps[0] != stamps[1] || stamps[1] != stamps[2] {
			t.Errorf("components run manifests of different renewals: %v", stamps)
		}
		if pending, _ := s.r.pendingStamp(); pending != "" {
			t.Errorf("still pending after the resumed renewal: %q", pending)
		}
		res, err = s.r.Check(context.Background())
		if err != nil || res.Renewed {
			t.Errorf("the check after: renewed=%v %v, want nothing to do", res.Renewed, err)
		}
	})
}
