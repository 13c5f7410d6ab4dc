//go:build e2e

package e2e

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// failureLog is the testing.TB of an e2e test: it keeps every failure's message and repeats them
// all when the test ends. A failed cluster test logs a long diagnosis (daemon logs, events, routes)
// after its failures; a CI log cut to the lines around "--- FAIL" then still shows what failed.
type failureLog struct {
	*testing.T
	all *failures // shared with the subtests
}

type failures struct {
	mu   sync.Mutex
	msgs []string
}

// recordFailures wraps t; its summary runs after every other cleanup and deferred call of the test,
// and after its subtests.
func recordFailures(t *testing.T) *failureLog {
	f := &failureLog{T: t, all: &failures{}}
	t.Cleanup(f.repeat)
	return f
}

// Run runs fn as a subtest whose failures the summary of the top-level test repeats too.
func (f *failureLog) Run(name string, fn func(t *failureLog)) bool {
	f.Helper()
	return f.T.Run(name, func(st *testing.T) { fn(&failureLog{T: st, all: f.all}) })
}

// maxRepeated bounds what the summary repeats of one message; the full text is above it.
const maxRepeated = 600

func (f *failureLog) keep(msg string) {
	where := "?"
	// The caller of Errorf/Fatalf (skip the wrapper and keep), which may be a helper; its line is
	// enough to find the full message above.
	if _, file, line, ok := runtime.Caller(2); ok {
		where = fmt.Sprintf("%s:%d", file[strings.LastIndexByte(file, '/')+1:], line)
	}
	if len(msg) > maxRepeated {
		msg = msg[:maxRepeated] + " …"
	}
	f.all.mu.Lock()
	f.all.msgs = append(f.all.msgs, f.Name()+" "+where+": "+msg)
	f.all.mu.Unlock()
}

func (f *failureLog) Errorf(format string, args ...any) {
	f.Helper()
	f.keep(fmt.Sprintf(format, args...))
	f.T.Errorf(format, args...)
}

func (f *failureLog) Error(args ...any) {
	f.Helper()
	f.keep(fmt.Sprint(args...))
	f.T.Error(args...)
}

func (f *failureLog) Fatalf(format string, args ...any) {
	f.Helper()
	f.keep(fmt.Sprintf(format, args...))
	f.T.Fatalf(format, args...)
}

func (f *failureLog) Fatal(args ...any) {
	f.Helper()
	f.keep(fmt.Sprint(args...))
	f.T.Fatal(args...)
}

func (f *failureLog) repeat() {
	f.all.mu.Lock()
	defer f.all.mu.Unlock()
	if len(f.all.msgs) == 0 {
		return
	}
	f.Logf("%s failed (%d failure(s), repeated from above, before the diagnosis):\n%s",
		f.Name(), len(f.all.msgs), strings.Join(f.all.msgs, "\n"))
}
