// Package commandtest provides a recording fake of a command runner for unit tests.
package commandtest

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
)

// Result is what a scripted call does.
type Result struct {
	// Output is written to the caller's writer.
	Output string
	// Err is returned.
	Err error
}

// Recorder records every call and answers from a script.
type Recorder struct {
	mu    sync.Mutex
	calls []string
	// Script maps a call's "name arg..." prefix to the results of its successive calls; the last
	// result repeats. Calls that match nothing succeed with no output.
	Script map[string][]Result
	used   map[string]int
	// Hook, if set, runs for every call before the script is consulted (e.g. to create files).
	Hook func(argv []string) error
}

// Run records the call and answers from the script.
func (r *Recorder) Run(_ context.Context, out io.Writer, name string, args ...string) error {
	argv := append([]string{name}, args...)
	line := strings.Join(argv, " ")
	r.mu.Lock()
	r.calls = append(r.calls, line)
	hook := r.Hook
	var res Result
	if r.used == nil {
		r.used = map[string]int{}
	}
	for prefix, results := range r.Script {
		if strings.HasPrefix(line, prefix) && len(results) > 0 {
			i := min(r.used[prefix], len(results)-1)
			r.used[prefix]++
			res = results[i]
			break
		}
	}
	r.mu.Unlock()
	if hook != nil {
		if err := hook(argv); err != nil {
			return err
		}
	}
	if out != nil && res.Output != "" {
		_, _ = fmt.Fprint(out, res.Output)
	}
	return res.Err
}

// Calls returns every recorded call as "name arg ...".
func (r *Recorder) Calls() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.calls...)
}

// String renders the recorded calls one per line, for comparison with an expected transcript.
func (r *Recorder) String() string { return strings.Join(r.Calls(), "\n") }
