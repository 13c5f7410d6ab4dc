// Command berth is the operator's CLI: it initializes clusters, verifies nodes and runs local mini clusters.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/berth-k8s/berth/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Execute(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
