// Package certrenew renews a control plane's kubeadm certificates before they expire. Every control
// plane renews its own, so no node is special: on the mini cluster the bootstrapper (the node's
// supervisor) runs Renewer.Run for the daemon's life; on the OS image berth-cert-renew.timer runs
// `bootstrapper renew-certs` (one Renewer.Check) every hour.
//
// A check reads this node's certificates (kubeadm's PKI directory and the client certificates of
// admin.conf, super-admin.conf, controller-manager.conf and scheduler.conf) and the validity the
// cluster's kubeadm configuration gives (ConfigMap kube-system/kubeadm-config,
// certificateValidityPeriod; a year when it cannot be read). A certificate is due when less than its
// margin is left, or when it is valid for longer than the validity allows (the validity was
// shortened). The margin is a third of the validity, or twice what the last renewal on this node
// took (kubeadm and the three restarts, measured) when that is more, but at most half the validity:
// a renewal that starts at the margin finishes before the old certificates expire even on a node
// whose components come back slowly, which matters when the validity is short (tests compress a
// year into minutes; a year's margin is four months). When one is due:
//
//  1. it takes the control-plane slot (internal/cpslot, Lease berth-system/berth-control-plane-slot)
//     for a certificate renewal, so that one control plane at a time restarts its API server (the
//     others keep serving) and never while a control plane joins or an etcd member is removed; it
//     goes on without it when the slot stays held or the API server cannot be reached within
//     LeaseWait, or within half of what is left of its own certificates after a renewal's measured
//     duration when that is less (an API server whose certificate expired, say, or another
//     operation that does not end);
//  2. it writes the marker berth-certs-renewal-pending into the Kubernetes directory and runs
//     `kubeadm certs renew all`, which renews every certificate with the local CAs for the
//     configured validity. The marker is removed after the last restart below: a renewal cut short
//     (a crash, a component that did not come back) is done again by the next check, even though
//     the files are fresh, so that no component stays on certificates that are no longer in them;
//  3. it restarts kube-apiserver, kube-controller-manager and kube-scheduler one after the other by
//     stamping their static pod manifests with the annotation berth.dev/certs-renewed, and waits for
//     each one's mirror pod to show the new manifest and be ready (every look reads admin.conf
//     again: its certificate was just renewed, and the old one may expire meanwhile). The API
//     server reads its serving certificate again by itself, but it would read its kubelet client
//     certificate only every five minutes, and the controller manager and the scheduler carry
//     theirs in their kubeconfigs: a restart makes all of them use the renewed ones at once. etcd
//     is not restarted: it reads its certificates from its files at every new connection;
//  4. it records the earliest expiry on its Node (annotation berth.dev/control-plane-cert-expiry),
//     which `berth status` shows.
//
// The CAs themselves (ten years by default) are not renewed: kubeadm cannot renew a CA.
package certrenew

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/v1beta4"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kubeclient"
	"github.com/berth-k8s/berth/internal/pemcerts"
)

// ErrNotControlPlane is returned by Check on a node without a kube-apiserver static pod.
var ErrNotControlPlane = errors.New("not a control plane: no kube-apiserver static pod manifest")

// Names on the cluster's objects.
const (
	// RenewedAnnotation on a static pod manifest is when its certificates were last renewed.
	RenewedAnnotation = "berth.dev/certs-renewed"
	// ExpiryAnnotation on the Node is the earliest NotAfter of its control-plane certificates
	// (RFC 3339); RenewedAtAnnotation is when the node last renewed them.
	ExpiryAnnotation    = joinconfig.NodeCertExpiryAnnotation
	RenewedAtAnnotation = joinconfig.NodeCertsRenewedAnnotation
)

