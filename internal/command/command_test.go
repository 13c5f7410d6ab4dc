package command

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"
)

func TestRunner(t *testing.T) {
	var out bytes.Buffer
	if err := (Runner{}).Run(context.Background(), &out, "sh", "-c", "echo hi; echo err >&2"); err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if out.String() != "hi\nerr\n" {
		t.Errorf("output = %q", out.String())
	}
	err := (Runner{}).Run(context.Background(), nil, "sh", "-c", "exit 3")
	var exitErr *ExitError
	if !errors.As(err, &exitErr) || exitErr.Code != 3 {
		t.Fatalf("Run(exit 3) = %v, want ExitError code 3", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := (Runner{}).Run(ctx, nil, "sleep", "10"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run(cancelled) = %v, want DeadlineExceeded", err)
	}
}
