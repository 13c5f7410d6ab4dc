//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"
)

// The certificate steps (issue "certificates that outlive their first year") run on a cluster whose
// first control plane, the one that ran berth init, is powered off for good: whatever renews the
// certificates now runs elsewhere. The API is reached through the mini cluster's load balancer.

const (
	certsNamespace   = "berth-system"
	certsSecret      = "berth-webhook-tls"
	certsSettings    = "berth-webhook-certificates"
	certsConfig      = "berth-image-policy"
	certsCheckPeriod = 20 * time.Second
	// The compressed trust chain of the load step: a leaf of 4 minutes renewed with 2m30s left (every
	// 90 s; the kubelet can take about 90 s to bring a changed Secret into a pod, and the old leaf
	// must still be valid until then), a CA of 10 minutes whose rotation starts 4m15s before it
	// expires. The year-long leaf and ten-year CA in place outlive these and are replaced at once.
	certsLeafValidity    = "4m"
	certsLeafRenewBefore = "2m30s"
	certsCAValidity      = "10m"
	certsLoadFor         = 10 * time.Minute
	certsLoadCap         = 16 * time.Minute
	// The control planes' compressed validity: their year-long certificates outlive it and are
	// renewed at once (one control plane after the other), the renewed ones again when a third of it
	// is left, or twice what a renewal took on that node (about 1.5 minutes here: kubeadm and three
	// restarts) when that is more. Ten minutes leave two control planes' renewals room not to
	// overlap, and both rounds fall within the webhook's ten minutes of load.
	certsControlPlaneValidity = 10 * time.Minute
)

// setCertSettings writes the webhook keeper's settings ConfigMap; nil deletes it.
func setCertSettings(t testing.TB, ctx context.Context, kube kubernetes.Interface, data map[string]string) {
	t.Helper()
	cms := kube.CoreV1().ConfigMaps(certsNamespace)
	if err := cms.Delete(ctx, certsSettings, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if data == nil {
		return
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: certsSettings, Namespace: certsNamespace}, Data: data}
	if _, err := cms.Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// foreignCA returns a CA certificate no Berth webhook serves under (its key is thrown away).
func foreignCA(t testing.TB) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "foreign-ca"}, IsCA: true, BasicConstraintsValid: true,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func logf(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	fmt.Println(msg)
	t.Log(msg)
}

// keeperPassedSince waits until the certificate keeper's leader reports a pass that passed after
// since (berth_certkeeper_webhook_last_success_timestamp_seconds on its node's metrics port).
func keeperPassedSince(t testing.TB, ctx context.Context, kube kubernetes.Interface, since time.Time) {
	t.Helper()
	var last string
	if err := wait.PollUntilContextTimeout(ctx, time.Second, 10*time.Minute, true, func(ctx context.Context) (bool, error) {
		node, _, _ := strings.Cut(certKeeperLeader(t, ctx, kube), "_")
		body, err := keeperMetrics(ctx, kube, node)
		if err != nil {
			last = err.Error()
			return false, nil
		}
		for _, line := range strings.Split(body, "\n") {
			if v, ok := strings.CutPrefix(line, "berth_certkeeper_webhook_last_success_timestamp_seconds "); ok {
				f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
				last = "last success " + v
				return err == nil && f >= float64(since.Unix()), nil
			}
		}
		last = "no berth_certkeeper_webhook_last_success_timestamp_seconds"
		return false, nil
	}); err != nil {
		t.Fatalf("the certificate keeper passed no check since %s: %s", since.Format(time.TimeOnly), last)
	}
}

