package clustertest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// harnessSlice is the EndpointSlice the runner maintains for the webhook Service.
const harnessSlice = "berth-webhook-harness"

// fakePod is one berth-webhook process standing in for a pod.
type fakePod struct {
	name        string
	ip          string
	cmd         *exec.Cmd
	exited      chan struct{}
	ready       bool
	terminating bool // published as terminating
	signalled   bool // SIGTERM sent
}

// podRunner plays kubelet, ReplicaSet and EndpointSlice controller for Deployment berth-webhook.
type podRunner struct {
	kube kubernetes.Interface
	bin  string
	dir  string

	mu       sync.Mutex
	pods     []*fakePod
	seq      int
	paused   bool   // do not start pods (scaled to zero / image that never runs)
	foreign  bool   // serve a keypair from a foreign CA (failure injection)
	portName string // name of the EndpointSlice port ("https" matches the Service)
	lastSync string

	cancel context.CancelFunc
	done   chan struct{}
}

func newPodRunner(kube kubernetes.Interface, bin, dir string) *podRunner {
	ctx, cancel := context.WithCancel(context.Background())
	r := &podRunner{kube: kube, bin: bin, dir: dir, portName: "https", cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.loop(ctx)
	}()
	return r
}

// loop starts pods up to the Deployment's replicas, follows readiness, and keeps the EndpointSlice
// and the Deployment status in line, every 250 ms (a kubelet probing every 2 s would be slower).
func (r *podRunner) loop(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		dep, err := r.kube.AppsV1().Deployments(joinconfig.Namespace).Get(ctx, webhookconfig.Name, metav1.GetOptions{})
		if err != nil {
			// No Deployment (not applied yet, or uninstalled): keep the endpoints in line only.
			r.reapExited()
			r.probeAll(ctx)
			_ = r.sync(ctx, false)
			continue
		}
		r.reapExited()
		r.mu.Lock()
		paused := r.paused
		live := 0
		for _, p := range r.pods {
			if !p.terminating {
				live++
			}
		}
		r.mu.Unlock()
		if !paused {
			for n := live; n < int(*dep.Spec.Replicas); n++ {
				if _, err := r.startPod(ctx, dep); err != nil {
					fmt.Fprintln(os.Stderr, "harness: starting a webhook pod:", err)
				}
			}
		}
		r.probeAll(ctx)
		// A changed template is only acknowledged: the processes keep their arguments until the
		// next rolling restart.
		_ = r.sync(ctx, dep.Status.ObservedGeneration < dep.Generation)
	}
}

func (r *podRunner) reapExited() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pods = slices.DeleteFunc(r.pods, func(p *fakePod) bool {
		select {
		case <-p.exited:
			return true
		default:
			return false
		}
	})
}

func (r *podRunner) probeAll(ctx context.Context) {
	r.mu.Lock()
	pods := slices.Clone(r.pods)
	r.mu.Unlock()
	client := &http.Client{Timeout: 2 * time.Second}
	for _, p := range pods {
		ready := false
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.ip+":8081/readyz", nil)
		if resp, err := client.Do(req); err == nil {
			ready = resp.StatusCode == http.StatusOK
			resp.Body.Close()
		}
		r.mu.Lock()
		p.ready = ready
		r.mu.Unlock()
	}
	client.CloseIdleConnections()
}

