package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"k8s.io/klog/v2"
)

// TestDiagnosticsLogger checks that --log-level and --log-format build the logger that client-go's
// klog lines go through, on the command's stderr, and that a bad value is a usage error.
func TestDiagnosticsLogger(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"status", "--log-level=loud"}, &out, &errOut); code != exitUsage {
		t.Fatalf("--log-level=loud: exit %d, want %d; stderr %q", code, exitUsage, errOut.String())
	}
	if !strings.Contains(errOut.String(), "unknown log level") {
		t.Fatalf("--log-level=loud: stderr %q", errOut.String())
	}

	errOut.Reset()
	// berth policy check of a missing file fails after the logger is built.
	code := Execute(context.Background(), []string{"policy", "check", "--log-format=json", "--log-level=warn", "--policy", t.TempDir() + "/none.yaml", "--evidence", t.TempDir() + "/none.json"}, &out, &errOut)
	if code == exitOK {
		t.Fatal("policy check of a missing file succeeded")
	}
	errOut.Reset()
	klog.Info("below warn")
	klog.Error("client-go failed")
	klog.Flush()
	lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
	var l struct{ Level, Logger, Msg string }
	if len(lines) != 1 || json.Unmarshal([]byte(lines[0]), &l) != nil || l.Level != "error" || l.Logger != "klog" || l.Msg != "client-go failed" {
		t.Fatalf("klog through --log-format=json --log-level=warn: %q", errOut.String())
	}
}
