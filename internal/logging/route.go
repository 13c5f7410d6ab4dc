package logging

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/go-logr/logr"
	"github.com/go-logr/zapr"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc/grpclog"
	"k8s.io/klog/v2"
)

// sinks is where klog and grpclog lines go: the logger of the last New.
type sinks struct {
	klog logr.LogSink
	grpc *zap.Logger
}

var (
	current      atomic.Pointer[sinks]
	fallback     *sinks
	makeFallback sync.Once
)

// klog.SetLogger and grpclog.SetLoggerV2 are not safe while anything logs (a test process may run
// gRPC while it calls New), so they run once, at package initialization, with forwarders that read
// current on every line; New only swaps current. Until the first New, lines go to stderr as with
// Defaults().
func init() {
	klog.SetLogger(logr.New(klogForwarder{}))
	grpclog.SetLoggerV2(grpcForwarder{})
}

// route makes log the sink of klog and grpclog.
func route(log *zap.Logger) { current.Store(newSinks(log)) }

func newSinks(log *zap.Logger) *sinks {
	// The caller of a line is the code that called klog or grpclog: one frame more than zapr
	// expects (klogForwarder -> zapr's sink); three above the Check in grpcForwarder.write
	// (write, grpcForwarder.Info, grpclog.Info).
	return &sinks{
		klog: zapr.NewLogger(log.Named("klog").WithOptions(zap.AddCallerSkip(1))).GetSink(),
		grpc: log.Named("grpc").WithOptions(zap.AddCallerSkip(3)),
	}
}

// target is the sinks of the last New, or of a default logger on stderr before any.
func target() *sinks {
	if s := current.Load(); s != nil {
		return s
	}
	makeFallback.Do(func() {
		log, err := build(Defaults(), os.Stderr, os.Getenv(JournalStreamEnv))
		if err != nil {
			panic(err) // Defaults() are valid: TestBadConfig
		}
		fallback = newSinks(log)
	})
	return fallback
}

// klogForwarder is a logr.LogSink that hands each line to the current klog sink, with the names,
// values and call depth given to it.
type klogForwarder struct {
	depth  int
	names  []string
	values []any
}

var (
	_ logr.LogSink          = klogForwarder{}
	_ logr.CallDepthLogSink = klogForwarder{}
)

func (f klogForwarder) sink() logr.LogSink {
	s := target().klog
	if f.depth > 0 {
		if d, ok := s.(logr.CallDepthLogSink); ok {
			s = d.WithCallDepth(f.depth)
		}
	}
	for _, n := range f.names {
		s = s.WithName(n)
	}
	if len(f.values) > 0 {
		s = s.WithValues(f.values...)
	}
	return s
}

// Init is a no-op: the depth of logr.New is in the sink's caller skip.
func (klogForwarder) Init(logr.RuntimeInfo) {}

func (f klogForwarder) Enabled(level int) bool { return f.sink().Enabled(level) }

func (f klogForwarder) Info(level int, msg string, kv ...any) { f.sink().Info(level, msg, kv...) }

func (f klogForwarder) Error(err error, msg string, kv ...any) { f.sink().Error(err, msg, kv...) }

func (f klogForwarder) WithValues(kv ...any) logr.LogSink {
	f.values = append(append([]any(nil), f.values...), kv...)
	return f
}

func (f klogForwarder) WithName(name string) logr.LogSink {
	f.names = append(append([]string(nil), f.names...), name)
	return f
}

func (f klogForwarder) WithCallDepth(depth int) logr.LogSink {
	f.depth += depth
	return f
}

// grpcForwarder is a grpclog.LoggerV2 (and DepthLoggerV2) writing to the current gRPC logger:
// gRPC's info and warning lines at debug level, errors at error, fatal at fatal (which exits).
type grpcForwarder struct{}

var _ grpclog.DepthLoggerV2 = grpcForwarder{}

// write logs msg() at lvl; skip is the number of frames more than grpclog.Info's between the code
// that logged and the forwarder (a depth call's depth). The message is formatted only when lvl is
// written at all: gRPC logs every failed handshake at info, and a joinservice refuses thousands of
// handshakes a second under a flood.
func (grpcForwarder) write(skip int, lvl zapcore.Level, msg func() string) {
	log := target().grpc
	if !log.Core().Enabled(lvl) {
		return
	}
	if skip > 0 {
		log = log.WithOptions(zap.AddCallerSkip(skip))
	}
	if ce := log.Check(lvl, msg()); ce != nil {
		ce.Write()
	}
}

// sprintln is fmt.Sprintln without the newline: grpclog's *ln and *Depth calls.
func sprintln(args []any) string {
	s := fmt.Sprintln(args...)
	return s[:len(s)-1]
}

func (g grpcForwarder) Info(args ...any) {
	g.write(0, zapcore.DebugLevel, func() string { return fmt.Sprint(args...) })
}
func (g grpcForwarder) Infoln(args ...any) {
	g.write(0, zapcore.DebugLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) Infof(format string, args ...any) {
	g.write(0, zapcore.DebugLevel, func() string { return fmt.Sprintf(format, args...) })
}
func (g grpcForwarder) Warning(args ...any) {
	g.write(0, zapcore.DebugLevel, func() string { return fmt.Sprint(args...) })
}
func (g grpcForwarder) Warningln(args ...any) {
	g.write(0, zapcore.DebugLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) Warningf(format string, args ...any) {
	g.write(0, zapcore.DebugLevel, func() string { return fmt.Sprintf(format, args...) })
}
func (g grpcForwarder) Error(args ...any) {
	g.write(0, zapcore.ErrorLevel, func() string { return fmt.Sprint(args...) })
}
func (g grpcForwarder) Errorln(args ...any) {
	g.write(0, zapcore.ErrorLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) Errorf(format string, args ...any) {
	g.write(0, zapcore.ErrorLevel, func() string { return fmt.Sprintf(format, args...) })
}
func (g grpcForwarder) Fatal(args ...any) {
	g.write(0, zapcore.FatalLevel, func() string { return fmt.Sprint(args...) })
}
func (g grpcForwarder) Fatalln(args ...any) {
	g.write(0, zapcore.FatalLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) Fatalf(format string, args ...any) {
	g.write(0, zapcore.FatalLevel, func() string { return fmt.Sprintf(format, args...) })
}

// V reports whether verbose level l is on: as gRPC's own default (verbosity 0), and only when
// debug lines are written at all.
func (grpcForwarder) V(l int) bool {
	return l <= 0 && target().grpc.Core().Enabled(zapcore.DebugLevel)
}

// The depth calls come from grpclog.*Depth and the component loggers; depth 0 is their caller.
func (g grpcForwarder) InfoDepth(depth int, args ...any) {
	g.write(depth, zapcore.DebugLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) WarningDepth(depth int, args ...any) {
	g.write(depth, zapcore.DebugLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) ErrorDepth(depth int, args ...any) {
	g.write(depth, zapcore.ErrorLevel, func() string { return sprintln(args) })
}
func (g grpcForwarder) FatalDepth(depth int, args ...any) {
	g.write(depth, zapcore.FatalLevel, func() string { return sprintln(args) })
}
