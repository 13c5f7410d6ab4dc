package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/reasons"
)

func runExplain(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newExplainCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

func TestExplain(t *testing.T) {
	out, err := runExplain(t, "REVOKED")
	if err != nil || !strings.Contains(out, "berth node readmit") || !strings.HasPrefix(out, "REVOKED\n") {
		t.Fatalf("explain REVOKED = %v\n%s", err, out)
	}
	out, err = runExplain(t)
	if err != nil || strings.Count(out, "\n") != len(reasons.All())+1 {
		t.Fatalf("explain lists %d lines, want %d: %v\n%s", strings.Count(out, "\n"), len(reasons.All())+1, err, out)
	}
	out, err = runExplain(t, "MEASUREMENT_MISMATCH", "-o", "json")
	var e reasonEntry
	if err != nil || json.Unmarshal([]byte(out), &e) != nil || e.Code != "MEASUREMENT_MISMATCH" || e.Next == "" {
		t.Fatalf("explain -o json = %v\n%s", err, out)
	}
	// An unknown code is a usage error; what the operator typed is escaped in the message.
	_, err = runExplain(t, "NO_SUCH\x1b[31m")
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != exitUsage || strings.Contains(err.Error(), "\x1b") {
		t.Fatalf("explain of an unknown code = %v", err)
	}
}
