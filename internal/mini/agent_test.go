package mini

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/metadata"
)

// TestAgentServesMetadata runs the agent on a loopback listener. The metadata server tells callers
// apart by source address, so a loopback caller (no instance) is refused, which proves the server
// answers, and the state file's published values reach it.
func TestAgentServesMetadata(t *testing.T) {
	cfg := testConfig(t.TempDir())
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	st := &State{Config: cfg, Procs: map[string][]Proc{}, ControlPlaneEndpoint: "198.51.100.10:6443", InitSecretHash: strings.Repeat("ab", 32)}
	if err := st.save(); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serveAgent(ctx, cfg.Dir, st, lis, nil, 10*time.Millisecond, zaptest.NewLogger(t)) }()
	resp, err := http.Get("http://" + lis.Addr().String() + "/v1/self")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("unknown caller got %d, want 403", resp.StatusCode)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("agent: %v", err)
	}
}

// TestAgentServesAddedNodes: a node added to the state file is served without restarting the
// agent, and the agent says so in its nodes file.
func TestAgentServesAddedNodes(t *testing.T) {
	cfg := testConfig(t.TempDir())
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	st := &State{Config: cfg, Procs: map[string][]Proc{}}
	if err := st.save(); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serveAgent(ctx, cfg.Dir, st, lis, nil, 10*time.Millisecond, zaptest.NewLogger(t)) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v", err)
		}
	}()
	served := func(ctx context.Context, want string) error {
		return wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
			b, _ := os.ReadFile(filepath.Join(cfg.Dir, agentNodesFile))
			return string(b) == want, nil
		})
	}
	if err := served(ctx, "cp1\nw1\nw2\n"); err != nil {
		t.Fatalf("agent does not report the initial nodes: %v", err)
	}
	st.Config.Added = []Node{{Name: "w3", Role: metadata.RoleWorker, IP: netip.MustParseAddr("198.51.100.13")}}
	if err := st.save(); err != nil {
		t.Fatal(err)
	}
	if err := served(ctx, "cp1\nw1\nw2\nw3\n"); err != nil {
		t.Fatalf("agent does not serve the added node: %v", err)
	}
}

func TestSyncCNIWithoutContainerd(t *testing.T) {
	cfg := testConfig(t.TempDir())
	// No containerd recorded: nothing to read, nothing written, no error.
	if err := syncCNI(cfg, &State{Config: cfg}, "w1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(cfg.NodeDir("w1"), "fs", "etc-cni-net.d", cniConfName)); err == nil {
		t.Error("CNI config written without a flannel lease")
	}
}

type fakeNodes struct{ items []corev1.Node }

func (f fakeNodes) List(context.Context, metav1.ListOptions) (*corev1.NodeList, error) {
	return &corev1.NodeList{Items: f.items}, nil
}

func readyNode(name string, hb time.Time) corev1.Node {
	return corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{
		{Type: corev1.NodeReady, Status: corev1.ConditionTrue, LastHeartbeatTime: metav1.NewTime(hb)},
	}}}
}

func TestNotReadyAndWait(t *testing.T) {
	cfg := testConfig("/x")
	now := time.Now()
	items := []corev1.Node{readyNode("cp1", now), readyNode("w1", now.Add(-time.Hour))}
	got := notReady(items, cfg.Nodes(), now.Add(-time.Minute))
	if strings.Join(got, " ") != "w1(not ready) w2(not registered)" {
		t.Errorf("notReady = %v", got)
	}
	if got := notReady(items, cfg.Nodes()[:2], time.Time{}); len(got) != 0 {
		t.Errorf("notReady without since = %v", got)
	}
	all := fakeNodes{items: []corev1.Node{readyNode("cp1", now), readyNode("w1", now), readyNode("w2", now)}}
	if err := waitNodesReady(context.Background(), all, cfg.Nodes(), time.Time{}, nil); err != nil {
		t.Errorf("waitNodesReady = %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := waitNodesReady(ctx, fakeNodes{items: items}, cfg.Nodes(), time.Time{}, nil); err == nil || !strings.Contains(err.Error(), "w2(not registered)") {
		t.Errorf("waitNodesReady on missing node = %v", err)
	}
}

func TestLastRejection(t *testing.T) {
	p := filepath.Join(t.TempDir(), "b.log")
	log := `{"level":"info","msg":"fresh node"}
{"level":"warn","msg":"join ticket rejected","reason":"measurement mismatch: PCR 4"}
{"level":"info","msg":"retrying"}
`
	if err := os.WriteFile(p, []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := lastRejection(p); !strings.Contains(got, "PCR 4") {
		t.Errorf("lastRejection = %q", got)
	}
	if got := lastRejection(filepath.Join(t.TempDir(), "missing")); got != "" {
		t.Errorf("lastRejection of missing file = %q", got)
	}
}

func TestPolicyAndBootMeasurement(t *testing.T) {
	cl := New(testConfig("/c"), Env{}, &recorder{}, zaptest.NewLogger(t))
	p := string(cl.policyFile())
	for _, want := range []string{"variant: tpm", "  4:\n    expected: " + ExpectedBootPCR(), "file: /c/tpm-ca/swtpm-localca-rootca-cert.pem", "file: /c/tpm-ca/issuercert.pem"} {
		if !strings.Contains(p, want) {
			t.Errorf("policy lacks %q:\n%s", want, p)
		}
	}
	if bootEvent(true) == bootEvent(false) {
		t.Error("tampered and genuine boots measure the same")
	}
	if len(ExpectedBootPCR()) != 64 {
		t.Errorf("expected PCR = %s", ExpectedBootPCR())
	}
}

func TestSeedContainerdRoot(t *testing.T) {
	golden := t.TempDir()
	for p, data := range map[string]string{
		"io.containerd.metadata.v1.bolt/meta.db":                      "db",
		"io.containerd.content.v1.content/blobs/sha256/abc":           "blob",
		"io.containerd.snapshotter.v1.overlayfs/metadata.db":          "sdb",
		"io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/bin/x": "layer file",
	} {
		if err := writeFile(filepath.Join(golden, p), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("bin/x", filepath.Join(golden, "io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/link")); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "root")
	if err := SeedContainerdRoot(golden, dst); err != nil {
		t.Fatal(err)
	}
	same := func(rel string) bool {
		a, _ := os.Stat(filepath.Join(golden, rel))
		b, err := os.Stat(filepath.Join(dst, rel))
		if err != nil {
			t.Fatalf("%s not seeded: %v", rel, err)
		}
		return os.SameFile(a, b)
	}
	if !same("io.containerd.content.v1.content/blobs/sha256/abc") || !same("io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/bin/x") {
		t.Error("immutable files are not hard links")
	}
	if same("io.containerd.metadata.v1.bolt/meta.db") || same("io.containerd.snapshotter.v1.overlayfs/metadata.db") {
		t.Error("databases are shared with the golden root")
	}
	if l, err := os.Readlink(filepath.Join(dst, "io.containerd.snapshotter.v1.overlayfs/snapshots/1/fs/link")); err != nil || l != "bin/x" {
		t.Errorf("symlink = %q, %v", l, err)
	}
}
