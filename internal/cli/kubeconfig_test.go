package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/berth-k8s/berth/internal/joinledger"
)

// fakeAPI is an httptest fake of the one API call berth status makes (GET of the ledger
// ConfigMap) on loopback. With entries nil it answers 404, as a cluster without a ledger does.
type fakeAPI struct {
	*httptest.Server
	hits atomic.Int32
}

func newFakeAPI(t *testing.T, entries []joinledger.Entry) *fakeAPI {
	t.Helper()
	f := &fakeAPI{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		if r.Method != http.MethodGet || r.URL.Path != "/api/v1/namespaces/berth-system/configmaps/"+joinledger.ConfigMapName || entries == nil {
			w.WriteHeader(http.StatusNotFound)
			_ = json.NewEncoder(w).Encode(metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
				Status: metav1.StatusFailure, Reason: metav1.StatusReasonNotFound, Code: http.StatusNotFound})
			return
		}
		data, _ := json.Marshal(entries)
		_ = json.NewEncoder(w).Encode(corev1.ConfigMap{
			TypeMeta:   metav1.TypeMeta{Kind: "ConfigMap", APIVersion: "v1"},
			ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: "berth-system"},
			Data:       map[string]string{joinledger.DataKey: string(data)},
		})
	}))
	t.Cleanup(f.Close)
	return f
}

// writeKubeconfig writes a kubeconfig with one context per name (cluster at servers[i]) and
// current-context current.
func writeKubeconfig(t *testing.T, path, current string, names, servers []string) {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	for i, n := range names {
		cfg.Clusters[n] = &clientcmdapi.Cluster{Server: servers[i]}
		cfg.AuthInfos[n] = &clientcmdapi.AuthInfo{Token: "token-" + n}
		cfg.Contexts[n] = &clientcmdapi.Context{Cluster: n, AuthInfo: n}
	}
	cfg.CurrentContext = current
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
}

func statusJSON(t *testing.T, args ...string) (int, statusReport, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := Execute(context.Background(), append([]string{"status", "-o", "json"}, args...), &out, &errOut)
	var r statusReport
	if code == exitOK {
		if err := json.Unmarshal(out.Bytes(), &r); err != nil {
			t.Fatalf("decoding berth status -o json: %v\n%s", err, out.String())
		}
	}
	return code, r, errOut.String()
}

// TestStatusFindsTheClusterAsKubectlDoes: KUBECONFIG is a list merged first-wins, --context picks
// a context of any listed file, --kubeconfig wins over KUBECONFIG, and without any kubeconfig the
// error is ErrNoKubeconfig with the usage code.
func TestStatusFindsTheClusterAsKubectlDoes(t *testing.T) {
	noLedger := newFakeAPI(t, nil)
	withLedger := newFakeAPI(t, []joinledger.Entry{{Time: time.Unix(1, 0), Peer: "198.51.100.12", Outcome: joinledger.OutcomeRejected, Reason: "MEASUREMENT_MISMATCH"}})
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.conf"), filepath.Join(dir, "b.conf")
	writeKubeconfig(t, a, "ctx-a", []string{"ctx-a"}, []string{noLedger.URL})
	// b also defines ctx-a, pointing elsewhere: in the list a:b, a's ctx-a wins.
	writeKubeconfig(t, b, "ctx-b", []string{"ctx-b", "ctx-a"}, []string{withLedger.URL, withLedger.URL})
	home := filepath.Join(dir, "home-config")
	orig := clientcmd.RecommendedHomeFile
	t.Cleanup(func() { clientcmd.RecommendedHomeFile = orig })
	clientcmd.RecommendedHomeFile = home

	for _, tc := range []struct {
		name       string
		kubeconfig string // KUBECONFIG
		args       []string
		wantLedger bool
	}{
		{"list, first file's current-context", a + string(filepath.ListSeparator) + b, nil, false},
		{"list, first file's context wins a clash", b + string(filepath.ListSeparator) + a, []string{"--context", "ctx-a"}, true},
		{"list, --context from the second file", a + string(filepath.ListSeparator) + b, []string{"--context", "ctx-b"}, true},
		{"--kubeconfig wins over KUBECONFIG", a, []string{"--kubeconfig", b}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("KUBECONFIG", tc.kubeconfig)
			code, r, stderr := statusJSON(t, tc.args...)
			if code != exitOK || r.LedgerFound != tc.wantLedger {
				t.Fatalf("exit %d, ledgerFound %v, want %v; stderr %q", code, r.LedgerFound, tc.wantLedger, stderr)
			}
		})
	}
	t.Run("home file when KUBECONFIG is unset", func(t *testing.T) {
		t.Setenv("KUBECONFIG", "")
		writeKubeconfig(t, home, "ctx-b", []string{"ctx-b"}, []string{withLedger.URL})
		code, r, stderr := statusJSON(t)
		if code != exitOK || !r.LedgerFound {
			t.Fatalf("exit %d, ledgerFound %v; stderr %q", code, r.LedgerFound, stderr)
		}
	})
	t.Run("no kubeconfig at all", func(t *testing.T) {
		t.Setenv("KUBECONFIG", "")
		clientcmd.RecommendedHomeFile = filepath.Join(dir, "nothing-here")
		code, _, stderr := statusJSON(t)
		if code != exitUsage || !strings.Contains(stderr, "no kubeconfig") || !strings.Contains(stderr, "export KUBECONFIG=") {
			t.Fatalf("exit %d, stderr %q; want %d and ErrNoKubeconfig", code, stderr, exitUsage)
		}
		_, err := (&kubeOptions{}).restConfig()
		if !errors.Is(err, ErrNoKubeconfig) {
			t.Fatalf("restConfig without a kubeconfig: %v", err)
		}
	})
	t.Run("unknown context", func(t *testing.T) {
		t.Setenv("KUBECONFIG", a)
		if code, _, stderr := statusJSON(t, "--context", "nope"); code != exitUsage || !strings.Contains(stderr, "nope") {
			t.Fatalf("exit %d, stderr %q", code, stderr)
		}
	})
	t.Run("missing --kubeconfig file", func(t *testing.T) {
		t.Setenv("KUBECONFIG", a)
		if code, _, stderr := statusJSON(t, "--kubeconfig", filepath.Join(dir, "missing.conf")); code != exitUsage || !strings.Contains(stderr, "missing.conf") {
			t.Fatalf("exit %d, stderr %q", code, stderr)
		}
	})
	t.Run("API server unreachable", func(t *testing.T) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		closed := "http://" + lis.Addr().String()
		_ = lis.Close()
		c := filepath.Join(dir, "closed.conf")
		writeKubeconfig(t, c, "x", []string{"x"}, []string{closed})
		t.Setenv("KUBECONFIG", c)
		if code, _, stderr := statusJSON(t, "--timeout", "5s"); code != exitFailure {
			t.Fatalf("exit %d, want %d; stderr %q", code, exitFailure, stderr)
		}
	})
	if noLedger.hits.Load() == 0 || withLedger.hits.Load() == 0 {
		t.Fatalf("hits: no-ledger server %d, ledger server %d", noLedger.hits.Load(), withLedger.hits.Load())
	}
}