// Defaults.
const (
	// DefaultValidity is kubeadm's certificate validity when the cluster's configuration gives none.
	DefaultValidity = 365 * 24 * time.Hour
	// DefaultCheckPeriod bounds the time between two checks of Run (a shortened validity is noticed
	// within it).
	DefaultCheckPeriod = time.Minute
	// DefaultLeaseWait bounds the wait for the control-plane slot (another control plane restarting
	// or joining).
	DefaultLeaseWait = 5 * time.Minute
	// DefaultReadyTimeout bounds the wait for one restarted component.
	DefaultReadyTimeout = 5 * time.Minute
	// renewFraction: a certificate is due when less than validity/renewFraction is left.
	renewFraction = 3
	// outlivesSlack: one valid for more than validity + validity/outlivesSlack is due.
	outlivesSlack = 10
	// retryAfterFailure is Run's pause after a failed check.
	retryAfterFailure = 30 * time.Second
	// readyPoll is how often a restarted component's mirror pod is looked at.
	readyPoll = time.Second
	// slotPoll is how often a held control-plane slot is looked at, and the pause after an API error.
	slotPoll = 2 * time.Second
)

// restartOrder are the static pods restarted after a renewal, in order.
var restartOrder = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler"}

// pkiLeaves are the certificates kubeadm renews in its PKI directory, by kubeadm's names.
var pkiLeaves = map[string]string{
	"apiserver":                "apiserver.crt",
	"apiserver-kubelet-client": "apiserver-kubelet-client.crt",
	"apiserver-etcd-client":    "apiserver-etcd-client.crt",
	"front-proxy-client":       "front-proxy-client.crt",
	"etcd-server":              "etcd/server.crt",
	"etcd-peer":                "etcd/peer.crt",
	"etcd-healthcheck-client":  "etcd/healthcheck-client.crt",
}

// kubeconfigs are the kubeconfig files whose client certificates kubeadm renews (super-admin.conf
// exists only on the node that ran kubeadm init).
var kubeconfigs = []string{"admin.conf", "super-admin.conf", "controller-manager.conf", "scheduler.conf"}

// Config configures the renewer; zero values take the defaults.
type Config struct {
	// KubernetesDir is kubeadm's directory (default /etc/kubernetes).
	KubernetesDir string
	CheckPeriod   time.Duration
	LeaseWait     time.Duration
	ReadyTimeout  time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Kubeadm renews the certificates (internal/kubeadm.Runner).
type Kubeadm interface {
	CertsRenew(ctx context.Context, out io.Writer, kubernetesDir string) error
}

// Renewer renews this control plane's certificates.
type Renewer struct {
	cfg     Config
	log     *zap.Logger
	fs      afero.Fs
	kubeadm Kubeadm
	// client reaches the API server as the node's admin (admin.conf); tests replace it.
	client func() (kubernetes.Interface, error)
	// took is how long the last renewal on this node took (kubeadm and the restarts); zero before
	// the first. Only Check reads and writes it, and Run calls Check from one goroutine.
	took time.Duration
}

// New returns a renewer for the node's kubeadm directory on fsys.
func New(cfg Config, log *zap.Logger, fsys afero.Fs, adm Kubeadm) *Renewer {
	if cfg.KubernetesDir == "" {
		cfg.KubernetesDir = "/etc/kubernetes"
	}
	if cfg.CheckPeriod == 0 {
		cfg.CheckPeriod = DefaultCheckPeriod
	}
	if cfg.LeaseWait == 0 {
		cfg.LeaseWait = DefaultLeaseWait
	}
	if cfg.ReadyTimeout == 0 {
		cfg.ReadyTimeout = DefaultReadyTimeout
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	r := &Renewer{cfg: cfg, log: log, fs: fsys, kubeadm: adm}
	r.client = func() (kubernetes.Interface, error) {
		rc, err := kubeclient.FromFile(filepath.Join(cfg.KubernetesDir, "admin.conf"))
		if err != nil {
			return nil, fmt.Errorf("loading admin.conf: %w", err)
		}
		rc.Timeout = 30 * time.Second
		return kubernetes.NewForConfig(rc)
	}
	return r
}

// Cert is one certificate of the control plane.
type Cert struct {
	Name     string
	NotAfter time.Time
}

// Result is what a check found and did.
type Result struct {
	// Certs are this node's certificates after the check, earliest expiry first.
	Certs []Cert
	// Validity is the validity the check judged them by.
	Validity time.Duration
	// Renewed says the certificates were renewed and the components restarted.
	Renewed bool
	// Next is when the next check is due: the earliest renewal point, at most a check period away.
	Next time.Time
}

// Earliest is the earliest expiry of the node's certificates; zero without any.
func (r Result) Earliest() time.Time {
	if len(r.Certs) == 0 {
		return time.Time{}
	}
	return r.Certs[0].NotAfter
}

// Run checks until ctx ends. On a node that is not a control plane (a worker, or a node still
// waiting for init or a join) a check is a look for the API server's manifest once a period.
func (r *Renewer) Run(ctx context.Context) error {
	for {
		res, err := r.Check(ctx)
		next := res.Next
		switch {
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, ErrNotControlPlane):
			next = r.cfg.Now().Add(r.cfg.CheckPeriod)
		case err != nil:
			r.log.Error("checking the control-plane certificates", zap.Error(err))
			next = r.cfg.Now().Add(retryAfterFailure)
		}
		timer := time.NewTimer(max(next.Sub(r.cfg.Now()), time.Second))
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-timer.C:
		}
	}
}

