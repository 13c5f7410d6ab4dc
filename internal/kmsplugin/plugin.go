package kmsplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"
)

// PluginConfig configures the plugin process.
type PluginConfig struct {
	// Socket is the unix socket the API server connects to (DefaultSocket).
	Socket string
	// MetricsListen is HOST:PORT for /metrics; empty serves no metrics.
	MetricsListen string
}

// ErrParentGone is returned by RunPlugin when its key set input ended: the bootstrapper that
// supervises the plugin is gone, and a plugin never outlives the process that holds its keys.
var ErrParentGone = errors.New("the key set input ended")

// RunPlugin is the plugin process: it serves the KMS v2 API on cfg.Socket with the key sets it reads
// from in (WriteKeySet frames; the newest wins), writes events to events, and serves metrics. It runs
// until ctx ends (nil) or in ends (ErrParentGone). in is closed when RunPlugin returns, which must
// unblock a pending read (a pipe from os.Pipe or io.Pipe does).
func RunPlugin(ctx context.Context, cfg PluginConfig, in io.ReadCloser, events io.Writer, log *zap.Logger) error {
	metrics := NewMetrics()
	ev := newEventWriter()
	svc := NewService(observers{metrics, encryptEvents{ev}})
	lis, err := Listen(ctx, cfg.Socket)
	if err != nil {
		_ = in.Close()
		return err
	}
	var mlis net.Listener
	if cfg.MetricsListen != "" {
		var lc net.ListenConfig
		if mlis, err = lc.Listen(ctx, "tcp", cfg.MetricsListen); err != nil {
			_ = in.Close()
			lis.Close()
			return fmt.Errorf("listening for metrics: %w", err)
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		<-gctx.Done()
		return in.Close() // unblocks the reader below
	})
	g.Go(func() error {
		for {
			set, err := ReadKeySet(in)
			if gctx.Err() != nil {
				return nil //nolint:nilerr // the read failed because RunPlugin is stopping
			}
			if errors.Is(err, io.EOF) {
				log.Info("key set input ended: stopping")
				return ErrParentGone
			}
			if err != nil {
				return err
			}
			if err := svc.SetKeys(set); err != nil {
				return err
			}
			metrics.Keys(set)
			log.Info("key set loaded", zap.Uint32s("generations", set.Generations()), zap.Uint32("active", set.Active),
				zap.String("activeKeyID", set.ActiveKeyID()))
		}
	})
	g.Go(func() error { return ev.run(gctx.Done(), events) })
	g.Go(func() error {
		log.Info("KMS plugin serving", zap.String("socket", cfg.Socket))
		return Serve(gctx, lis, svc)
	})
	if mlis != nil {
		g.Go(func() error {
			log.Info("KMS plugin metrics serving", zap.String("address", mlis.Addr().String()))
			return metrics.Serve(gctx, mlis)
		})
	}
	return g.Wait()
}

// observers fans an observation out to each of its members.
type observers []Observer

func (o observers) Request(method, keyID string, err error, took time.Duration) {
	for _, x := range o {
		x.Request(method, keyID, err, took)
	}
}

func (o observers) Health(healthy bool, keyID string) {
	for _, x := range o {
		x.Health(healthy, keyID)
	}
}

// encryptEvents reports every successful Encrypt's key ID as an event.
type encryptEvents struct{ w *eventWriter }

func (e encryptEvents) Request(method, keyID string, err error, _ time.Duration) {
	if method == MethodEncrypt && err == nil {
		e.w.encrypted(keyID)
	}
}

func (encryptEvents) Health(bool, string) {}

// Stdin returns the process's standard input switched to non-blocking mode, so that closing it ends
// a read in progress (RunPlugin closes its input when it stops).
func Stdin() (*os.File, error) {
	if err := syscall.SetNonblock(0, true); err != nil {
		return nil, fmt.Errorf("setting stdin non-blocking: %w", err)
	}
	return os.NewFile(0, "stdin"), nil
}
