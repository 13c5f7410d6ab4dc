//go:build e2e

package e2e

import (
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
)

// checkMetricsReachableFromPods: every target deploy/monitoring's scrape configuration selects
// (deploy/monitoring's tests show which address each job keeps for the pods Berth deploys) answers
// a pod on a worker with its series, as a Prometheus running in the cluster would scrape it: each
// joinservice on its metrics port, each control plane's KMS plugin at the same address on its port,
// each webhook replica on its probe port.
func checkMetricsReachableFromPods(t testing.TB, c *cluster, fromPod string) {
	t.Helper()
	ips := func(name string) []string {
		out := c.kube("-n", joinconfig.Namespace, "get", "pods", "-l", joinconfig.NameLabel+"="+name,
			"-o", `jsonpath={range .items[*]}{.status.podIP}{"\n"}{end}`)
		return strings.Fields(out)
	}
	type target struct{ job, addr, series string }
	var targets []target
	for _, ip := range ips(joinconfig.JoinServiceName) {
		targets = append(targets,
			target{"berth-joinservice", net.JoinHostPort(ip, strconv.Itoa(joinconfig.MetricsPort)), "berth_joinservice_in_flight"},
			target{"berth-kms", net.JoinHostPort(ip, strconv.Itoa(kmsplugin.MetricsPort)), "berth_kms_healthy 1"})
	}
	for _, ip := range ips("berth-webhook") {
		targets = append(targets, target{"berth-webhook", net.JoinHostPort(ip, "8081"), "berth_webhook_ready"})
	}
	jobs := map[string]int{}
	for _, tg := range targets {
		jobs[tg.job]++
		start := time.Now()
		got, ok := c.kubeEventually(time.Minute, tg.series, "exec", fromPod, "--", "/testapp", "get", "http://"+tg.addr+"/metrics")
		if !ok {
			t.Errorf("job %s: %s/metrics from pod %s lacks %q: %.300s", tg.job, tg.addr, fromPod, tg.series, got)
			continue
		}
		t.Logf("job %s: %s/metrics answered pod %s with %q in %.1fs", tg.job, tg.addr, fromPod, tg.series, time.Since(start).Seconds())
	}
	for _, job := range []string{"berth-joinservice", "berth-kms", "berth-webhook"} {
		if jobs[job] == 0 {
			t.Errorf("no target of job %s: no pod of its component in %s", job, joinconfig.Namespace)
		}
	}
}
