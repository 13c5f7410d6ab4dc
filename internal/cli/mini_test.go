package cli

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func TestMiniNeedsRoot(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 1000 }
	defer func() { geteuid = orig }()
	for _, sub := range []string{"up", "down", "restart"} {
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), []string{"mini", sub, "--dir", t.TempDir()}, &out, &errOut)
		if code != exitUsage || !strings.Contains(errOut.String(), "berth mini needs root") {
			t.Errorf("mini %s as non-root: code %d, stderr %q", sub, code, errOut.String())
		}
	}
}

func TestMiniHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := Execute(context.Background(), []string{"mini", "up", "--help"}, &out, &errOut); code != exitOK {
		t.Fatalf("help exit code %d: %s", code, errOut.String())
	}
	for _, want := range []string{"--workers", "--control-planes", "--tampered-workers", "--no-bootstrap", "--attestation", "berth mini down"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("mini up --help lacks %q", want)
		}
	}
}

func TestMiniUpRejectsBadFlags(t *testing.T) {
	orig := geteuid
	geteuid = func() int { return 0 }
	defer func() { geteuid = orig }()
	for _, args := range [][]string{
		{"--subnet", "not-a-prefix"},
		{"--name", "Bad-Name"},
		{"--attestation", "magic", "--no-bootstrap"},
		{"--workers", "-1"},
	} {
		var out, errOut bytes.Buffer
		code := Execute(context.Background(), append([]string{"mini", "up", "--dir", t.TempDir()}, args...), &out, &errOut)
		if code != exitUsage {
			t.Errorf("mini up %v: code %d (stderr %q), want usage error", args, code, errOut.String())
		}
	}
}
