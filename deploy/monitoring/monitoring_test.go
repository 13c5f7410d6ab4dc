package monitoring

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"go.uber.org/zap"
	"go.yaml.in/yaml/v3"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/webhook"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/joinservice/certkeeper"
	"github.com/berth-k8s/berth/joinservice/metrics"
)

// exported is every series name the Berth binaries that serve metrics export (the joinservice,
// berth-webhook and a control plane's KMS plugin), from their own registries. A vector has no series before its first use, so each
// binary's metrics are used once first.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	gather := func(g prometheus.Gatherer) {
		fams, err := g.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fams {
			name := f.GetName()
			switch f.GetType() {
			case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
				names[name+"_bucket"], names[name+"_sum"], names[name+"_count"] = true, true, true
			case dto.MetricType_SUMMARY:
				names[name], names[name+"_sum"], names[name+"_count"] = true, true, true
			default:
				names[name] = true
			}
		}
	}

	js := metrics.New(ledgerCounts{})
	js.Attempt("join", "accepted", "")
	js.Latency("join", "total", time.Millisecond)
	js.InFlight(0)
	js.PolicyReload(true)
	gather(js.Registry())

	wh := webhook.NewMetrics()
	review := `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Pod"},` +
		`"resource":{"group":"","version":"v1","resource":"pods"},"operation":"CREATE","namespace":"default","object":{"kind":"Pod","spec":{"containers":[{"name":"c","image":"x.example/c"}]}}}}`
	rec := httptest.NewRecorder()
	webhook.NewHandler(zap.NewNop(), nil, time.Second, wh).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, webhook.Path, strings.NewReader(review)))
	if rec.Code != http.StatusOK {
		t.Fatalf("webhook handler: HTTP %d %s", rec.Code, rec.Body.String())
	}
	gather(wh.Registry())

	// The certificate keeper's, in the joinservice's registry: a pass that changed everything, a
	// control-plane certificate, a CSR decision.
	reg := prometheus.NewRegistry()
	pki := t.TempDir()
	writeCert(t, filepath.Join(pki, certkeeper.ControlPlaneFiles["apiserver"]))
	km := certkeeper.NewMetrics(reg, certkeeper.NewControlPlaneCerts(pki))
	km.Leading(true)
	now := time.Now()
	km.Pass(install.KeepReport{ConfigOK: true, LeafRenewed: true, CARenewed: true, RotationDone: true, BundleRepaired: true,
		Expiry: install.Expiry{Leaf: now, CA: now, Bundle: now}}, nil, time.Second)
	km.CSRDecision("approved", "NodeVerified")
	gather(reg)

	// A control plane's KMS plugin (bootstrapper kms-plugin).
	kms := kmsplugin.NewMetrics()
	kms.Request(kmsplugin.MethodStatus, "", nil, time.Millisecond)
	kms.Health(true, "")
	kms.Keys(kmsplugin.KeySet{Active: 1, Keys: []kmsplugin.Key{{Generation: 1, KEK: make([]byte, kmsplugin.KeySize)}}})
	gather(kms.Registry())

	// The backup schedule's, in the joinservice's registry (internal/backup).
	breg := prometheus.NewRegistry()
	backup.NewMetrics(breg)
	gather(breg)

	for _, n := range []string{"berth_joinservice_attempts_total", "berth_webhook_decisions_total", "berth_webhook_decision_seconds_bucket", "berth_build_info",
		"berth_cert_expiry_timestamp_seconds", "berth_certkeeper_leader", "berth_webhook_config_ok", "berth_certkeeper_csr_decisions_total",
		"berth_kms_healthy", "berth_kms_generations", backup.LastSuccessMetric} {
		if !names[n] {
			t.Fatalf("%s is not among the exported names: the registries were not gathered as expected", n)
		}
	}
	return names
}

type ledgerCounts struct{}

func (ledgerCounts) Dropped() uint64    { return 0 }
func (ledgerCounts) Superseded() uint64 { return 0 }