// keeperMetrics returns what the joinservice on node serves on its metrics port.
func keeperMetrics(ctx context.Context, kube kubernetes.Interface, node string) (string, error) {
	n, err := kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	var ip string
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP {
			ip = a.Address
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(ip, "9003")+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err
}

// keeperDiagnostics logs what the certificate keeper is doing: the Lease (holder, last renewal),
// the leader's certificate keeper metrics (passes by result, renewals, last success) and the last
// lines of its joinservice's log, so that a keeper that renews nothing shows why.
func keeperDiagnostics(t testing.TB, ctx context.Context, kube kubernetes.Interface) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	l, err := kube.CoordinationV1().Leases(certsNamespace).Get(ctx, "berth-cert-keeper", metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		t.Logf("certificate keeper Lease: %v", err)
		return
	}
	renewed := "never"
	if l.Spec.RenewTime != nil {
		renewed = fmt.Sprintf("%s (%s ago)", l.Spec.RenewTime.UTC().Format(time.TimeOnly), time.Since(l.Spec.RenewTime.Time).Round(time.Second))
	}
	t.Logf("certificate keeper Lease: holder %s, renewed %s, transitions %d", *l.Spec.HolderIdentity, renewed, ptrValue(l.Spec.LeaseTransitions))
	node, _, _ := strings.Cut(*l.Spec.HolderIdentity, "_")
	if body, err := keeperMetrics(ctx, kube, node); err != nil {
		t.Logf("certificate keeper metrics on %s: %v", node, err)
	} else {
		var lines []string
		for _, line := range strings.Split(body, "\n") {
			if strings.HasPrefix(line, "berth_certkeeper_") || strings.HasPrefix(line, "berth_webhook_config_ok") {
				lines = append(lines, "  "+line)
			}
		}
		t.Logf("certificate keeper metrics on %s:\n%s", node, strings.Join(lines, "\n"))
	}
	pods, err := kube.CoreV1().Pods(certsNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=berth-joinservice"})
	if err != nil {
		t.Logf("joinservice pods: %v", err)
		return
	}
	tail := int64(80)
	for _, p := range pods.Items {
		if p.Spec.NodeName != node {
			continue
		}
		logs, err := kube.CoreV1().Pods(certsNamespace).GetLogs(p.Name, &corev1.PodLogOptions{TailLines: &tail}).DoRaw(ctx)
		t.Logf("joinservice %s on %s (restarts %d), last lines: %v\n%s", p.Name, node, restarts(p), err, logs)
	}
}

func ptrValue[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func restarts(p corev1.Pod) int32 {
	var n int32
	for _, c := range p.Status.ContainerStatuses {
		n += c.RestartCount
	}
	return n
}

// certsCABundleRepair: with the keeper's check period at certsCheckPeriod, a caBundle replaced by
// hand with another CA is replaced with the TLS Secret's bundle within one period, and the webhook
// enforces again. Prints the time and the period.
func certsCABundleRepair(t testing.TB, ctx context.Context, kube kubernetes.Interface) {
	changed := time.Now()
	setCertSettings(t, ctx, kube, map[string]string{"checkPeriod": certsCheckPeriod.String()})
	// A settled keeper: it passed a check with the new period.
	keeperPassedSince(t, ctx, kube, changed)
	vwcs := kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	secret, err := kube.CoreV1().Secrets(certsNamespace).Get(ctx, certsSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := secret.Data["ca-bundle.crt"]
	vwc, err := vwcs.Get(ctx, certsConfig, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(vwc.Webhooks[0].ClientConfig.CABundle, want) {
		t.Fatal("the configuration does not publish the Secret's bundle before the corruption")
	}
	vwc.Webhooks[0].ClientConfig.CABundle = foreignCA(t)
	start := time.Now()
	if _, err := vwcs.Update(ctx, vwc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	var repaired time.Duration
	if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 3*certsCheckPeriod, true, func(ctx context.Context) (bool, error) {
		got, err := vwcs.Get(ctx, certsConfig, metav1.GetOptions{})
		repaired = time.Since(start)
		return err == nil && bytes.Equal(got.Webhooks[0].ClientConfig.CABundle, want), nil
	}); err != nil {
		t.Fatalf("caBundle corrupted by hand: not repaired %s later (check period %s)", time.Since(start).Round(time.Millisecond), certsCheckPeriod)
	}
	logf(t, "caBundle corrupted by hand: repaired %s after the corruption; the keeper's check period is %s",
		repaired.Round(time.Millisecond), certsCheckPeriod)
	if repaired > certsCheckPeriod {
		t.Errorf("the repair took %s, more than one check period (%s)", repaired, certsCheckPeriod)
		keeperDiagnostics(t, ctx, kube)
	}
}

// chainEvent is one change of the webhook's TLS Secret seen by the test's watch.
type chainEvent struct {
	at       time.Time
	kind     string // "leaf", "CA rotation started", "CA rotation done"
	notAfter time.Time
}

// watchChain records every change of the TLS Secret until stopped, reading it once a second: a new
// serving certificate, a new CA (a rotation starts), the bundle shrinking to the new CA alone (the
// rotation is done). The time of a change is when it was first seen.
func watchChain(t testing.TB, ctx context.Context, kube kubernetes.Interface) (events func() []chainEvent, stop func()) {
	t.Helper()
	secrets := kube.CoreV1().Secrets(certsNamespace)
	cur, err := secrets.Get(ctx, certsSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var out []chainEvent
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	prev, rotating := cur.Data, false
	go func() {
		defer close(done)
		wait.UntilWithContext(wctx, func(ctx context.Context) {
			s, err := secrets.Get(ctx, certsSecret, metav1.GetOptions{})
			if err != nil {
				return
			}
			now := time.Now()
			var evs []chainEvent
			if leaf, ok := parseFirst(s.Data["tls.crt"]); ok && !bytes.Equal(s.Data["tls.crt"], prev["tls.crt"]) {
				evs = append(evs, chainEvent{at: now, kind: "leaf", notAfter: leaf.NotAfter})
			}
			ca, ok := parseFirst(s.Data["ca.crt"])
			if ok && !bytes.Equal(s.Data["ca.crt"], prev["ca.crt"]) {
				evs = append(evs, chainEvent{at: now, kind: "CA rotation started", notAfter: ca.NotAfter})
				rotating = true
			}
			// Done once the bundle holds the new CA alone (the steps in between may fall within
			// one read).
			if ok && rotating && countPEM(s.Data["ca-bundle.crt"]) == 1 && bytes.Equal(s.Data["ca-bundle.crt"], s.Data["ca.crt"]) {
				evs = append(evs, chainEvent{at: now, kind: "CA rotation done", notAfter: ca.NotAfter})
				rotating = false
			}
			prev = s.Data
			mu.Lock()
			out = append(out, evs...)
			mu.Unlock()
		}, time.Second)
	}()
	return func() []chainEvent {
			mu.Lock()
			defer mu.Unlock()
			return append([]chainEvent(nil), out...)
		}, func() {
			cancel()
			<-done
		}
}

// parseFirst returns the first certificate of a PEM bundle.
func parseFirst(data []byte) (*x509.Certificate, bool) {
	b, _ := pem.Decode(data)
	if b == nil {
		return nil, false
	}
	c, err := x509.ParseCertificate(b.Bytes)
	return c, err == nil
}

func countPEM(b []byte) int { return bytes.Count(b, []byte("-----BEGIN CERTIFICATE-----")) }

func countKind(evs []chainEvent, kind string) int {
	n := 0
	for _, e := range evs {
		if e.kind == kind {
			n++
		}
	}
	return n
}

// certsWebhookUnderLoad: with the compressed lifetimes, two clients send server-side dry-run pod
// creates (alternately allowed and denied) for at least certsLoadFor and until at least five
// serving certificates were renewed and a CA rotation finished, all by the certificate keeper on a
// surviving control plane; no request may fail. Prints the counts and every renewal's time.
func certsWebhookUnderLoad(t testing.TB, ctx context.Context, kube kubernetes.Interface, cfg *rest.Config) {
	ns := "certs-load"
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	waitSA(t, ctx, kube, ns)
	events, stopWatch := watchChain(t, ctx, kube)
	defer stopWatch()
	leader := certKeeperLeader(t, ctx, kube)
	logf(t, "certificate keeper leader: %s", leader)

	var total, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	var lastFailure time.Duration
	done := make(chan struct{})
	var wg sync.WaitGroup
	start := time.Now()
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	for cl := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := kubernetes.NewForConfigOrDie(cfg)
			for n := 0; ; n++ {
				select {
				case <-done:
					return
				case <-ctx.Done():
					return
				default:
				}
				deny := n%2 == 1
				image := whAllowed
				if deny {
					image = whDenied
				}
				_, err := client.CoreV1().Pods(ns).Create(ctx, whPod(ns, fmt.Sprintf("c%d-%d", cl, n), image), dry)
				total.Add(1)
				if (!deny && err != nil) || (deny && (err == nil || !strings.Contains(err.Error(), whMarker))) {
					failed.Add(1)
					mu.Lock()
					lastFailure = time.Since(start)
					if len(failures) < 10 {
						failures = append(failures, fmt.Sprintf("%s deny=%v: %v", time.Since(start).Round(time.Millisecond), deny, err))
					}
					mu.Unlock()
				}
			}
		}()
	}
	// The load runs before the lifetimes change, so that the first replacement (the year-long
	// chain outlives them) happens under it too.
	time.Sleep(5 * time.Second)
	setCertSettings(t, ctx, kube, map[string]string{
		"leafValidity": certsLeafValidity, "leafRenewBefore": certsLeafRenewBefore, "caValidity": certsCAValidity,
		"checkPeriod": certsCheckPeriod.String(),
	})
	_ = wait.PollUntilContextTimeout(ctx, 5*time.Second, certsLoadCap, false, func(context.Context) (bool, error) {
		evs := events()
		return time.Since(start) >= certsLoadFor && countKind(evs, "leaf") >= 5 && countKind(evs, "CA rotation done") >= 1, nil
	})
	close(done)
	wg.Wait()
	elapsed := time.Since(start)
	evs := events()
	var lines []string
	for _, e := range evs {
		lines = append(lines, fmt.Sprintf("  +%-7s %s  %s (valid until %s)", e.at.Sub(start).Round(time.Second), e.at.UTC().Format("15:04:05"), e.kind, e.notAfter.UTC().Format("15:04:05")))
	}
	logf(t, "webhook trust chain under load for %s with the init node powered off: %d leaf renewals, %d CA rotations started, %d finished; %d dry-run creates by 2 clients, %d failed; every change:\n%s",
		elapsed.Round(time.Second), countKind(evs, "leaf"), countKind(evs, "CA rotation started"), countKind(evs, "CA rotation done"),
		total.Load(), failed.Load(), strings.Join(lines, "\n"))
	if failed.Load() != 0 {
		t.Errorf("%d of %d requests failed, the last at %s; first ones:\n%s", failed.Load(), total.Load(), lastFailure.Round(time.Millisecond), strings.Join(failures, "\n"))
		keeperDiagnostics(t, ctx, kube)
	}
	if countKind(evs, "leaf") < 5 || countKind(evs, "CA rotation done") < 1 {
		t.Errorf("%d leaf renewals and %d finished CA rotations in %s, want at least 5 and 1", countKind(evs, "leaf"), countKind(evs, "CA rotation done"), elapsed.Round(time.Second))
		keeperDiagnostics(t, ctx, kube)
	}
	if elapsed < certsLoadFor {
		t.Errorf("the load ran %s, want at least %s", elapsed, certsLoadFor)
	}
}

// certKeeperLeader returns the holder of the certificate keeper's Lease.
func certKeeperLeader(t testing.TB, ctx context.Context, kube kubernetes.Interface) string {
	t.Helper()
	var holder string
	if err := wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		l, err := kube.CoordinationV1().Leases(certsNamespace).Get(ctx, "berth-cert-keeper", metav1.GetOptions{})
		if err != nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
			return false, nil
		}
		holder = *l.Spec.HolderIdentity
		return true, nil
	}); err != nil {
		t.Fatal("no certificate keeper holds Lease berth-system/berth-cert-keeper")
	}
	return holder
}

