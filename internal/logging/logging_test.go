package logging

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/spf13/pflag"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc/grpclog"
	"k8s.io/klog/v2"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// line is one JSON log line.
type line struct {
	Level  string `json:"level"`
	Msg    string `json:"msg"`
	Logger string `json:"logger"`
	Caller string `json:"caller"`
	Time   string `json:"time"`
	K      string `json:"k"`
}

func parse(t *testing.T, out string) []line {
	t.Helper()
	var lines []line
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if l == "" {
			continue
		}
		var v line
		if err := json.Unmarshal([]byte(l), &v); err != nil {
			t.Fatalf("not a JSON line: %q: %v", l, err)
		}
		lines = append(lines, v)
	}
	return lines
}

func logEveryLevel(log *zap.Logger) {
	log.Debug("debug line")
	log.Info("info line")
	log.Warn("warn line")
	log.Error("error line")
}

func TestLevel(t *testing.T) {
	for _, tc := range []struct {
		level string
		want  []string
	}{
		{"debug", []string{"debug line", "info line", "warn line", "error line"}},
		{"info", []string{"info line", "warn line", "error line"}},
		{"warn", []string{"warn line", "error line"}},
		{"error", []string{"error line"}},
	} {
		t.Run(tc.level, func(t *testing.T) {
			var buf bytes.Buffer
			log, err := build(Config{Level: tc.level, Format: FormatJSON}, &buf, "")
			if err != nil {
				t.Fatal(err)
			}
			logEveryLevel(log)
			var got []string
			for _, l := range parse(t, buf.String()) {
				got = append(got, l.Msg)
				if want := strings.TrimSuffix(l.Msg, " line"); l.Level != want {
					t.Errorf("%q logged at level %q", l.Msg, l.Level)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("--log-level=%s wrote %q, want %q", tc.level, got, tc.want)
			}
		})
	}
}

func TestBadConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want error
	}{
		{Config{Level: "verbose", Format: FormatJSON}, ErrLevel},
		{Config{Level: "", Format: FormatJSON}, ErrLevel},
		{Config{Level: "info", Format: "logfmt"}, ErrFormat},
	} {
		_, err := build(tc.cfg, &bytes.Buffer{}, "")
		if !errors.Is(err, tc.want) {
			t.Errorf("%+v: error %v, want %v", tc.cfg, err, tc.want)
		}
		if err := tc.cfg.Validate(); !errors.Is(err, tc.want) {
			t.Errorf("%+v: Validate() = %v, want %v", tc.cfg, err, tc.want)
		}
	}
	if err := Defaults().Validate(); err != nil {
		t.Fatalf("the defaults do not validate: %v", err)
	}
	// The flag's value is quoted: a control character cannot forge a line.
	err := Config{Level: "x\nERROR forged", Format: FormatJSON}.Validate()
	if err == nil || strings.Contains(err.Error(), "\n") {
		t.Fatalf("error %q holds a raw newline", err)
	}
}

func TestFlags(t *testing.T) {
	c := Defaults()
	f := pflag.NewFlagSet("x", pflag.ContinueOnError)
	c.AddFlags(f)
	if err := f.Parse([]string{"--log-level=debug", "--log-format=console"}); err != nil {
		t.Fatal(err)
	}
	if c.Level != "debug" || c.Format != FormatConsole {
		t.Fatalf("after the flags: %+v", c)
	}
	d := Defaults()
	g := pflag.NewFlagSet("y", pflag.ContinueOnError)
	d.AddFlags(g)
	if err := g.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if d != Defaults() {
		t.Fatalf("without flags: %+v, want the defaults", d)
	}
}