// grafanaVariables are the dashboard's interval variables, replaced by a duration before parsing.
var grafanaVariables = regexp.MustCompile(`\$__(rate_interval|interval|range)\b`)

// unknownMetrics parses expr (with Grafana's interval variables) and returns the metric names it
// selects that are not in known. A selector that names no metric (only labels) is an error: it
// would match every metric, Berth's or not.
func unknownMetrics(expr string, known map[string]bool) ([]string, error) {
	expr = grafanaVariables.ReplaceAllString(expr, "5m")
	if strings.Contains(expr, "$") {
		return nil, fmt.Errorf("expression %q uses a variable the check does not know", expr)
	}
	e, err := parser.ParseExpr(expr)
	if err != nil {
		return nil, fmt.Errorf("parsing %q: %w", expr, err)
	}
	var unknown []string
	var errs []error
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name != model.MetricNameLabel || name != "" {
				continue
			}
			if m.Type != labels.MatchEqual {
				errs = append(errs, fmt.Errorf("%q selects metrics by a pattern (%s): name them", expr, m))
				return nil
			}
			name = m.Value
		}
		switch {
		case name == "":
			errs = append(errs, fmt.Errorf("%q has a selector without a metric name: %s", expr, vs))
		case name == "up":
			// Prometheus's own series of a target; Berth's only when its job is one of Berth's.
			if !namesBerthJobs(vs.LabelMatchers) {
				unknown = append(unknown, name)
			}
		case !known[name]:
			unknown = append(unknown, name)
		}
		return nil
	})
	if len(errs) > 0 {
		return nil, errs[0]
	}
	return unknown, nil
}

// dashboardExprs returns every target expression of every panel (rows' panels included), and an
// error for a panel without one.
func dashboardExprs(raw []byte) ([]string, error) {
	var d struct {
		Title  string  `json:"title"`
		UID    string  `json:"uid"`
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("parsing the dashboard: %w", err)
	}
	if d.Title == "" || d.UID == "" {
		return nil, fmt.Errorf("the dashboard has no title or uid")
	}
	var exprs []string
	ids := map[int]bool{}
	var walk func([]panel) error
	walk = func(ps []panel) error {
		for _, p := range ps {
			if ids[p.ID] {
				return fmt.Errorf("panel id %d is used twice", p.ID)
			}
			ids[p.ID] = true
			if p.Type == "row" {
				if err := walk(p.Panels); err != nil {
					return err
				}
				continue
			}
			if len(p.Targets) == 0 {
				return fmt.Errorf("panel %q has no query", p.Title)
			}
			if p.Datasource.UID != "${datasource}" {
				return fmt.Errorf("panel %q does not use the dashboard's data source variable", p.Title)
			}
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					return fmt.Errorf("panel %q has an empty query", p.Title)
				}
				exprs = append(exprs, tg.Expr)
			}
		}
		return nil
	}
	return exprs, walk(d.Panels)
}

type panel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

// ruleFile is a Prometheus rule file.
type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// checkExprs returns one line per expression that does not parse or names a metric Berth does
// not export.
func checkExprs(exprs []string, known map[string]bool) []string {
	var bad []string
	for _, e := range exprs {
		unknown, err := unknownMetrics(e, known)
		switch {
		case err != nil:
			bad = append(bad, err.Error())
		case len(unknown) > 0:
			bad = append(bad, fmt.Sprintf("%q names metrics Berth does not export: %s", e, strings.Join(unknown, ", ")))
		}
	}
	return bad
}

func TestDashboardNamesExportedMetrics(t *testing.T) {
	raw, err := os.ReadFile("grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	exprs, err := dashboardExprs(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(exprs) < 10 {
		t.Fatalf("only %d expressions in the dashboard", len(exprs))
	}
	for _, b := range checkExprs(exprs, exported(t)) {
		t.Error(b)
	}
}