// expirationInfo is what `kubeadm certs check-expiration -o json` prints (the fields used).
type expirationInfo struct {
	Certificates []struct {
		Name           string    `json:"name"`
		ExpirationDate time.Time `json:"expirationDate"`
		Missing        bool      `json:"missing"`
	} `json:"certificates"`
}

// checkExpiration runs kubeadm certs check-expiration in node's namespaces; it returns the table and
// the expiry of each certificate by name.
func checkExpiration(t testing.TB, c *cluster, kubeadm, node string) (string, map[string]time.Time) {
	t.Helper()
	enter := []string{"--net=/run/netns/berth-" + clusterName + "-" + node, "--mount=" + filepath.Join(c.dir, "ns", node+".mnt"), "--"}
	table := c.must(2*time.Minute, "nsenter", append(enter, kubeadm, "certs", "check-expiration")...)
	raw := c.must(2*time.Minute, "nsenter", append(enter, kubeadm, "certs", "check-expiration", "-o", "json")...)
	// kubeadm prints a line about reading the configuration before the document.
	if i := strings.Index(raw, "{"); i > 0 {
		raw = raw[i:]
	}
	var info expirationInfo
	if err := json.Unmarshal([]byte(raw), &info); err != nil {
		t.Fatalf("kubeadm certs check-expiration -o json on %s: %v\n%s", node, err, raw)
	}
	out := map[string]time.Time{}
	for _, c := range info.Certificates {
		if !c.Missing {
			out[c.Name] = c.ExpirationDate
		}
	}
	return table, out
}

