// Command testapp is the workload of Berth's mini cluster e2e tests. Without arguments (or with
// "serve") it logs one line and answers HTTP on :8080 with its host name; "hello" prints a greeting
// and exits; "echo ARGS" prints ARGS; "get URL" prints the body of an HTTP GET and fails on a non-200
// answer, so a test can probe Services and DNS from inside a pod.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	args := os.Args[1:]
	cmd := "serve"
	if len(args) > 0 {
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "serve":
		err = serve()
	case "hello":
		fmt.Printf("hello from container, pid %d\n", os.Getpid())
	case "echo":
		fmt.Println(strings.Join(args, " "))
	case "get":
		err = get(args)
	default:
		err = fmt.Errorf("unknown command %q (want serve, hello, echo or get)", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "testapp:", err)
		os.Exit(1)
	}
}

func serve() error {
	host, err := os.Hostname()
	if err != nil {
		return fmt.Errorf("reading host name: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "testapp on %s\n", host)
	})
	srv := &http.Server{Addr: ":8080", Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	fmt.Printf("testapp serving on :8080 as %s\n", host)
	select {
	case err := <-errc:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutting down: %w", err)
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving: %w", err)
	}
	return nil
}

func get(args []string) error {
	if len(args) != 1 {
		return errors.New("get needs exactly one URL")
	}
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(args[0])
	if err != nil {
		return fmt.Errorf("getting %s: %w", args[0], err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("reading body: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("getting %s: status %d", args[0], resp.StatusCode)
	}
	_, err = os.Stdout.Write(body)
	return err
}
