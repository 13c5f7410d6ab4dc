package statedisk

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/command"
)

// TestExec: stdin and the extra files arrive through pipes (a program cannot seek or stat them as
// files), a failure carries the exit status and the last line of its error output.
func TestExec(t *testing.T) {
	var out bytes.Buffer
	err := Exec{}.Run(context.Background(), Cmd{
		Name:   "sh",
		Args:   []string{"-c", `[ -p /dev/stdin ] && [ -p /dev/fd/3 ] && [ -p /dev/fd/4 ] || exit 9; cat; printf :; cat /dev/fd/3; printf :; cat /dev/fd/4`},
		Stdin:  []byte("in"),
		Files:  [][]byte{[]byte("three"), []byte("four")},
		Stdout: &out,
	})
	if err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if out.String() != "in:three:four" {
		t.Fatalf("output = %q", out.String())
	}

	err = Exec{}.Run(context.Background(), Cmd{Name: "sh", Args: []string{"-c", "echo first >&2; echo the reason >&2; exit 2"}})
	var exitErr *command.ExitError
	if !errors.As(err, &exitErr) || exitErr.Code != 2 || exitCode(err) != 2 || !strings.Contains(err.Error(), "the reason") {
		t.Fatalf("Run(exit 2) = %v", err)
	}
	if exitCode(errors.New("other")) != -1 {
		t.Fatal("exitCode(not an exit error) != -1")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := (Exec{}).Run(ctx, Cmd{Name: "sleep", Args: []string{"10"}}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run(cancelled) = %v, want DeadlineExceeded", err)
	}
}
