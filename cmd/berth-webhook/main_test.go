package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/webhook"
)

// TestMain runs main when the test binary is started as the webhook by the tests below.
func TestMain(m *testing.M) {
	if os.Getenv("BERTH_WEBHOOK_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func writeFiles(t *testing.T, dir string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "t"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	for name, data := range map[string][]byte{
		"tls.crt":     pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		"tls.key":     pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}),
		"policy.yaml": []byte(webhook.DefaultPolicy),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

type proc struct {
	cmd         *exec.Cmd
	exited      chan struct{}
	addr, probe string
}

func start(t *testing.T, delay time.Duration) *proc {
	t.Helper()
	dir := t.TempDir()
	writeFiles(t, dir)
	p := &proc{addr: freeAddr(t), probe: freeAddr(t), exited: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0], "--listen="+p.addr, "--probe-listen="+p.probe,
		"--cert-file="+filepath.Join(dir, "tls.crt"), "--key-file="+filepath.Join(dir, "tls.key"),
		"--policy-file="+filepath.Join(dir, "policy.yaml"), "--shutdown-delay="+delay.String(), "--reload-interval=100ms")
	p.cmd.Env = append(os.Environ(), "BERTH_WEBHOOK_TEST_MAIN=1")
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.exited
	})
	err := wait.PollUntilContextTimeout(t.Context(), 20*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
		return p.readyz() == http.StatusOK, nil
	})
	if err != nil {
		t.Fatal("webhook never became ready")
	}
	return p
}

func (p *proc) readyz() int {
	resp, err := http.Get("http://" + p.probe + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func (p *proc) review() (*http.Response, error) {
	body := `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","operation":"CREATE","namespace":"default",` +
		`"kind":{"group":"","version":"v1","kind":"Pod"},"resource":{"group":"","version":"v1","resource":"pods"},` +
		`"object":{"spec":{"containers":[{"name":"c","image":"berth.local/a:1"}]}}}}`
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 2 * time.Second}).Post("https://"+p.addr+webhook.Path, "application/json", bytes.NewReader([]byte(body)))
	if err == nil {
		resp.Body.Close()
	}
	return resp, err
}

// TestSIGTERMDrains is the drain on SIGTERM, checked on the binary: readiness fails at once,
// reviews are still answered (with Connection: close) during the delay, and the process exits
// cleanly only after the delay.
func TestSIGTERMDrains(t *testing.T) {
	const delay = time.Second
	p := start(t, delay)
	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for p.readyz() == http.StatusOK {
		if time.Since(sent) > 500*time.Millisecond {
			t.Fatal("still ready 500 ms after SIGTERM")
		}
	}
	t.Logf("readiness failed %s after SIGTERM", time.Since(sent).Round(time.Millisecond))
	served := 0
	for time.Since(sent) < delay/2 {
		resp, err := p.review()
		if err != nil {
			t.Fatalf("review during the drain: %v", err)
		}
		if !resp.Close || resp.StatusCode != http.StatusOK {
			t.Fatalf("review during the drain: HTTP %d, close=%v", resp.StatusCode, resp.Close)
		}
		served++
	}
	<-p.exited
	lived := time.Since(sent)
	if lived < delay {
		t.Fatalf("exited %s after SIGTERM, before the %s delay", lived, delay)
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("exit code %d after a drain", code)
	}
	t.Logf("served %d reviews while draining; exited %s after SIGTERM", served, lived.Round(time.Millisecond))
}

// TestSecondSignalExitsAtOnce is the drain's last point: a second SIGTERM exits at once.
func TestSecondSignalExitsAtOnce(t *testing.T) {
	p := start(t, time.Minute)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	err := wait.PollUntilContextTimeout(t.Context(), 5*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		return p.readyz() != http.StatusOK, nil
	})
	if err != nil {
		t.Fatal("still ready 5 s after SIGTERM")
	}
	sent := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
		t.Fatal("still running 5 s after the second SIGTERM")
	}
	var exit *exec.ExitError
	if err := p.cmd.Wait(); err != nil && !errors.As(err, &exit) && err.Error() != "exec: Wait was already called" {
		t.Log(err)
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	fmt.Printf("second SIGTERM: exited after %s\n", time.Since(sent).Round(time.Millisecond))
}