// startPod starts a berth-webhook process the way the Deployment's pod template says: its args, with
// the volume mount paths mapped to files written from the Secret and the ConfigMap, on a fresh IP.
func (r *podRunner) startPod(ctx context.Context, dep *appsv1.Deployment) (*fakePod, error) {
	r.mu.Lock()
	r.seq++
	seq, foreign := r.seq, r.foreign
	r.mu.Unlock()
	ip := fmt.Sprintf("198.51.100.%d", 10+(seq%240))
	name := fmt.Sprintf("berth-webhook-%d", seq)
	podDir := filepath.Join(r.dir, name)
	secret, err := r.kube.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	cm, err := r.kube.CoreV1().ConfigMaps(joinconfig.Namespace).Get(ctx, webhookconfig.PolicyConfigMap, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	crt, key := secret.Data["tls.crt"], secret.Data["tls.key"]
	if foreign {
		if crt, key, err = foreignKeypair(); err != nil {
			return nil, err
		}
	}
	files := map[string][]byte{"tls/tls.crt": crt, "tls/tls.key": key, "policy/policy.yaml": []byte(cm.Data["policy.yaml"])}
	for p, data := range files {
		full := filepath.Join(podDir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return nil, err
		}
		if err := os.WriteFile(full, data, 0o600); err != nil {
			return nil, err
		}
	}
	c := dep.Spec.Template.Spec.Containers[0]
	var args []string
	for _, a := range c.Args {
		for _, m := range c.VolumeMounts {
			a = strings.ReplaceAll(a, m.MountPath, filepath.Join(podDir, m.Name))
		}
		a = strings.Replace(a, "--listen=:", "--listen="+ip+":", 1)
		a = strings.Replace(a, "--probe-listen=:", "--probe-listen="+ip+":", 1)
		if os.Getenv("BERTH_WEBHOOK_NO_DRAIN") == "1" && strings.HasPrefix(a, "--shutdown-delay=") {
			// Negative control: stop serving right after SIGTERM, as servers without a drain do.
			a = "--shutdown-delay=1ns"
		}
		args = append(args, a)
	}
	if err := addAddress(ip); err != nil && !strings.Contains(err.Error(), "File exists") {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(podDir, "log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(r.bin, args...)
	cmd.Env = append(os.Environ(), "POD_NAMESPACE="+joinconfig.Namespace)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	p := &fakePod{name: name, ip: ip, cmd: cmd, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); logf.Close(); close(p.exited) }()
	r.mu.Lock()
	r.pods = append(r.pods, p)
	r.mu.Unlock()
	return p, nil
}

// sync writes the EndpointSlice and the Deployment status from the pods' state, when it changed or
// force is set.
func (r *podRunner) sync(ctx context.Context, force bool) error {
	r.mu.Lock()
	port, portName, proto := int32(8443), r.portName, corev1.ProtocolTCP
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: harnessSlice, Namespace: joinconfig.Namespace, Labels: map[string]string{
			discoveryv1.LabelServiceName: webhookconfig.Name, discoveryv1.LabelManagedBy: "berth-webhook-clustertest",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &proto}},
	}
	readyCount, liveCount := int32(0), int32(0)
	var state []string
	for _, p := range r.pods {
		ready, serving, terminating := p.ready && !p.terminating, p.ready, p.terminating
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{p.ip},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating},
		})
		state = append(state, fmt.Sprintf("%s:%v:%v", p.ip, ready, terminating))
		state = append(state, "port="+r.portName)
		if !p.terminating {
			liveCount++
			if p.ready {
				readyCount++
			}
		}
	}
	key := strings.Join(state, ",")
	changed := key != r.lastSync
	r.mu.Unlock()
	if !changed && !force {
		return nil
	}
	slices := r.kube.DiscoveryV1().EndpointSlices(joinconfig.Namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := slices.Get(ctx, harnessSlice, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = slices.Create(ctx, slice, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		cur.Endpoints, cur.Ports = slice.Endpoints, slice.Ports
		_, err = slices.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return err
	}
	deps := r.kube.AppsV1().Deployments(joinconfig.Namespace)
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		dep, err := deps.Get(ctx, webhookconfig.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		available := corev1.ConditionFalse
		if readyCount >= *dep.Spec.Replicas {
			available = corev1.ConditionTrue
		}
		dep.Status = appsv1.DeploymentStatus{
			ObservedGeneration: dep.Generation, Replicas: liveCount, UpdatedReplicas: liveCount,
			ReadyReplicas: readyCount, AvailableReplicas: readyCount, UnavailableReplicas: max(0, *dep.Spec.Replicas-readyCount),
			Conditions: []appsv1.DeploymentCondition{{Type: appsv1.DeploymentAvailable, Status: available, Reason: "Harness",
				LastUpdateTime: metav1.Now(), LastTransitionTime: metav1.Now()}},
		}
		_, err = deps.UpdateStatus(ctx, dep, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.lastSync = key
	r.mu.Unlock()
	return nil
}

// terminate stops a pod like a kubelet: SIGTERM now, the endpoint marked terminating only after lag
// (endpoint propagation is slower than the signal), the pod gone once the process exited.
func (r *podRunner) terminate(p *fakePod, lag time.Duration) {
	r.mu.Lock()
	p.signalled = true
	r.mu.Unlock()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	go func() {
		select {
		case <-time.After(lag):
		case <-p.exited:
		}
		r.mu.Lock()
		p.terminating = true
		r.mu.Unlock()
	}()
}

// rollingRestart replaces every current pod, one at a time (maxSurge 1, maxUnavailable 0): start a new
// pod, wait until it is a ready endpoint, then terminate one old pod.
func (r *podRunner) rollingRestart(ctx context.Context, lag time.Duration) error {
	dep, err := r.kube.AppsV1().Deployments(joinconfig.Namespace).Get(ctx, webhookconfig.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	r.mu.Lock()
	var old []*fakePod
	for _, p := range r.pods {
		if !p.terminating {
			old = append(old, p)
		}
	}
	r.mu.Unlock()
	for _, o := range old {
		p, err := r.startPod(ctx, dep)
		if err != nil {
			return err
		}
		if err := r.waitEndpoint(ctx, p); err != nil {
			return err
		}
		r.terminate(o, lag)
	}
	return nil
}

// waitEndpoint waits until p is published as a ready endpoint.
func (r *podRunner) waitEndpoint(ctx context.Context, p *fakePod) error {
	errExited := fmt.Errorf("pod %s exited before it became ready", p.name)
	err := wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(context.Context) (bool, error) {
		r.mu.Lock()
		published := strings.Contains(r.lastSync, p.ip+":true:false")
		r.mu.Unlock()
		if published {
			return true, nil
		}
		select {
		case <-p.exited:
			return false, errExited
		default:
			return false, nil
		}
	})
	if err != nil && !errors.Is(err, errExited) {
		return fmt.Errorf("waiting for pod %s to become a ready endpoint: %w", p.name, err)
	}
	return err
}

// waitReadyEndpoints waits until n pods are ready endpoints.
func (r *podRunner) waitReadyEndpoints(ctx context.Context, n int) error {
	got := 0
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		r.mu.Lock()
		got = strings.Count(r.lastSync, ":true:false")
		r.mu.Unlock()
		return got >= n, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for %d ready endpoints (have %d): %w", n, got, err)
	}
	return nil
}

func (r *podRunner) setPaused(v bool) {
	r.mu.Lock()
	r.paused = v
	r.mu.Unlock()
}

// refreshTLS writes the Secret's current keypair into every running pod's files, as the kubelet
// updates a Secret volume (key first, then certificate; the webhook keeps its loaded pair until both
// match). It returns the certificate written.
func (r *podRunner) refreshTLS(ctx context.Context) ([]byte, error) {
	secret, err := r.kube.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	pods := slices.Clone(r.pods)
	r.mu.Unlock()
	for _, p := range pods {
		dir := filepath.Join(r.dir, p.name, "tls")
		if err := os.WriteFile(filepath.Join(dir, "tls.key"), secret.Data["tls.key"], 0o600); err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, "tls.crt"), secret.Data["tls.crt"], 0o600); err != nil {
			return nil, err
		}
	}
	return secret.Data["tls.crt"], nil
}