// Check renews the certificates when one is due (see the package documentation).
func (r *Renewer) Check(ctx context.Context) (Result, error) {
	var res Result
	if _, err := r.fs.Stat(r.manifest("kube-apiserver")); err != nil {
		return res, ErrNotControlPlane
	}
	client := r.freshClient()
	res.Validity = r.validity(ctx, client)
	var err error
	if res.Certs, err = r.inventory(); err != nil {
		return res, err
	}
	now := r.cfg.Now()
	pending, err := r.pendingStamp()
	if err != nil {
		return res, err
	}
	margin := r.margin(res.Validity)
	due := slices.ContainsFunc(res.Certs, func(c Cert) bool { return isDue(c.NotAfter, now, res.Validity, margin) })
	switch {
	case pending != "":
		r.log.Info("an earlier renewal did not finish: renewing again", zap.String("started", pending))
	case due:
		r.log.Info("control-plane certificates due: renewing", zap.Time("earliest", res.Earliest()), zap.Duration("validity", res.Validity),
			zap.Duration("margin", margin))
	}
	if pending != "" || due {
		// Waiting for another control plane's renewal is bounded by what is left of ours once our
		// own renewal's time is set aside.
		leaseWait := min(r.cfg.LeaseWait, max(res.Earliest().Sub(now)-r.took, 0)/2)
		if err := r.renew(ctx, client, leaseWait); err != nil {
			return res, err
		}
		res.Renewed = true
		if res.Certs, err = r.inventory(); err != nil {
			return res, err
		}
		r.log.Info("control-plane certificates renewed", zap.Time("earliest", res.Earliest()))
		// The admin.conf the check started with may hold a certificate about to expire.
		client = r.freshClient()
	}
	res.Next = r.cfg.Now().Add(r.cfg.CheckPeriod)
	if len(res.Certs) > 0 {
		if at := res.Earliest().Add(-r.margin(res.Validity)); at.Before(res.Next) {
			res.Next = at
		}
	}
	if client != nil {
		r.annotateNode(ctx, client, res)
	}
	return res, nil
}

// freshClient reads admin.conf again (kubeadm renews its certificate) and returns a client, or nil
// when it cannot be read.
func (r *Renewer) freshClient() kubernetes.Interface {
	client, err := r.client()
	if err != nil {
		r.log.Warn("no API client from admin.conf", zap.Error(err))
		return nil
	}
	return client
}

// pendingFile, in the Kubernetes directory (on the node's state disk), marks a renewal that has not
// finished: it is written before kubeadm renews the files and removed after the last component
// restarted, so a renewal cut short (a crash, a component that did not come back) is done again by
// the next check instead of leaving components on certificates that are no longer in the files.
const pendingFile = "berth-certs-renewal-pending"

func (r *Renewer) pendingStamp() (string, error) {
	data, err := afero.ReadFile(r.fs, filepath.Join(r.cfg.KubernetesDir, pendingFile))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reading the pending renewal: %w", err)
	}
	return strings.TrimSpace(string(data)), nil
}

