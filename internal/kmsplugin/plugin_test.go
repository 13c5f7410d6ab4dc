package kmsplugin

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/yaml"

	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
)

// childEnv makes the test binary the plugin process (RunPlugin on its stdin and stdout), for the
// Supervisor's tests.
const childEnv = "BERTH_KMSPLUGIN_TEST_CHILD_SOCKET"

func TestMain(m *testing.M) {
	if sock := os.Getenv(childEnv); sock != "" {
		in, err := Stdin()
		if err != nil {
			os.Exit(3)
		}
		err = RunPlugin(context.Background(), PluginConfig{Socket: sock}, in, os.Stdout, zap.NewNop())
		if err != nil && !errors.Is(err, ErrParentGone) {
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// shortTempDir is a directory whose paths fit a unix socket address (108 bytes).
func shortTempDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("", "kms")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 20*time.Second, true,
		func(context.Context) (bool, error) { return cond(), nil }); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func TestListenRefusesWhatIsNotASocket(t *testing.T) {
	dir := shortTempDir(t)
	path := filepath.Join(dir, "kms", "kms.sock")
	lis, err := Listen(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(path)
	dst, _ := os.Stat(filepath.Dir(path))
	if st.Mode().Perm() != 0o600 || dst.Mode().Perm() != 0o700 {
		t.Errorf("socket %v, directory %v: want 0600 and 0700", st.Mode().Perm(), dst.Mode().Perm())
	}
	lis.Close()
	// A leftover socket (a plugin that was killed) is replaced.
	if _, err := os.Stat(path); err != nil {
		// net's listener removes its socket on Close; make a stale one.
		l, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close()
	}
	lis, err = Listen(context.Background(), path)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	lis.Close()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(context.Background(), file); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("Listen over a regular file = %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "keep me" {
		t.Error("Listen removed a regular file")
	}
}

// RunPlugin over real gRPC on a unix socket: keys from its input, the API's answers, the encrypt
// event, metrics, and its end when the input ends.
func TestRunPlugin(t *testing.T) {
	dir := shortTempDir(t)
	sock := filepath.Join(dir, "kms.sock")
	inR, inW := io.Pipe()
	evR, evW := io.Pipe()
	lc := net.ListenConfig{}
	ml, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := ml.Addr().String()
	ml.Close()
	done := make(chan error, 1)
	go func() {
		done <- RunPlugin(context.Background(), PluginConfig{Socket: sock, MetricsListen: metricsAddr}, inR, evW, zaptest.NewLogger(t))
		evW.Close()
	}()
	events := make(chan Event, 16)
	evDone := make(chan struct{})
	go func() {
		defer close(evDone)
		_ = ReadEvents(evR, func(e Event) { events <- e })
	}()

	c, err := NewClient(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	// Before any key: serving, unhealthy.
	waitFor(t, "the socket", func() bool { st, err := c.Status(ctx); return err == nil && st.Healthz != Healthy })

	set := KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}
	if err := WriteKeySet(inW, set); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "healthy with generation 1", func() bool {
		st, err := c.Status(ctx)
		return err == nil && st.Healthz == Healthy && st.KeyId == set.ActiveKeyID()
	})
	enc, err := c.Encrypt(ctx, []byte("a data-encryption key seed......"))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-events:
		if e.EncryptKeyID != set.ActiveKeyID() {
			t.Errorf("event = %+v, want the active key ID", e)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no encrypt event")
	}
	plain, err := c.Decrypt(ctx, enc.GetCiphertext(), enc.GetKeyId())
	if err != nil || string(plain) != "a data-encryption key seed......" {
		t.Errorf("Decrypt = %q, %v", plain, err)
	}
	if _, err := c.Decrypt(ctx, enc.GetCiphertext(), "berth:g9:0000000000000000"); err == nil || !strings.Contains(err.Error(), ErrUnknownKeyID.Error()) {
		t.Errorf("Decrypt with an unknown key ID over gRPC = %v", err)
	}

	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"berth_kms_healthy 1", "berth_kms_active_generation 1", "berth_kms_generations 1",
		`berth_kms_key_info{active="true",generation="1",key_id="` + set.ActiveKeyID() + `"} 1`,
		`berth_kms_requests_total{method="decrypt",result="error"} 1`, "berth_build_info{"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	// The bootstrapper is gone: the plugin stops.
	inW.Close()
	select {
	case err := <-done:
		if !errors.Is(err, ErrParentGone) {
			t.Errorf("RunPlugin after its input ended = %v, want ErrParentGone", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("RunPlugin did not stop when its input ended")
	}
	<-evDone
	if _, err := os.Stat(sock); err == nil {
		t.Error("the socket is left behind")
	}
}

func TestReadKeySetRefusesBadFrames(t *testing.T) {
	if _, err := ReadKeySet(bytes.NewReader(nil)); !errors.Is(err, io.EOF) {
		t.Errorf("empty input = %v, want io.EOF", err)
	}
	if _, err := ReadKeySet(bytes.NewReader([]byte{0, 1})); err == nil || errors.Is(err, io.EOF) {
		t.Errorf("cut header = %v", err)
	}
	if _, err := ReadKeySet(bytes.NewReader([]byte{0xff, 0, 0, 0})); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("huge frame = %v", err)
	}
	if _, err := ReadKeySet(bytes.NewReader([]byte{0, 0, 0, 3, '{', '}', ' '})); !errors.Is(err, ErrInvalidKeySet) {
		t.Errorf("bad key set = %v", err)
	}
}

// The Supervisor runs a real child process (this test binary as the plugin), hands it the key set,
// updates it, restarts it when it is killed and stops it at the end.
func TestSupervisor(t *testing.T) {
	dir := shortTempDir(t)
	sock := filepath.Join(dir, "kms.sock")
	t.Setenv(childEnv, sock)
	s := &Supervisor{Path: os.Args[0], Args: []string{"-test.run=^$"}, Log: zaptest.NewLogger(t)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
		if s.PID() != 0 {
			t.Error("a plugin still runs after Run returned")
		}
	}()
	if s.Starts() != 0 {
		t.Fatal("the plugin started without keys")
	}
	g1 := KeySet{Active: 1, Keys: []Key{testKey(1, 1)}}
	if err := s.SetKeys(g1); err != nil {
		t.Fatal(err)
	}
	if err := s.SetKeys(KeySet{Active: 3}); !errors.Is(err, ErrInvalidKeySet) {
		t.Errorf("SetKeys(invalid) = %v", err)
	}
	c, err := NewClient(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	bg := context.Background()
	activeIs := func(set KeySet) func() bool {
		return func() bool {
			st, err := c.Status(bg)
			return err == nil && st.Healthz == Healthy && st.KeyId == set.ActiveKeyID()
		}
	}
	waitFor(t, "the plugin with generation 1", activeIs(g1))
	if _, err := c.Encrypt(bg, []byte("seed")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the encrypt event", func() bool { return s.EncryptKeyID() == g1.ActiveKeyID() })

	g12 := KeySet{Active: 2, Keys: []Key{testKey(1, 1), testKey(2, 2)}}
	if err := s.SetKeys(g12); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the plugin with generation 2", activeIs(g12))

	// Killed: restarted with the keys it had.
	first := s.PID()
	if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a restarted plugin", func() bool { return s.Starts() == 2 && s.PID() != 0 && s.PID() != first })
	waitFor(t, "the restarted plugin with generation 2", activeIs(g12))
	if got, ok := s.Keys(); !ok || !got.Equal(g12) {
		t.Errorf("Keys() = %v", got)
	}
}

func TestEncryptionConfig(t *testing.T) {
	b, err := EncryptionConfig("/run/berth/kms/kms.sock")
	if err != nil {
		t.Fatal(err)
	}
	var cfg apiserverv1.EncryptionConfiguration
	if err := yaml.UnmarshalStrict(b, &cfg); err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
	if cfg.Kind != "EncryptionConfiguration" || cfg.APIVersion != "apiserver.config.k8s.io/v1" || len(cfg.Resources) != 1 {
		t.Fatalf("config:\n%s", b)
	}
	r := cfg.Resources[0]
	if strings.Join(r.Resources, ",") != "secrets" || len(r.Providers) != 1 || r.Providers[0].KMS == nil {
		t.Fatalf("want secrets through one KMS provider and nothing else:\n%s", b)
	}
	k := r.Providers[0].KMS
	if k.APIVersion != "v2" || k.Name != ProviderName || k.Endpoint != "unix:///run/berth/kms/kms.sock" || k.Timeout == nil {
		t.Errorf("KMS provider = %+v", k)
	}
}
