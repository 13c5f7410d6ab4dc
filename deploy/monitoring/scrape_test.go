package monitoring

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/common/promslog"
	"github.com/prometheus/prometheus/config"
	_ "github.com/prometheus/prometheus/discovery/kubernetes" // kubernetes_sd_configs in prometheus.yml
	promlabels "github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/relabel"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	klabels "k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// berthJobs are the scrape jobs prometheus.yml and podmonitors.yaml define and the target alerts
// name, with the port each one's target must have.
var berthJobs = map[string]int32{
	"berth-joinservice": joinconfig.MetricsPort,
	"berth-webhook":     8081, // the webhook's probe port (its container port "probes")
	"berth-kms":         kmsplugin.MetricsPort,
}

// namesBerthJobs reports whether matchers select up by a job label whose every value is a Berth job.
func namesBerthJobs(ms []*promlabels.Matcher) bool {
	for _, m := range ms {
		if m.Name != "job" {
			continue
		}
		switch m.Type {
		case promlabels.MatchEqual:
			_, ok := berthJobs[m.Value]
			return ok
		case promlabels.MatchRegexp:
			for _, alt := range strings.Split(m.Value, "|") {
				if _, ok := berthJobs[alt]; !ok {
					return false
				}
			}
			return true
		}
	}
	return false
}

// berthPods are the pods the scrape configurations must find: the joinservice's (from the
// DaemonSet berth init applies) and the webhook's (from the installer's Deployment), each as
// Kubernetes service discovery would see it at address ip.
func berthPods(t *testing.T) map[string]*corev1.Pod {
	t.Helper()
	ds, err := berthsystem.JoinServiceDaemonSet(berthsystem.Config{JoinServiceImage: "joinservice:test"}, []byte("policy"))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := yaml.Marshal(ds)
	if err != nil {
		t.Fatal(err)
	}
	var daemonSet appsv1.DaemonSet
	if err := yaml.Unmarshal(raw, &daemonSet); err != nil {
		t.Fatal(err)
	}
	if !daemonSet.Spec.Template.Spec.HostNetwork {
		t.Fatal("the joinservice no longer runs with the host's network: job berth-kms takes its pod address for the control plane's")
	}
	objs, err := install.Objects(install.Config{Image: "webhook:test", Replicas: 2, TimeoutSeconds: 5}, []byte("ca"))
	if err != nil {
		t.Fatal(err)
	}
	var webhook *appsv1.Deployment
	for _, o := range objs {
		if o.GetKind() == "Deployment" && o.GetName() == webhookconfig.Name {
			webhook = &appsv1.Deployment{}
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, webhook); err != nil {
				t.Fatal(err)
			}
		}
	}
	if webhook == nil {
		t.Fatal("the webhook's objects hold no Deployment")
	}
	pod := func(name, ns, ip string, tmpl corev1.PodTemplateSpec) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: tmpl.Labels}, Spec: tmpl.Spec,
			Status: corev1.PodStatus{PodIP: ip}}
	}
	return map[string]*corev1.Pod{
		"berth-joinservice": pod("berth-joinservice-x", daemonSet.Namespace, "192.0.2.10", daemonSet.Spec.Template),
		"berth-webhook":     pod("berth-webhook-x", webhook.Namespace, "10.244.1.7", webhook.Spec.Template),
	}
}