func TestFormat(t *testing.T) {
	var js, console bytes.Buffer
	jl, err := build(Config{Level: "info", Format: FormatJSON}, &js, "")
	if err != nil {
		t.Fatal(err)
	}
	jl.Info("hello", zap.String("k", "v\"\n"))
	l := parse(t, js.String())
	if len(l) != 1 || l[0].Msg != "hello" || l[0].Level != "info" || l[0].K != "v\"\n" || l[0].Time == "" ||
		!strings.HasPrefix(l[0].Caller, "logging/logging_test.go:") {
		t.Fatalf("JSON line %q parsed as %+v", js.String(), l)
	}

	cl, err := build(Config{Level: "info", Format: FormatConsole}, &console, "")
	if err != nil {
		t.Fatal(err)
	}
	cl.Info("hello", zap.String("k", "v"))
	out := console.String()
	if json.Valid([]byte(out)) || !strings.Contains(out, "\tINFO\t") || !strings.Contains(out, "\thello\t") || !strings.Contains(out, `{"k": "v"}`) {
		t.Fatalf("console line %q", out)
	}
}

// journalFile is a file standing in for the journal's stream, and its JOURNAL_STREAM value.
func journalFile(t *testing.T) (*os.File, string) {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	return f, fmt.Sprintf("%d:%d", st.Dev, st.Ino)
}

func readAll(t *testing.T, f *os.File) string {
	t.Helper()
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestJournalPrefixes(t *testing.T) {
	f, stream := journalFile(t)
	t.Setenv(JournalStreamEnv, stream)
	log, err := New(Config{Level: "debug", Format: FormatJSON}, f)
	if err != nil {
		t.Fatal(err)
	}
	logEveryLevel(log)
	lines := strings.Split(strings.TrimSpace(readAll(t, f)), "\n")
	want := []string{"<7>", "<6>", "<4>", "<3>"}
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d: %q", len(lines), len(want), lines)
	}
	for i, l := range lines {
		rest, ok := strings.CutPrefix(l, want[i])
		if !ok || !json.Valid([]byte(rest)) {
			t.Errorf("line %d = %q, want the prefix %s before a JSON object", i, l, want[i])
		}
	}

	// Console lines get the prefix too.
	c, cstream := journalFile(t)
	clog, err := build(Config{Level: "info", Format: FormatConsole}, c, cstream)
	if err != nil {
		t.Fatal(err)
	}
	clog.Warn("careful")
	if out := readAll(t, c); !strings.HasPrefix(out, "<4>") || !strings.Contains(out, "\tWARN\t") {
		t.Fatalf("console line under the journal: %q", out)
	}
}

func TestNoJournalPrefixes(t *testing.T) {
	_, otherStream := journalFile(t)
	for name, stream := range map[string]func(own string) string{
		"unset":                      func(string) string { return "" },
		"another file's stream":      func(string) string { return otherStream },
		"same device, another inode": func(own string) string { return own + "0" },
		"malformed":                  func(string) string { return "journal" },
		"not numbers":                func(string) string { return "a:b" },
	} {
		t.Run(name, func(t *testing.T) {
			f, own := journalFile(t)
			log, err := build(Config{Level: "info", Format: FormatJSON}, f, stream(own))
			if err != nil {
				t.Fatal(err)
			}
			log.Info("plain")
			out := readAll(t, f)
			if strings.HasPrefix(out, "<") || !json.Valid([]byte(strings.TrimSpace(out))) {
				t.Fatalf("JOURNAL_STREAM=%q: %q, want a plain JSON line", stream(own), out)
			}
		})
	}
	// A writer that is no file is never the journal.
	_, stream := journalFile(t)
	var buf bytes.Buffer
	log, err := build(Config{Level: "info", Format: FormatJSON}, &buf, stream)
	if err != nil {
		t.Fatal(err)
	}
	log.Info("plain")
	if strings.HasPrefix(buf.String(), "<") {
		t.Fatalf("a buffer got a journal prefix: %q", buf.String())
	}
}

func TestSample(t *testing.T) {
	count := func(sample bool) int {
		var buf bytes.Buffer
		log, err := build(Config{Level: "info", Format: FormatJSON, Sample: sample}, &buf, "")
		if err != nil {
			t.Fatal(err)
		}
		for range 1000 {
			log.Info("flood")
		}
		return strings.Count(buf.String(), "\n")
	}
	// 1000 lines within one second: 100, then every 100th of the 900 others.
	if got := count(true); got < sampleFirst || got > sampleFirst+1000/sampleThereafter {
		t.Errorf("sampled: %d of 1000 lines written", got)
	}
	if got := count(false); got != 1000 {
		t.Errorf("unsampled: %d of 1000 lines written", got)
	}
}

