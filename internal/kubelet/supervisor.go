package kubelet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/command"
)

// Supervisor runs the kubelet as a child process. Start enables it; Run, owned by the daemon's
// errgroup, waits until it is enabled and kubeadm has written the kubelet's configuration, then
// starts the kubelet and restarts it with capped backoff whenever it exits, until ctx ends. Stop
// disables it again and returns once the running kubelet has exited, as `systemctl stop` does
// before a kubeadm reset: a kubelet that ran across a reset would keep the undone attempt's
// credentials and never register with the cluster that the next attempt makes.
type Supervisor struct {
	// Path is the kubelet binary.
	Path string
	// KubeletDir is kubeadm's kubelet directory (default /var/lib/kubelet).
	KubeletDir string
	// KubernetesDir is kubeadm's configuration directory (default /etc/kubernetes).
	KubernetesDir string
	// ExtraArgs are appended to the kubelet's command line.
	ExtraArgs []string
	// Output receives the kubelet's stdout and stderr; nil discards them.
	Output io.Writer
	// PollInterval is how often Run checks for kubeadm's files (default 200 ms).
	PollInterval time.Duration
	Log          *zap.Logger
	// Children, if set, records the running kubelet so that a restarted daemon can kill one a
	// crashed daemon left behind (command.Children.KillStale).
	Children *command.Children

	mu      sync.Mutex
	starts  int
	enabled bool
	// changed is closed (and replaced) whenever enabled changes.
	changed chan struct{}
	// stopRun ends the current supervision (nil while none runs); stopped is closed once it ended.
	stopRun context.CancelFunc
	stopped chan struct{}
}

// setEnabled sets enabled and wakes Run when it changed; s.mu is held.
func (s *Supervisor) setEnabled(enabled bool) {
	if s.changed == nil {
		s.changed = make(chan struct{})
	}
	if s.enabled == enabled {
		return
	}
	s.enabled = enabled
	close(s.changed)
	s.changed = make(chan struct{})
}

// Start enables the kubelet. It returns at once; Run starts the process.
func (s *Supervisor) Start(context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.setEnabled(true)
	return nil
}

// Stop disables the kubelet and returns once no kubelet process of Run's runs, or ctx ended. Start
// enables it again.
func (s *Supervisor) Stop(ctx context.Context) error {
	s.mu.Lock()
	s.setEnabled(false)
	stop, stopped := s.stopRun, s.stopped
	s.mu.Unlock()
	if stop == nil {
		return nil
	}
	stop()
	select {
	case <-stopped:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stopping the kubelet: %w", ctx.Err())
	}
}

// enabledRun waits until the kubelet is enabled and returns the context of one supervision, which
// ends with ctx or when Stop is called; done must be called once the supervision ended. It returns
// ctx's error when ctx ends first.
func (s *Supervisor) enabledRun(ctx context.Context) (run context.Context, done func(), err error) {
	for {
		s.mu.Lock()
		if s.enabled {
			run, cancel := context.WithCancel(ctx)
			stopped := make(chan struct{})
			s.stopRun, s.stopped = cancel, stopped
			s.mu.Unlock()
			return run, func() {
				cancel()
				s.mu.Lock()
				s.stopRun, s.stopped = nil, nil
				s.mu.Unlock()
				close(stopped)
			}, nil
		}
		if s.changed == nil {
			s.changed = make(chan struct{})
		}
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-changed:
		}
	}
}

// Starts reports how many times the kubelet process was started.
func (s *Supervisor) Starts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.starts
}

