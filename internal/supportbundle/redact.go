package supportbundle

import "regexp"

// redaction is one kind of value that never leaves the cluster in a bundle.
type redaction struct {
	name string
	re   *regexp.Regexp
	with string
}

// redactions are applied to every log and object, in order. Berth writes none of these into logs
// or ConfigMaps on purpose; the patterns catch what other components, or a bug, might.
var redactions = []redaction{
	{"private key", regexp.MustCompile(`(?s)-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?-----END [A-Z0-9 ]*PRIVATE KEY-----`), "[REDACTED PRIVATE KEY]"},
	{"JSON web token", regexp.MustCompile(`eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}`), "[REDACTED TOKEN]"},
	{"bearer token", regexp.MustCompile(`(?i)(bearer\s+)[A-Za-z0-9._~+/-]{8,}=*`), "${1}[REDACTED]"},
	// Not inside a longer name: an Event's name is its object's name, a dot and 16 hex digits
	// ("berth-join-ledger.187b2c3d4e5f6a7b"), which a bare word boundary would take for a token.
	{"bootstrap token", regexp.MustCompile(`(^|[^A-Za-z0-9._-])[a-z0-9]{6}\.[a-z0-9]{16}($|[^A-Za-z0-9._-])`), "${1}[REDACTED BOOTSTRAP TOKEN]${2}"},
	{"secret value", regexp.MustCompile(`(?i)("?\b(?:token|password|passwd|secret|private[-_]?key|master[-_]?secret|certificate[-_]?key|salt|kek)"?\s*[:=]\s*"?)[^\s",}\[][^\s",}]{3,}`), "${1}[REDACTED]"},
}

// redact returns b with every match of redactions replaced, and adds how many were replaced per
// kind to counts.
func redact(b []byte, counts map[string]int) []byte {
	for _, r := range redactions {
		n := 0
		b = r.re.ReplaceAllFunc(b, func(m []byte) []byte {
			n++
			return r.re.Expand(nil, []byte(r.with), m, r.re.FindSubmatchIndex(m))
		})
		if n > 0 {
			counts[r.name] += n
		}
	}
	return b
}