// TestLibrariesThroughZap checks that klog (client-go's logger) and grpclog (gRPC's) write through
// the logger of the last New, in its format, with their own callers.
func TestLibrariesThroughZap(t *testing.T) {
	var first, buf bytes.Buffer
	if _, err := New(Config{Level: "info", Format: FormatJSON}, &first); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{Level: "debug", Format: FormatJSON}, &buf); err != nil {
		t.Fatal(err)
	}
	klog.InfoS("klog structured", "k", "v")
	klog.Errorf("klog error %d", 7)
	klog.V(1).Info("klog verbose") // klog's -v is 0
	grpclog.Info("grpc info")
	grpclog.Errorf("grpc error %d", 8)
	grpclog.Component("core").Warning("grpc component warning")
	klog.Flush()

	want := []line{
		{Logger: "klog", Level: "info", Msg: "klog structured", K: "v"},
		{Logger: "klog", Level: "error", Msg: "klog error 7"},
		{Logger: "grpc", Level: "debug", Msg: "grpc info"},
		{Logger: "grpc", Level: "error", Msg: "grpc error 8"},
		{Logger: "grpc", Level: "debug", Msg: "[core] grpc component warning"},
	}
	got := parse(t, buf.String())
	if len(got) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(got), len(want), buf.String())
	}
	for i, w := range want {
		g := got[i]
		if g.Logger != w.Logger || g.Level != w.Level || g.Msg != w.Msg || g.K != w.K {
			t.Errorf("line %d = %+v, want %+v", i, g, w)
		}
		if !strings.HasPrefix(g.Caller, "logging/logging_test.go:") {
			t.Errorf("line %d (%q) has caller %q, want this test", i, g.Msg, g.Caller)
		}
	}
	if first.Len() != 0 {
		t.Errorf("the replaced logger still got lines: %q", first.String())
	}

	// At info level gRPC's info and warning lines are left out, and so are its verbose checks.
	buf.Reset()
	if _, err := New(Config{Level: "info", Format: FormatJSON}, &buf); err != nil {
		t.Fatal(err)
	}
	grpclog.Info("grpc info")
	grpclog.Warning("grpc warning")
	if grpclog.V(0) {
		t.Error("grpclog.V(0) at info level")
	}
	// ... and not even formatted (gRPC logs every failed handshake at info, through a component's
	// InfoDepth; a component's *f methods format before they reach the forwarder).
	var formatted countingStringer
	grpclog.Info(&formatted)
	grpclog.Component("core").Info(&formatted)
	grpclog.InfoDepth(0, &formatted)
	if formatted != 0 {
		t.Errorf("gRPC lines left out were formatted %d times", formatted)
	}
	klog.Info("klog info")
	got = parse(t, buf.String())
	if len(got) != 1 || got[0].Msg != "klog info" {
		t.Fatalf("at info level: %q", buf.String())
	}
}

// countingStringer counts how often it is formatted.
type countingStringer int

func (c *countingStringer) String() string { *c++; return "formatted" }

// TestBeforeNew checks that klog and grpclog lines are JSON on stderr before any New (in a child
// process: this one has called New).
func TestBeforeNew(t *testing.T) {
	if os.Getenv("BERTH_LOGGING_CHILD") == "1" {
		klog.Info("klog before New")
		grpclog.Error("grpc before New")
		grpclog.Info("grpc info before New") // debug: left out
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBeforeNew$", "-test.count=1")
	cmd.Env = append(os.Environ(), "BERTH_LOGGING_CHILD=1", JournalStreamEnv+"=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("child: %v: %s", err, stderr.String())
	}
	got := parse(t, stderr.String())
	if len(got) != 2 || got[0].Logger != "klog" || got[0].Msg != "klog before New" || got[1].Logger != "grpc" || got[1].Level != "error" {
		t.Fatalf("stderr before New: %q", stderr.String())
	}
}
