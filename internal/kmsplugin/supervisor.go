package kmsplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/berth-k8s/berth/internal/command"
)

// Supervisor runs the plugin as a child process of the bootstrapper, the process that holds the
// keys. SetKeys gives it a key set (the first call enables it); Run, owned by the daemon's errgroup,
// starts the plugin once enabled, writes it the newest key set at every start and after every
// SetKeys, reads its events, and restarts it with capped backoff whenever it exits, until ctx ends.
// A node that never gets a key set (a worker) never starts a plugin.
type Supervisor struct {
	// Path is the plugin's binary and Args its arguments (the bootstrapper runs itself:
	// os.Executable() with "kms-plugin" and its flags).
	Path string
	Args []string
	// Stderr receives the plugin's log; nil discards it.
	Stderr io.Writer
	Log    *zap.Logger

	once    sync.Once
	enabled chan struct{}
	updated chan struct{}

	mu        sync.Mutex
	keys      KeySet
	hasKeys   bool
	encryptID string
	starts    int
	running   int // PID of the running plugin, 0 when none runs
}

func (s *Supervisor) init() {
	s.once.Do(func() {
		s.enabled = make(chan struct{})
		s.updated = make(chan struct{}, 1)
	})
}

// SetKeys validates set and hands it to the plugin (now, or when it starts).
func (s *Supervisor) SetKeys(set KeySet) error {
	if err := set.Validate(); err != nil {
		return err
	}
	s.init()
	s.mu.Lock()
	s.keys, s.hasKeys = set, true
	s.mu.Unlock()
	select {
	case <-s.enabled:
	default:
		close(s.enabled)
	}
	select {
	case s.updated <- struct{}{}:
	default:
	}
	return nil
}

// Keys returns the key set the plugin has been given, if any.
func (s *Supervisor) Keys() (KeySet, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.keys, s.hasKeys
}

// EncryptKeyID is the key ID of the last Encrypt a plugin answered ("" when none did yet). Its API
// server makes a new data-encryption key, and so calls Encrypt, when the key ID changed: once it
// equals the active key's ID, that API server writes under the active key.
func (s *Supervisor) EncryptKeyID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.encryptID
}

// PID is the running plugin's process ID, 0 when none runs.
func (s *Supervisor) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running
}

// Starts reports how many times the plugin was started.
func (s *Supervisor) Starts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.starts
}

// stopGrace is how long the plugin gets to stop after SIGTERM before it is killed.
const stopGrace = 10 * time.Second

// Run supervises the plugin until ctx ends, then stops it. It returns nil when ctx ends and an error
// only when the plugin cannot be started at all. The plugin is restarted 1 s after it exits, then
// after 2, 4, 8 and at most 10 s while it keeps exiting; a plugin that ran for longer than a minute
// starts the sequence over (command.Supervise). The API server retries on its own (every 10 s while
// the plugin is unhealthy) and keeps reading with the keys it has cached meanwhile.
func (s *Supervisor) Run(ctx context.Context) error {
	s.init()
	log := s.Log
	if log == nil {
		log = zap.NewNop()
	}
	select {
	case <-ctx.Done():
		return nil
	case <-s.enabled:
	}
	return command.Supervise(ctx, command.Supervised{
		Run: func(ctx context.Context) error {
			err := s.runOnce(ctx, log)
			if ctx.Err() != nil {
				log.Info("KMS plugin stopped")
				return err
			}
			var exitErr *exec.ExitError
			if err != nil && !errors.As(err, &exitErr) && s.Starts() == 0 {
				return command.Permanent(fmt.Errorf("starting the KMS plugin: %w", err))
			}
			return err
		},
		Restarting: func(err error, backoff time.Duration) {
			log.Warn("KMS plugin exited, restarting", zap.Error(err), zap.Duration("backoff", backoff))
		},
	})
}

// runOnce runs one plugin process until it exits or ctx ends.
func (s *Supervisor) runOnce(ctx context.Context, log *zap.Logger) error {
	cmd := exec.CommandContext(ctx, s.Path, s.Args...)
	cmd.Stderr = s.Stderr
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = stopGrace
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return fmt.Errorf("creating the plugin's stdin: %w", err)
	}
	// The events pipe is read to its end (the plugin closed it by exiting), not closed by Wait, so
	// no event is lost.
	events, eventsW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("creating the plugin's stdout: %w", err)
	}
	defer events.Close()
	cmd.Stdout = eventsW
	err = cmd.Start()
	eventsW.Close()
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.starts++
	s.running = cmd.Process.Pid
	s.mu.Unlock()
	log.Info("KMS plugin started", zap.Int("pid", cmd.Process.Pid))
	defer func() {
		s.mu.Lock()
		s.running = 0
		s.mu.Unlock()
	}()

	// The writer sends the key set now and after every update; the reader takes the events. Both end
	// when the process does: its pipes close.
	exited := make(chan struct{})
	var g errgroup.Group
	g.Go(func() error {
		defer stdin.Close()
		for {
			s.mu.Lock()
			set := s.keys
			s.mu.Unlock()
			if err := WriteKeySet(stdin, set); err != nil {
				return nil //nolint:nilerr // the plugin exited; Wait reports why
			}
			select {
			case <-exited:
				return nil
			case <-s.updated:
			}
		}
	})
	g.Go(func() error {
		_ = ReadEvents(events, func(e Event) {
			if e.EncryptKeyID != "" {
				s.mu.Lock()
				s.encryptID = e.EncryptKeyID
				s.mu.Unlock()
			}
		})
		return nil
	})
	err = cmd.Wait()
	close(exited)
	_ = g.Wait()
	return err
}