// margin is how much of a certificate's life is left when it becomes due: a third of validity, or
// twice the last renewal's duration when that is more, at most half of validity (so that a renewed
// certificate is never due at once).
func (r *Renewer) margin(validity time.Duration) time.Duration {
	return min(max(validity/renewFraction, 2*r.took), validity/2)
}

// isDue: less than margin is left, or the certificate outlives validity.
func isDue(notAfter, now time.Time, validity, margin time.Duration) bool {
	left := notAfter.Sub(now)
	return left < margin || left > validity+validity/outlivesSlack
}

func (r *Renewer) manifest(component string) string {
	return filepath.Join(r.cfg.KubernetesDir, "manifests", component+".yaml")
}

// validity is the cluster's certificateValidityPeriod, or DefaultValidity.
func (r *Renewer) validity(ctx context.Context, client kubernetes.Interface) time.Duration {
	if client == nil {
		return DefaultValidity
	}
	cm, err := client.CoreV1().ConfigMaps(metav1.NamespaceSystem).Get(ctx, "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		r.log.Warn("reading kubeadm-config: judging by the default validity", zap.Error(err))
		return DefaultValidity
	}
	var cc v1beta4.ClusterConfiguration
	if err := yaml.Unmarshal([]byte(cm.Data["ClusterConfiguration"]), &cc); err != nil {
		r.log.Warn("parsing kubeadm-config: judging by the default validity", zap.Error(err))
		return DefaultValidity
	}
	if cc.CertificateValidityPeriod == nil || cc.CertificateValidityPeriod.Duration <= 0 {
		return DefaultValidity
	}
	return cc.CertificateValidityPeriod.Duration
}

// inventory reads this node's renewable certificates, earliest expiry first.
func (r *Renewer) inventory() ([]Cert, error) {
	var out []Cert
	for name, rel := range pkiLeaves {
		data, err := afero.ReadFile(r.fs, filepath.Join(r.cfg.KubernetesDir, "pki", rel))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading certificate %s: %w", name, err)
		}
		c, err := first(data)
		if err != nil {
			return nil, fmt.Errorf("reading certificate %s: %w", name, err)
		}
		out = append(out, Cert{Name: name, NotAfter: c.NotAfter})
	}
	for _, name := range kubeconfigs {
		data, err := afero.ReadFile(r.fs, filepath.Join(r.cfg.KubernetesDir, name))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", name, err)
		}
		c, err := kubeconfigCert(data)
		if err != nil {
			return nil, fmt.Errorf("reading the client certificate of %s: %w", name, err)
		}
		out = append(out, Cert{Name: name, NotAfter: c.NotAfter})
	}
	if len(out) == 0 {
		return nil, errors.New("no control-plane certificates found")
	}
	slices.SortFunc(out, func(a, b Cert) int {
		if c := a.NotAfter.Compare(b.NotAfter); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out, nil
}

func first(data []byte) (*x509.Certificate, error) {
	certs, err := pemcerts.Parse(data)
	if err != nil {
		return nil, err
	}
	if len(certs) == 0 {
		return nil, errors.New("no certificate")
	}
	return certs[0], nil
}

// kubeconfigCert returns the client certificate of a kubeconfig's first user with one embedded.
func kubeconfigCert(data []byte) (*x509.Certificate, error) {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(cfg.AuthInfos))
	for n := range cfg.AuthInfos {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if a := cfg.AuthInfos[n]; len(a.ClientCertificateData) > 0 {
			return first(a.ClientCertificateData)
		}
	}
	return nil, errors.New("no embedded client certificate")
}