// certsControlPlane: the control planes' certificates, compressed to certsControlPlaneValidity in
// the cluster's kubeadm configuration, are renewed by each control plane itself: at once (the
// year-long ones outlive the validity), then again before they expire, the API servers restarted one
// at a time; kubectl through the load balancer keeps working the whole time, and kubeadm certs
// check-expiration on each control plane shows the new dates.
func certsControlPlane(t testing.TB, ctx context.Context, c *cluster, kube kubernetes.Interface, kubeadm string, nodes []string) {
	before := map[string]map[string]time.Time{}
	for _, n := range nodes {
		_, before[n] = checkExpiration(t, c, kubeadm, n)
	}
	setValidity(t, ctx, kube, certsControlPlaneValidity)
	start := time.Now()

	// kubectl, as an operator runs it, once a second through the load balancer.
	var calls, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	kctx, stopKubectl := context.WithCancel(ctx)
	kdone := make(chan struct{})
	go func() {
		defer close(kdone)
		wait.UntilWithContext(kctx, func(context.Context) {
			out, err := c.run(30*time.Second, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "get", "nodes", "-o", "name")
			if kctx.Err() != nil {
				return
			}
			calls.Add(1)
			if err != nil || !strings.Contains(out, "node/") {
				failed.Add(1)
				mu.Lock()
				if len(failures) < 10 {
					failures = append(failures, fmt.Sprintf("+%s: %v %s", time.Since(start).Round(time.Second), err, strings.TrimSpace(out)))
				}
				mu.Unlock()
			}
		}, time.Second)
	}()

	// Two renewals per control plane: the first at once, the second before the first's expiry.
	type renewal struct {
		at     time.Time
		expiry time.Time
	}
	seen := map[string][]renewal{}
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, 2*certsControlPlaneValidity, true, func(ctx context.Context) (bool, error) {
		all := true
		for _, n := range nodes {
			node, err := kube.CoreV1().Nodes().Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				all = false
				continue
			}
			at, err1 := time.Parse(time.RFC3339, node.Annotations["berth.dev/control-plane-certs-renewed"])
			exp, err2 := time.Parse(time.RFC3339, node.Annotations["berth.dev/control-plane-cert-expiry"])
			if err1 == nil && err2 == nil && !at.Before(start.Truncate(time.Second)) {
				if r := seen[n]; len(r) == 0 || !r[len(r)-1].at.Equal(at) {
					seen[n] = append(r, renewal{at: at, expiry: exp})
				}
			}
			all = all && len(seen[n]) >= 2
		}
		return all, nil
	})
	stopKubectl()
	<-kdone
	var lines []string
	for _, n := range nodes {
		for i, r := range seen[n] {
			lines = append(lines, fmt.Sprintf("  %s renewal %d at +%s, earliest expiry then %s", n, i+1, r.at.Sub(start).Round(time.Second), r.expiry.UTC().Format("15:04:05")))
		}
	}
	logf(t, "control-plane certificates with a validity of %s: kubectl through the load balancer %d calls, %d failed; renewals:\n%s",
		certsControlPlaneValidity, calls.Load(), failed.Load(), strings.Join(lines, "\n"))
	if failed.Load() != 0 {
		t.Errorf("kubectl failed %d of %d times across the renewals; first ones:\n%s", failed.Load(), calls.Load(), strings.Join(failures, "\n"))
	}
	if err != nil {
		t.Fatalf("not every control plane renewed twice within %s", 2*certsControlPlaneValidity)
	}
	for _, n := range nodes {
		r := seen[n]
		if second := r[len(r)-1]; !second.at.Before(r[len(r)-2].expiry) {
			t.Errorf("%s renewed at %s, after its certificates expired at %s", n, second.at, r[len(r)-2].expiry)
		}
	}
	for _, n := range nodes {
		table, after := checkExpiration(t, c, kubeadm, n)
		logf(t, "kubeadm certs check-expiration on %s after the renewals:\n%s", n, table)
		for _, name := range []string{"apiserver", "apiserver-kubelet-client", "etcd-server", "admin.conf"} {
			if after[name].Equal(before[n][name]) {
				t.Errorf("%s: check-expiration shows %s still expiring %s", n, name, after[name])
			}
			if got := time.Until(after[name]); got <= 0 || got > certsControlPlaneValidity {
				t.Errorf("%s: %s expires %s, want a new date within %s", n, name, after[name], certsControlPlaneValidity)
			}
		}
	}
}