// livePods returns the pods that were not told to terminate.
func (r *podRunner) livePods() []*fakePod {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*fakePod
	for _, p := range r.pods {
		if !p.signalled {
			out = append(out, p)
		}
	}
	return out
}

// setPortName names the EndpointSlice's port; a name the Service does not use leaves the API server
// without a route while the endpoints still answer (failure injection for the end-to-end check).
func (r *podRunner) setPortName(name string) {
	r.mu.Lock()
	r.portName = name
	r.mu.Unlock()
}

func (r *podRunner) setForeign(v bool) {
	r.mu.Lock()
	r.foreign = v
	r.mu.Unlock()
}

// killAll SIGKILLs every pod and waits until they are gone from the EndpointSlice.
func (r *podRunner) killAll(ctx context.Context) error {
	r.mu.Lock()
	pods := slices.Clone(r.pods)
	r.mu.Unlock()
	for _, p := range pods {
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.lastSync == "" && len(r.pods) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for the endpoints to empty: %w", err)
	}
	return nil
}

// close stops the loop and every pod (by PID).
func (r *podRunner) close() {
	r.cancel()
	<-r.done
	r.mu.Lock()
	pods := slices.Clone(r.pods)
	r.mu.Unlock()
	for _, p := range pods {
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// foreignKeypair is a serving keypair for the webhook's names from a CA nobody trusts.
func foreignKeypair() ([]byte, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "foreign"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		DNSNames:    []string{"berth-webhook.berth-system.svc"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), nil
}