// Run supervises the kubelet until ctx ends. It returns nil when ctx ends and an error only when
// the kubelet cannot be started at all (e.g. its binary is missing). The kubelet is restarted 1 s
// after it exits, then after 2, 4, 8 and at most 10 s while it keeps exiting; a kubelet that ran for
// longer than a minute starts the sequence over (command.Supervise). After Stop it waits until it is
// enabled again.
func (s *Supervisor) Run(ctx context.Context) error {
	log := s.Log
	if log == nil {
		log = zap.NewNop()
	}
	for {
		run, done, err := s.enabledRun(ctx)
		if err != nil {
			return nil
		}
		if _, err := exec.LookPath(s.Path); err != nil {
			done()
			return fmt.Errorf("finding kubelet binary: %w", err)
		}
		err = command.Supervise(run, command.Supervised{
			Ready: s.waitForConfig,
			Run: func(ctx context.Context) error {
				args, err := s.args()
				if err != nil {
					return command.Permanent(err)
				}
				log.Info("starting kubelet", zap.Strings("args", args))
				err = s.runOnce(ctx, args)
				if ctx.Err() != nil {
					log.Info("kubelet stopped")
				}
				return err
			},
			Restarting: func(err error, backoff time.Duration) {
				log.Warn("kubelet exited, restarting", zap.Error(err), zap.Duration("backoff", backoff))
			},
		})
		done()
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			return err
		}
	}
}

// runOnce runs the kubelet once, in a process group of its own that dies with the daemon
// (command.Group): an unsupervised kubelet must not outlive its supervisor.
func (s *Supervisor) runOnce(ctx context.Context, args []string) error {
	cmd := exec.CommandContext(ctx, s.Path, args...)
	cmd.Stdout = s.Output
	cmd.Stderr = s.Output
	command.Group(cmd)
	cmd.WaitDelay = 15 * time.Second
	s.mu.Lock()
	s.starts++
	s.mu.Unlock()
	return command.RunGroup(cmd, s.Children)
}

func (s *Supervisor) dirs() (kubeletDir, k8sDir string) {
	kubeletDir, k8sDir = s.KubeletDir, s.KubernetesDir
	if kubeletDir == "" {
		kubeletDir = "/var/lib/kubelet"
	}
	if k8sDir == "" {
		k8sDir = "/etc/kubernetes"
	}
	return kubeletDir, k8sDir
}

// waitForConfig blocks until kubeadm wrote the kubelet config and a (bootstrap) kubeconfig.
func (s *Supervisor) waitForConfig(ctx context.Context) error {
	kubeletDir, k8sDir := s.dirs()
	interval := s.PollInterval
	if interval == 0 {
		interval = 200 * time.Millisecond
	}
	return wait.PollUntilContextCancel(ctx, interval, true, func(context.Context) (bool, error) {
		return exists(filepath.Join(kubeletDir, "config.yaml")) &&
			(exists(filepath.Join(k8sDir, "kubelet.conf")) || exists(filepath.Join(k8sDir, "bootstrap-kubelet.conf"))), nil
	})
}

func (s *Supervisor) args() ([]string, error) {
	kubeletDir, k8sDir := s.dirs()
	args := []string{
		"--config=" + filepath.Join(kubeletDir, "config.yaml"),
		"--kubeconfig=" + filepath.Join(k8sDir, "kubelet.conf"),
		"--bootstrap-kubeconfig=" + filepath.Join(k8sDir, "bootstrap-kubelet.conf"),
	}
	flags, err := ReadFlagsEnv(filepath.Join(kubeletDir, "kubeadm-flags.env"))
	if err != nil {
		return nil, err
	}
	args = append(args, flags...)
	return append(args, s.ExtraArgs...), nil
}

// ReadFlagsEnv reads the kubelet flags kubeadm writes to kubeadm-flags.env
// (KUBELET_KUBEADM_ARGS="--flag=value ..."). A missing file means no flags.
func ReadFlagsEnv(path string) ([]string, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading kubeadm kubelet flags: %w", err)
	}
	defer f.Close()
	var flags []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		value, ok := strings.CutPrefix(line, "KUBELET_KUBEADM_ARGS=")
		if !ok {
			continue
		}
		value = strings.Trim(value, `"'`)
		flags = append(flags, strings.Fields(value)...)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading kubeadm kubelet flags: %w", err)
	}
	return flags, nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
