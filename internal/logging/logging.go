// Package logging builds the zap logger of every Berth binary from two flags, --log-level (debug,
// info, warn, error) and --log-format (json, the default, or console), and makes it the sink of
// klog (client-go) and grpclog (gRPC), so that every line a binary writes has one format.
//
// When stderr is the systemd journal's stream (JOURNAL_STREAM names stderr's device and inode, as
// systemd sets it for a unit with StandardError=journal), every line starts with its sd-daemon
// priority prefix: <7> debug, <6> info, <4> warn, <3> error, <2> panic and fatal. journald then
// files the line under that priority (journalctl -p warning shows warnings and worse).
//
// klog lines come out under the name "klog" at klog's own verbosity (its -v stays 0: V(0) lines
// and errors). gRPC's info and warning lines are debug lines here, its errors errors, under the
// name "grpc": gRPC itself prints only errors unless told otherwise, and a peer can make it warn.
//
// Importing the package routes klog and grpclog through it, to stderr as with Defaults() until the
// first New: their SetLogger calls are not safe once anything logs, so they happen only at
// initialization.
package logging

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"go.uber.org/zap"
	"go.uber.org/zap/buffer"
	"go.uber.org/zap/zapcore"
)

// Flag names, the same in every binary.
const (
	LevelFlag  = "log-level"
	FormatFlag = "log-format"
)

// Formats.
const (
	FormatJSON    = "json"
	FormatConsole = "console"
)

// JournalStreamEnv is the variable systemd sets to "<device>:<inode>" of the journal stream it
// connected to the unit's stdout or stderr.
const JournalStreamEnv = "JOURNAL_STREAM"

var (
	// ErrLevel means --log-level names no level of this package.
	ErrLevel = errors.New("unknown log level: want debug, info, warn or error")
	// ErrFormat means --log-format names no format of this package.
	ErrFormat = errors.New("unknown log format: want json or console")
)

// Sampling of a Config with Sample set: per message and second, the first sampleFirst lines, then
// every sampleThereafter-th.
const (
	sampleTick       = time.Second
	sampleFirst      = 100
	sampleThereafter = 100
)

var levels = map[string]zapcore.Level{
	"debug": zapcore.DebugLevel,
	"info":  zapcore.InfoLevel,
	"warn":  zapcore.WarnLevel,
	"error": zapcore.ErrorLevel,
}

// Config is how a binary logs.
type Config struct {
	// Level is debug, info, warn or error.
	Level string
	// Format is json or console.
	Format string
	// Sample thins out a flood of one message (the first 100 a second, then every 100th): for a
	// daemon whose peers can make it log. Not a flag.
	Sample bool
}

// Defaults is info level in JSON, unsampled.
func Defaults() Config { return Config{Level: "info", Format: FormatJSON} }

// AddFlags registers --log-level and --log-format on f, with c's values as defaults.
func (c *Config) AddFlags(f *pflag.FlagSet) {
	f.StringVar(&c.Level, LevelFlag, c.Level, "log level: debug, info, warn or error")
	f.StringVar(&c.Format, FormatFlag, c.Format, "log format: json (one object a line) or console (human-readable)")
}

// AddGoFlags is AddFlags for a binary that parses its flags with the standard library.
func (c *Config) AddGoFlags(f *flag.FlagSet) {
	f.StringVar(&c.Level, LevelFlag, c.Level, "log level: debug, info, warn or error")
	f.StringVar(&c.Format, FormatFlag, c.Format, "log format: json (one object a line) or console (human-readable)")
}

// Validate returns ErrLevel or ErrFormat (wrapped, naming the flag) for a value this package does
// not know.
func (c Config) Validate() error {
	var errs []error
	if _, ok := levels[c.Level]; !ok {
		errs = append(errs, fmt.Errorf("--%s %q: %w", LevelFlag, c.Level, ErrLevel))
	}
	if c.Format != FormatJSON && c.Format != FormatConsole {
		errs = append(errs, fmt.Errorf("--%s %q: %w", FormatFlag, c.Format, ErrFormat))
	}
	return errors.Join(errs...)
}

// New builds the logger that writes to w (a daemon's os.Stderr) and makes it the sink of klog and
// grpclog from now on (a later New takes over). Lines carry
// priority prefixes when w is the journal's stream (JOURNAL_STREAM). The caller syncs the logger
// before it exits.
func New(c Config, w io.Writer) (*zap.Logger, error) {
	log, err := build(c, w, os.Getenv(JournalStreamEnv))
	if err != nil {
		return nil, err
	}
	route(log)
	return log, nil
}

// build is New without the routing, with JOURNAL_STREAM's value given.
func build(c Config, w io.Writer, journalStream string) (*zap.Logger, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	encCfg := zap.NewProductionEncoderConfig()
	encCfg.TimeKey = "time"
	encCfg.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	if c.Format == FormatConsole {
		encCfg.EncodeLevel = zapcore.CapitalLevelEncoder
		enc = zapcore.NewConsoleEncoder(encCfg)
	} else {
		enc = zapcore.NewJSONEncoder(encCfg)
	}
	if isJournal(w, journalStream) {
		enc = journalEncoder{enc}
	}
	sink := zapcore.Lock(zapcore.AddSync(w))
	core := zapcore.NewCore(enc, sink, levels[c.Level])
	if c.Sample {
		core = zapcore.NewSamplerWithOptions(core, sampleTick, sampleFirst, sampleThereafter)
	}
	return zap.New(core, zap.AddCaller(), zap.AddStacktrace(zapcore.DPanicLevel), zap.ErrorOutput(sink)), nil
}

// isJournal says whether w is the file JOURNAL_STREAM (device:inode) names.
func isJournal(w io.Writer, journalStream string) bool {
	f, ok := w.(*os.File)
	if !ok || journalStream == "" {
		return false
	}
	devText, inoText, ok := strings.Cut(journalStream, ":")
	if !ok {
		return false
	}
	dev, errDev := strconv.ParseUint(devText, 10, 64)
	ino, errIno := strconv.ParseUint(inoText, 10, 64)
	if errDev != nil || errIno != nil {
		return false
	}
	fi, err := f.Stat()
	if err != nil {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	// Dev and Ino differ in type between architectures.
	return ok && uint64(st.Dev) == dev && uint64(st.Ino) == ino
}

// priority is the sd-daemon prefix of a level (sd-daemon.h: SD_CRIT 2, SD_ERR 3, SD_WARNING 4,
// SD_INFO 6, SD_DEBUG 7).
func priority(l zapcore.Level) string {
	switch {
	case l <= zapcore.DebugLevel:
		return "<7>"
	case l == zapcore.InfoLevel:
		return "<6>"
	case l == zapcore.WarnLevel:
		return "<4>"
	case l == zapcore.ErrorLevel:
		return "<3>"
	default:
		return "<2>"
	}
}

var prefixed = buffer.NewPool()

// journalEncoder puts the entry's priority prefix before each encoded line.
type journalEncoder struct{ zapcore.Encoder }

func (e journalEncoder) Clone() zapcore.Encoder { return journalEncoder{e.Encoder.Clone()} }

func (e journalEncoder) EncodeEntry(ent zapcore.Entry, fields []zapcore.Field) (*buffer.Buffer, error) {
	line, err := e.Encoder.EncodeEntry(ent, fields)
	if err != nil {
		return nil, err
	}
	out := prefixed.Get()
	out.AppendString(priority(ent.Level))
	_, _ = out.Write(line.Bytes())
	line.Free()
	return out, nil
}