// discovered is what Kubernetes pod discovery yields for pod: one target per container port, with
// the meta labels the scrape configurations relabel on.
func discovered(pod *corev1.Pod) []promlabels.Labels {
	var out []promlabels.Labels
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			b := promlabels.NewBuilder(promlabels.EmptyLabels())
			b.Set(model.AddressLabel, net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(p.ContainerPort))))
			b.Set("__meta_kubernetes_namespace", pod.Namespace)
			b.Set("__meta_kubernetes_pod_name", pod.Name)
			b.Set("__meta_kubernetes_pod_ip", pod.Status.PodIP)
			b.Set("__meta_kubernetes_pod_node_name", "cp1")
			b.Set("__meta_kubernetes_pod_container_name", c.Name)
			b.Set("__meta_kubernetes_pod_container_port_name", p.Name)
			b.Set("__meta_kubernetes_pod_container_port_number", strconv.Itoa(int(p.ContainerPort)))
			for k, v := range pod.Labels {
				b.Set("__meta_kubernetes_pod_label_"+strings.NewReplacer(".", "_", "/", "_", "-", "_").Replace(k), v)
			}
			out = append(out, b.Labels())
		}
	}
	return out
}

// targets applies rcs to every discovered target of every pod and returns the addresses kept.
func targets(pods map[string]*corev1.Pod, rcs []*relabel.Config) []string {
	var addrs []string
	for _, name := range slices.Sorted(maps.Keys(pods)) {
		for _, ls := range discovered(pods[name]) {
			if out, keep := relabel.Process(ls, rcs...); keep {
				addrs = append(addrs, out.Get(model.AddressLabel))
			}
		}
	}
	return addrs
}

// want is the one target each job must find.
func want(job string, pods map[string]*corev1.Pod) string {
	pod := pods["berth-joinservice"]
	if job == "berth-webhook" {
		pod = pods["berth-webhook"]
	}
	return net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(berthJobs[job])))
}

// TestPrometheusConfigFindsEveryComponent: prometheus.yml loads as Prometheus loads it, defines
// exactly Berth's jobs, and each job's relabeling, applied to the pods Berth really runs, keeps one
// target: the component's metrics address.
func TestPrometheusConfigFindsEveryComponent(t *testing.T) {
	cfg, err := config.LoadFile("prometheus.yml", false, promslog.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.RuleFiles, []string{"alerts.yaml"}) {
		t.Errorf("rule_files = %v, want the alerts beside it", cfg.RuleFiles)
	}
	pods := berthPods(t)
	var jobs []string
	for _, sc := range cfg.ScrapeConfigs {
		jobs = append(jobs, sc.JobName)
		got := targets(pods, sc.RelabelConfigs)
		if w := want(sc.JobName, pods); !slices.Equal(got, []string{w}) {
			t.Errorf("job %s finds %v, want [%s]", sc.JobName, got, w)
		}
	}
	if !slices.Equal(slices.Sorted(slices.Values(jobs)), slices.Sorted(maps.Keys(berthJobs))) {
		t.Errorf("prometheus.yml's jobs %v, want %v", jobs, slices.Sorted(maps.Keys(berthJobs)))
	}
}