// renew takes the control-plane slot (or goes on without it after leaseWait), renews the files and
// restarts the components.
func (r *Renewer) renew(ctx context.Context, client kubernetes.Interface, leaseWait time.Duration) error {
	if client == nil {
		return r.renewAndRestart(ctx)
	}
	node, err := r.nodeName()
	if err != nil {
		return err
	}
	held, why, err := r.takeSlot(ctx, client, node, leaseWait)
	if err != nil {
		return err
	}
	if held == nil {
		// Another operation holds the slot for longer than a renewal takes, or the API server cannot
		// be reached: renew without it.
		r.log.Warn("control-plane slot not taken: renewing without it", zap.Duration("waited", leaseWait), zap.Error(why))
		return r.renewAndRestart(ctx)
	}
	// The slot is renewed under the caller's context while the work runs: on a single control plane
	// it cannot be renewed while its API server restarts, and the work goes on regardless.
	defer held.Release()
	return r.renewAndRestart(ctx)
}

// takeSlot waits up to wait for the control-plane slot, trying again after API errors. It returns
// nil and the last reason when the slot was not taken in time, and an error only when ctx ended.
func (r *Renewer) takeSlot(ctx context.Context, client kubernetes.Interface, node string, wait time.Duration) (*cpslot.Held, error, error) {
	slot := cpslot.New(client, cpslot.Namespace, "bootstrapper@"+node, nil, r.log.Named("slot"))
	slot.Poll = slotPoll
	deadline := time.Now().Add(wait)
	var why error
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, why, nil
		}
		slot.MaxWait = left
		held, err := slot.Acquire(ctx, cpslot.CertRenewal, node)
		switch {
		case err == nil:
			return held, nil, nil
		case ctx.Err() != nil:
			return nil, nil, ctx.Err()
		case errors.Is(err, cpslot.ErrBusy):
			return nil, err, nil
		}
		why = err
		r.log.Debug("taking the control-plane slot", zap.Error(err))
		t := time.NewTimer(min(slotPoll, left))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, nil, ctx.Err()
		case <-t.C:
		}
	}
}

