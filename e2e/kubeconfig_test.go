//go:build e2e

package e2e

import (
	"context"
	"crypto/rand"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/workspace"
)

// checkKubeconfigWithMasterSecret: berth kubeconfig with the workspace's master secret gets an admin
// credential from cp1's joinservice that kubectl uses; once its minimum validity ended the API
// server refuses it, and a second berth kubeconfig gets working access again. A wrong master secret
// is refused with a clear error and writes nothing.
func checkKubeconfigWithMasterSecret(t testing.TB, c *cluster) {
	t.Helper()
	endpoint := net.JoinHostPort(nodeIP(t, c.dir, "cp1"), strconv.Itoa(joinconfig.JoinPort))
	dir := t.TempDir()
	kubeconfig := func(secret, out string, extra ...string) (string, error) {
		return c.run(2*time.Minute, c.berth, append([]string{"kubeconfig", "--endpoint", endpoint, "--workspace", c.dir,
			"--master-secret", secret, "--out", out}, extra...)...)
	}
	getNodes := func(kc string) (string, error) {
		return c.run(time.Minute, c.kubectl, "--kubeconfig", kc, "get", "nodes", "-o", "name")
	}
	secret := filepath.Join(c.dir, workspace.MasterSecret)

	short := filepath.Join(dir, "short.conf")
	start := time.Now()
	out, err := kubeconfig(secret, short, "--validity", "1m")
	if err != nil {
		t.Fatalf("berth kubeconfig --validity 1m: %v\n%s", err, out)
	}
	issued := time.Now()
	t.Logf("berth kubeconfig --validity 1m took %.1fs:\n%s", issued.Sub(start).Seconds(), out)
	if st, err := os.Stat(short); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("the kubeconfig: %v, mode %v; want 0600", err, st.Mode())
	}
	if got, err := getNodes(short); err != nil || !strings.Contains(got, "node/cp1") {
		t.Fatalf("kubectl get nodes with the new kubeconfig: %v\n%s", err, got)
	}
	// berth status names the credential it reads with and when it ends.
	if got, err := c.run(time.Minute, c.berth, "status", "--kubeconfig", short); err != nil || !strings.Contains(got, "Your credential: berth-admin, valid until") {
		t.Errorf("berth status with the new kubeconfig does not show the credential: %v\n%s", err, got)
	}
	// An existing kubeconfig is not replaced without --force.
	if out, err := kubeconfig(secret, short, "--validity", "1m"); err == nil || !strings.Contains(out, "pass --force") {
		t.Errorf("berth kubeconfig over an existing file: %v\n%s", err, out)
	}

	// Expired: polled until the API server refuses it.
	var got string
	if err := wait.PollUntilContextTimeout(context.Background(), 2*time.Second, 3*time.Minute, false, func(context.Context) (bool, error) {
		got, err = getNodes(short)
		return err != nil && strings.Contains(got, "Unauthorized"), nil
	}); err != nil {
		t.Fatalf("the 1m credential is still accepted %.0fs after it was issued: %v\n%s", time.Since(issued).Seconds(), err, got)
	}
	t.Logf("the 1m credential was refused %.1fs after it was issued: %s", time.Since(issued).Seconds(), strings.TrimSpace(got))
	// berth status says so itself, with the way back, before it connects.
	if got, err := c.run(time.Minute, c.berth, "status", "--kubeconfig", short); err == nil || !strings.Contains(got, "expired at") || !strings.Contains(got, "berth kubeconfig --endpoint") {
		t.Errorf("berth status with the expired kubeconfig: %v, want the expiry and berth kubeconfig named\n%s", err, got)
	}

	// With the master secret again: working access.
	start = time.Now()
	if out, err := kubeconfig(secret, short, "--force"); err != nil {
		t.Fatalf("berth kubeconfig --force after expiry: %v\n%s", err, out)
	}
	if got, err := getNodes(short); err != nil || !strings.Contains(got, "node/cp1") {
		t.Fatalf("kubectl get nodes with the renewed kubeconfig: %v\n%s", err, got)
	}
	t.Logf("renewed access after expiry in %.1fs", time.Since(start).Seconds())

	// A wrong master secret: refused, nothing written.
	master, salt := make([]byte, 32), make([]byte, 32)
	_, _ = rand.Read(master)
	_, _ = rand.Read(salt)
	wrong := filepath.Join(dir, "wrong-master-secret.json")
	if err := os.WriteFile(wrong, workspace.EncodeSecret(master, salt), 0o600); err != nil {
		t.Fatal(err)
	}
	refused := filepath.Join(dir, "refused.conf")
	out, err = kubeconfig(wrong, refused)
	code := -1
	if ee, ok := err.(interface{ ExitCode() int }); ok {
		code = ee.ExitCode()
	}
	if code != 3 || !strings.Contains(out, "the master secret does not match this cluster") {
		t.Errorf("berth kubeconfig with a wrong master secret: exit %d, want 3 and the named error\n%s", code, out)
	}
	if _, err := os.Stat(refused); err == nil {
		t.Error("a wrong master secret wrote a kubeconfig")
	}
	t.Logf("a wrong master secret: exit %d: %s", code, strings.TrimSpace(out))

	// The issued credentials are in the join ledger (written in batches).
	var n int
	if err := wait.PollUntilContextTimeout(context.Background(), 2*time.Second, time.Minute, true, func(context.Context) (bool, error) {
		ledger := c.kube("-n", joinconfig.Namespace, "get", "configmap", joinconfig.JoinLedgerName, "-o", "jsonpath={.data}")
		n = strings.Count(ledger, `\"rpc\":\"`+joinledger.RPCAdminCredential+`\"`) + strings.Count(ledger, `"rpc":"`+joinledger.RPCAdminCredential+`"`)
		return n >= 2, nil
	}); err != nil {
		t.Errorf("the join ledger records %d admin credentials, want at least 2", n)
	}
}