// TestPodMonitorsFindEveryComponent: podmonitors.yaml decodes strictly as the Prometheus Operator's
// PodMonitor, and each one, as the operator turns it into a scrape configuration (pods its selector
// matches in its namespace, the endpoint's named port, then its relabelings), finds the component's
// metrics address.
func TestPodMonitorsFindEveryComponent(t *testing.T) {
	raw, err := os.ReadFile("podmonitors.yaml")
	if err != nil {
		t.Fatal(err)
	}
	pods := berthPods(t)
	d := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	var jobs []string
	for {
		doc, err := d.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		var pm monitoringv1.PodMonitor
		if err := yaml.UnmarshalStrict(doc, &pm); err != nil {
			t.Fatalf("podmonitors.yaml: %v", err)
		}
		if pm.Kind != monitoringv1.PodMonitorsKind || pm.Namespace != joinconfig.Namespace {
			t.Errorf("%s: kind %q in namespace %q, want a PodMonitor in %s", pm.Name, pm.Kind, pm.Namespace, joinconfig.Namespace)
		}
		sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
		if err != nil {
			t.Fatal(err)
		}
		if len(pm.Spec.PodMetricsEndpoints) != 1 || pm.Spec.PodMetricsEndpoints[0].Port == nil {
			t.Fatalf("%s: want one endpoint with a named port", pm.Name)
		}
		ep := pm.Spec.PodMetricsEndpoints[0]
		rcs := []*relabel.Config{
			keep("__meta_kubernetes_namespace", pm.Namespace),
			keep("__meta_kubernetes_pod_container_port_name", *ep.Port),
		}
		for _, r := range ep.RelabelConfigs {
			rc, err := relabelConfig(r)
			if err != nil {
				t.Fatalf("%s: %v", pm.Name, err)
			}
			rcs = append(rcs, rc)
		}
		selected := map[string]*corev1.Pod{}
		for name, p := range pods {
			if sel.Matches(klabels.Set(p.Labels)) {
				selected[name] = p
			}
		}
		var job string
		for _, r := range ep.RelabelConfigs {
			if r.TargetLabel == "job" && r.Replacement != nil {
				job = *r.Replacement
			}
		}
		jobs = append(jobs, job)
		if w := want(job, pods); !slices.Equal(targets(selected, rcs), []string{w}) {
			t.Errorf("PodMonitor %s (job %q) finds %v, want [%s]", pm.Name, job, targets(selected, rcs), w)
		}
	}
	if !slices.Equal(slices.Sorted(slices.Values(jobs)), slices.Sorted(maps.Keys(berthJobs))) {
		t.Errorf("podmonitors.yaml's jobs %v, want %v", jobs, slices.Sorted(maps.Keys(berthJobs)))
	}
}

// TestScrapeCheckCatchesAWrongPort shows the checks above can fail: the webhook's job keeping its
// serving port instead of its probe port finds the wrong target.
func TestScrapeCheckCatchesAWrongPort(t *testing.T) {
	raw, err := os.ReadFile("prometheus.yml")
	if err != nil {
		t.Fatal(err)
	}
	broken := bytes.Replace(raw, []byte("berth-webhook;probes"), []byte("berth-webhook;https"), 1)
	if bytes.Equal(broken, raw) {
		t.Fatal("prometheus.yml no longer keeps the webhook's probes port")
	}
	cfg, err := config.Load(string(broken), promslog.NewNopLogger())
	if err != nil {
		t.Fatal(err)
	}
	pods := berthPods(t)
	for _, sc := range cfg.ScrapeConfigs {
		if sc.JobName == "berth-webhook" && slices.Equal(targets(pods, sc.RelabelConfigs), []string{want("berth-webhook", pods)}) {
			t.Error("the webhook's job with the serving port still passes the check")
		}
	}
}

func keep(label, value string) *relabel.Config {
	return &relabel.Config{SourceLabels: model.LabelNames{model.LabelName(label)}, Regex: relabel.MustNewRegexp(regexp.QuoteMeta(value)),
		Action: relabel.Keep, Separator: ";", Replacement: "$1", NameValidationScheme: model.UTF8Validation}
}

// relabelConfig converts the operator's relabeling to Prometheus's, with Prometheus's defaults.
func relabelConfig(r monitoringv1.RelabelConfig) (*relabel.Config, error) {
	rc := relabel.DefaultRelabelConfig
	rc.NameValidationScheme = model.UTF8Validation
	for _, l := range r.SourceLabels {
		rc.SourceLabels = append(rc.SourceLabels, model.LabelName(l))
	}
	if r.Regex != "" {
		re, err := relabel.NewRegexp(r.Regex)
		if err != nil {
			return nil, err
		}
		rc.Regex = re
	}
	if r.Replacement != nil {
		rc.Replacement = *r.Replacement
	}
	if r.Action != "" {
		rc.Action = relabel.Action(strings.ToLower(r.Action))
	}
	rc.TargetLabel = r.TargetLabel
	if err := rc.Validate(model.UTF8Validation); err != nil {
		return nil, fmt.Errorf("relabeling %+v: %w", r, err)
	}
	return &rc, nil
}
