// Package health answers the joinservice's probes, on its metrics port:
//
//   - /livez is 200 while every loop the joinservice started is still running (the gRPC server, the
//     join ledger's writer, the policy watcher, the attestation self-check). A loop that ended while
//     the service is not stopping fails it, so the kubelet restarts a process that lives on with a
//     part of it dead (a policy watcher that gave up, for one). Before the loops start (the
//     joinservice waiting for the cluster secrets right after init) it is 200: nothing has died.
//   - /readyz is 200 only when every readiness condition holds: the joinservice has read and decoded
//     the cluster secrets, read the join configuration and built its attestation policy, loaded the
//     cluster CA, its policy watcher has synced with the join ConfigMap, its attestation issuer made
//     a document in its last self-check, and its gRPC server is serving joins. It fails at once when
//     the service starts stopping.
//
// Both answer 503 with one line per check ("[-]name: reason") when they fail, and list the checks
// with ?verbose. Reasons are the joinservice's own error text, never a secret.
package health

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"unicode"
)

// Probes holds the state behind /livez and /readyz. It is safe for concurrent use.
type Probes struct {
	mu         sync.Mutex
	conditions []string
	failing    map[string]string // condition -> why it does not hold
	loops      map[string]bool   // loop -> running
	ended      map[string]string // loop -> why it ended
	stopping   bool
}

// New returns Probes with the readiness conditions, all not holding yet ("not checked yet").
func New(conditions ...string) *Probes {
	p := &Probes{conditions: slices.Clone(conditions), failing: map[string]string{}, loops: map[string]bool{}, ended: map[string]string{}}
	for _, c := range conditions {
		p.failing[c] = "not checked yet"
	}
	return p
}

// Set records whether condition holds: err nil means it does, else err says why not. An unknown
// condition is added.
func (p *Probes) Set(condition string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !slices.Contains(p.conditions, condition) {
		p.conditions = append(p.conditions, condition)
	}
	if err == nil {
		delete(p.failing, condition)
		return
	}
	p.failing[condition] = printable(err.Error())
}

// printable keeps a reason on its line: control characters (from an API server's error text, say)
// become spaces.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}

// Started records that loop runs. Its returned func records that it ended, with err saying why (nil
// for a loop that returned without an error).
func (p *Probes) Started(loop string) (ended func(err error)) {
	p.mu.Lock()
	p.loops[loop] = true
	delete(p.ended, loop)
	p.mu.Unlock()
	return func(err error) {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.loops[loop] = false
		if err == nil {
			p.ended[loop] = "ended"
		} else {
			p.ended[loop] = "ended: " + printable(err.Error())
		}
	}
}

// Stopping records that the service is shutting down: readiness fails from now on, and loops ending
// no longer fail liveness.
func (p *Probes) Stopping() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopping = true
}

// Live returns nil while every started loop runs (or the service is stopping), else why not.
func (p *Probes) Live() error {
	lines, ok := p.live()
	if ok {
		return nil
	}
	return fmt.Errorf("not live: %s", strings.Join(failed(lines), "; "))
}

// Ready returns nil when every condition holds and the service is not stopping, else why not.
func (p *Probes) Ready() error {
	lines, ok := p.ready()
	if ok {
		return nil
	}
	return fmt.Errorf("not ready: %s", strings.Join(failed(lines), "; "))
}

type line struct {
	name, problem string
}

func failed(lines []line) []string {
	var out []string
	for _, l := range lines {
		if l.problem != "" {
			out = append(out, l.name+": "+l.problem)
		}
	}
	return out
}

func (p *Probes) live() ([]line, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var lines []line
	ok := true
	for _, name := range sortedKeys(p.loops) {
		l := line{name: "loop " + name}
		if !p.loops[name] && !p.stopping {
			l.problem, ok = p.ended[name], false
		}
		lines = append(lines, l)
	}
	return lines, ok
}

func (p *Probes) ready() ([]line, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	lines := []line{{name: "not stopping"}}
	ok := !p.stopping
	if p.stopping {
		lines[0].problem = "the joinservice is stopping"
	}
	for _, c := range p.conditions {
		l := line{name: c, problem: p.failing[c]}
		if l.problem != "" {
			ok = false
		}
		lines = append(lines, l)
	}
	return lines, ok
}

func sortedKeys(m map[string]bool) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// ServeHTTP answers /livez and /readyz (and 404 for anything else).
func (p *Probes) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var lines []line
	var ok bool
	switch r.URL.Path {
	case "/livez":
		lines, ok = p.live()
	case "/readyz":
		lines, ok = p.ready()
	default:
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	_, verbose := r.URL.Query()["verbose"]
	var b strings.Builder
	for _, l := range lines {
		switch {
		case l.problem != "":
			fmt.Fprintf(&b, "[-]%s: %s\n", l.name, l.problem)
		case verbose:
			fmt.Fprintf(&b, "[+]%s ok\n", l.name)
		}
	}
	if !ok {
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(b.String() + strings.TrimPrefix(r.URL.Path, "/") + " check failed\n"))
		return
	}
	_, _ = w.Write([]byte(b.String() + "ok\n"))
}