// setValidity sets certificateValidityPeriod in the cluster's kubeadm configuration.
func setValidity(t testing.TB, ctx context.Context, kube kubernetes.Interface, validity time.Duration) {
	t.Helper()
	cms := kube.CoreV1().ConfigMaps(metav1.NamespaceSystem)
	cm, err := cms.Get(ctx, "kubeadm-config", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var cc map[string]any
	if err := yaml.Unmarshal([]byte(cm.Data["ClusterConfiguration"]), &cc); err != nil {
		t.Fatal(err)
	}
	cc["certificateValidityPeriod"] = validity.String()
	data, err := yaml.Marshal(cc)
	if err != nil {
		t.Fatal(err)
	}
	cm.Data["ClusterConfiguration"] = string(data)
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// certsKubeletServing: every running node's kubelet serves a certificate that the cluster CA
// signed for that node's name and address (serverTLSBootstrap), requested with a CSR that the
// certificate keeper approved after checking the node.
func certsKubeletServing(t testing.TB, ctx context.Context, kube kubernetes.Interface, cfg *rest.Config, nodes []string) {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(cfg.CAData) {
		t.Fatal("admin.conf carries no cluster CA")
	}
	for _, n := range nodes {
		node, err := kube.CoreV1().Nodes().Get(ctx, n, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var ip string
		for _, a := range node.Status.Addresses {
			if a.Type == corev1.NodeInternalIP {
				ip = a.Address
			}
		}
		var last error
		if err := wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(context.Context) (bool, error) {
			conn, err := tls.Dial("tcp", net.JoinHostPort(ip, "10250"), &tls.Config{RootCAs: roots, ServerName: ip, MinVersion: tls.VersionTLS12})
			if last = err; err != nil {
				return false, nil
			}
			leaf := conn.ConnectionState().PeerCertificates[0]
			conn.Close()
			if leaf.Subject.CommonName != "system:node:"+n {
				last = fmt.Errorf("kubelet serves a certificate for %q", leaf.Subject.CommonName)
				return false, nil
			}
			logf(t, "kubelet on %s (%s) serves a cluster-signed certificate for %s, valid until %s", n, ip, leaf.Subject.CommonName, leaf.NotAfter.UTC().Format(time.RFC3339))
			return true, nil
		}); err != nil {
			t.Errorf("kubelet on %s: no cluster-signed serving certificate for the node: %v", n, last)
		}
	}
	csrs, err := kube.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{FieldSelector: "spec.signerName=kubernetes.io/kubelet-serving"})
	if err != nil {
		t.Fatal(err)
	}
	approved := 0
	for _, csr := range csrs.Items {
		for _, c := range csr.Status.Conditions {
			if c.Type == "Approved" && c.Reason == "NodeVerified" {
				approved++
			}
		}
	}
	logf(t, "kubelet serving CSRs: %d, approved by the certificate keeper: %d", len(csrs.Items), approved)
	if approved == 0 {
		t.Error("no kubelet serving CSR was approved by the certificate keeper")
	}
}

// certsSteps runs the certificate checks on a cluster whose first control plane, the node that ran
// berth init, is powered off for good (TestMiniHA's, once it lost cp1): every running kubelet
// serves a certificate from a CSR the keeper approved, a corrupted caBundle is repaired, then the
// webhook's trust chain under load and the control planes' own certificates are renewed side by
// side (controlPlanes are the running ones): the load's requests cross every API server restart
// too. The compressed lifetimes stay in place; the cluster is torn down afterwards.
func certsSteps(t *failureLog, ctx context.Context, c *cluster, kubeadm string, controlPlanes, workers []string) {
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(c.dir, "admin.conf"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = -1, 0
	kube := kubernetes.NewForConfigOrDie(cfg)
	certsKubeletServing(t, ctx, kube, cfg, append(slices.Clone(controlPlanes), workers...))
	certsCABundleRepair(t, ctx, kube)
	t.Run("renewals", func(t *failureLog) {
		t.Run("webhook chain under load", func(t *failureLog) {
			t.Parallel()
			certsWebhookUnderLoad(t, ctx, kube, cfg)
		})
		t.Run("control-plane certificates", func(t *failureLog) {
			t.Parallel()
			sub := *c
			sub.t = t
			certsControlPlane(t, ctx, &sub, kube, kubeadm, controlPlanes)
		})
	})
}