// renewAndRestart renews the files and restarts the components, and records how long that took.
func (r *Renewer) renewAndRestart(ctx context.Context) error {
	start := r.cfg.Now()
	stamp := start.UTC().Format(time.RFC3339Nano)
	if err := atomicfile.Write(r.fs, filepath.Join(r.cfg.KubernetesDir, pendingFile), []byte(stamp+"\n"), 0o600); err != nil {
		return fmt.Errorf("recording the renewal: %w", err)
	}
	out := &logWriter{log: r.log.Named("kubeadm")}
	if err := r.kubeadm.CertsRenew(ctx, out, r.cfg.KubernetesDir); err != nil {
		return fmt.Errorf("renewing the control-plane certificates: %w", err)
	}
	node, err := r.nodeName()
	if err != nil {
		return err
	}
	for _, component := range restartOrder {
		if err := r.restart(ctx, node, component, stamp); err != nil {
			return err
		}
	}
	if err := r.fs.Remove(filepath.Join(r.cfg.KubernetesDir, pendingFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("recording the finished renewal: %w", err)
	}
	r.took = r.cfg.Now().Sub(start)
	r.log.Info("control-plane renewal finished", zap.Duration("took", r.took))
	return nil
}

// restart stamps component's static pod manifest so that the kubelet replaces the pod, and waits
// until its mirror pod runs the stamped manifest and is ready (without an API client: until the
// manifest is written).
func (r *Renewer) restart(ctx context.Context, node, component, stamp string) error {
	path := r.manifest(component)
	data, err := afero.ReadFile(r.fs, path)
	if err != nil {
		return fmt.Errorf("reading the %s manifest: %w", component, err)
	}
	var pod corev1.Pod
	if err := yaml.Unmarshal(data, &pod); err != nil {
		return fmt.Errorf("parsing the %s manifest: %w", component, err)
	}
	if pod.Annotations[RenewedAnnotation] != stamp {
		if pod.Annotations == nil {
			pod.Annotations = map[string]string{}
		}
		pod.Annotations[RenewedAnnotation] = stamp
		next, err := yaml.Marshal(&pod)
		if err != nil {
			return fmt.Errorf("encoding the %s manifest: %w", component, err)
		}
		if err := atomicfile.Write(r.fs, path, next, 0o600); err != nil {
			return fmt.Errorf("writing the %s manifest: %w", component, err)
		}
		r.log.Info("restarting a control-plane component", zap.String("component", component))
	}
	// Every look at the mirror pod reads admin.conf again: kubeadm renewed its certificate, and the
	// one read before may expire while a component comes back.
	if r.freshClient() == nil {
		return nil
	}
	start := r.cfg.Now()
	var last string
	err = wait.PollUntilContextTimeout(ctx, readyPoll, r.cfg.ReadyTimeout, true, func(ctx context.Context) (bool, error) {
		client := r.freshClient()
		if client == nil {
			last = "admin.conf cannot be read"
			return false, nil
		}
		mirror, err := client.CoreV1().Pods(metav1.NamespaceSystem).Get(ctx, component+"-"+node, metav1.GetOptions{})
		switch {
		case err != nil:
			last = err.Error()
			return false, nil
		case mirror.Annotations[RenewedAnnotation] != stamp:
			last = "the mirror pod still shows the previous manifest"
			return false, nil
		case !podReady(mirror):
			last = "the new pod is not ready"
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("restarting %s: not ready after %s (%s): %w", component, r.cfg.ReadyTimeout, last, err)
	}
	r.log.Info("control-plane component restarted", zap.String("component", component), zap.Duration("took", r.cfg.Now().Sub(start)))
	return nil
}

func podReady(p *corev1.Pod) bool {
	return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
		return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
	})
}

// nodeName is the name in the kubelet's client certificate (system:node:NAME): kubelet.conf embeds
// it or names the file the kubelet rotates.
func (r *Renewer) nodeName() (string, error) {
	data, err := afero.ReadFile(r.fs, filepath.Join(r.cfg.KubernetesDir, "kubelet.conf"))
	if err != nil {
		return "", fmt.Errorf("reading kubelet.conf for the node name: %w", err)
	}
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return "", fmt.Errorf("reading kubelet.conf for the node name: %w", err)
	}
	for _, a := range cfg.AuthInfos {
		certPEM := a.ClientCertificateData
		if len(certPEM) == 0 && a.ClientCertificate != "" {
			if certPEM, err = afero.ReadFile(r.fs, a.ClientCertificate); err != nil {
				return "", fmt.Errorf("reading the kubelet's client certificate: %w", err)
			}
		}
		if c, err := first(certPEM); err == nil {
			if name, ok := strings.CutPrefix(c.Subject.CommonName, "system:node:"); ok && name != "" {
				return name, nil
			}
		}
	}
	return "", errors.New("kubelet.conf names no node client certificate")
}

// annotateNode records the earliest expiry (and the renewal) on the Node, when they changed.
func (r *Renewer) annotateNode(ctx context.Context, client kubernetes.Interface, res Result) {
	node, err := r.nodeName()
	if err != nil {
		r.log.Warn("recording the certificate expiry on the Node", zap.Error(err))
		return
	}
	n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		if !apierrors.IsNotFound(err) {
			r.log.Warn("recording the certificate expiry on the Node", zap.Error(err))
		}
		return
	}
	expiry := res.Earliest().UTC().Format(time.RFC3339)
	annotations := map[string]string{ExpiryAnnotation: expiry}
	if res.Renewed {
		annotations[RenewedAtAnnotation] = r.cfg.Now().UTC().Format(time.RFC3339)
	}
	if n.Annotations[ExpiryAnnotation] == expiry && !res.Renewed {
		return
	}
	patch, err := jsonMergePatch(annotations)
	if err != nil {
		return
	}
	if _, err := client.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "berth-cert-renew"}); err != nil {
		r.log.Warn("recording the certificate expiry on the Node", zap.Error(err))
	}
}

func jsonMergePatch(annotations map[string]string) ([]byte, error) {
	return json.Marshal(map[string]any{"metadata": map[string]any{"annotations": annotations}})
}

// logWriter logs each line kubeadm prints as one entry.
type logWriter struct{ log *zap.Logger }

func (w *logWriter) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		if line != "" {
			w.log.Info("kubeadm", zap.String("line", line))
		}
	}
	return len(p), nil
}