func TestAlertsNameExportedMetrics(t *testing.T) {
	raw, err := os.ReadFile("alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var f ruleFile
	if err := yaml.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	var exprs []string
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Annotations["summary"] == "" || !slices.Contains([]string{"warning", "critical"}, r.Labels["severity"]) {
				t.Errorf("group %s: rule %q needs an alert name, a summary and severity warning or critical", g.Name, r.Alert)
			}
			exprs = append(exprs, r.Expr)
		}
	}
	if len(exprs) < 10 {
		t.Fatalf("only %d alert rules", len(exprs))
	}
	for _, b := range checkExprs(exprs, exported(t)) {
		t.Error(b)
	}
}

// TestCheckCatchesUnknownMetrics shows that the checks above can fail.
func TestCheckCatchesUnknownMetrics(t *testing.T) {
	known := exported(t)
	for _, tc := range []struct {
		expr    string
		unknown []string
		err     bool
	}{
		{expr: `sum(rate(berth_joinservice_attempts_total{reason="RATE_LIMITED"}[$__rate_interval]))`},
		{expr: `histogram_quantile(0.99, sum by (le) (rate(berth_webhook_decision_seconds_bucket[5m])))`},
		{expr: `process_resident_memory_bytes * on (instance) group_left (version) berth_build_info`},
		{expr: `{__name__="berth_webhook_ready"} == 0`},
		{expr: `sum(rate(berth_made_up_total[$__rate_interval]))`, unknown: []string{"berth_made_up_total"}},
		{expr: `rate(berth_joinservice_attempt_total[5m])`, unknown: []string{"berth_joinservice_attempt_total"}},
		{expr: `berth_webhook_decision_seconds`, unknown: []string{"berth_webhook_decision_seconds"}}, // a histogram's base name is no series
		{expr: `up == 0 or berth_webhook_ready == 0`, unknown: []string{"up"}},
		{expr: `up{job="berth-kms"} == 0`},
		{expr: `absent(up{job="berth-webhook"})`},
		{expr: `up{job=~"berth-joinservice|berth-kms"} == 0`},
		{expr: `up{job="node"} == 0`, unknown: []string{"up"}},
		{expr: `up{job=~"berth-.*"} == 0`, unknown: []string{"up"}},
		{expr: `up{job!="berth-kms"} == 0`, unknown: []string{"up"}},
		{expr: `{job="berth"}`, err: true},
		{expr: `{__name__=~"berth_.*"}`, err: true},
		{expr: `rate(berth_webhook_ready[$job])`, err: true},
		{expr: `sum(rate(berth_webhook_ready[5m])`, err: true},
	} {
		unknown, err := unknownMetrics(tc.expr, known)
		if (err != nil) != tc.err || !slices.Equal(unknown, tc.unknown) {
			t.Errorf("%s: unknown %q, error %v; want unknown %q, error %v", tc.expr, unknown, err, tc.unknown, tc.err)
		}
	}

	// The dashboard with one made-up query more fails the check.
	raw, err := os.ReadFile("grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d map[string]any
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	ps := d["panels"].([]any)
	ps = append(ps, map[string]any{"id": 9999, "type": "timeseries", "title": "made up", "datasource": map[string]any{"uid": "${datasource}"},
		"targets": []any{map[string]any{"expr": `rate(berth_joinservice_tickets_total[$__rate_interval])`}}})
	d["panels"] = ps
	var buf bytes.Buffer
	if err := json.NewEncoder(&buf).Encode(d); err != nil {
		t.Fatal(err)
	}
	exprs, err := dashboardExprs(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	bad := checkExprs(exprs, known)
	if len(bad) != 1 || !strings.Contains(bad[0], "berth_joinservice_tickets_total") {
		t.Fatalf("a dashboard with a made-up metric: %q", bad)
	}
}

// writeCert writes a self-signed certificate to path.
func writeCert(t *testing.T, path string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
}
