// Package kubelet starts and keeps the kubelet running once kubeadm has configured it. Two
// implementations share one shape (Start enables the kubelet, Stop stops it and waits, Run owns
// whatever keeps it running):
//
//   - Systemd hands the kubelet to systemd (kubelet.service with kubeadm's drop-in), as on the OS image.
//   - Supervisor runs the kubelet as a child process and restarts it when it exits, for hosts
//     without systemd such as the mini cluster's namespace nodes and CI machines.
package kubelet

import (
	"context"
	"fmt"
	"io"
)

// Systemd starts kubelet.service through systemctl.
type Systemd struct {
	// Unit is the unit name; empty means "kubelet.service".
	Unit string
	Exec commander
}

// Start enables and starts the kubelet unit without waiting for the start job: kubelet.service is
// ordered after the bootstrapper's READY (the state disk must be open first), and the daemon calls
// Start before it notifies, so waiting would deadlock. kubeadm restarts it itself after writing its
// config.
func (s *Systemd) Start(ctx context.Context) error {
	unit := s.Unit
	if unit == "" {
		unit = "kubelet.service"
	}
	if err := s.Exec.Run(ctx, io.Discard, "systemctl", "enable", "--now", "--no-block", unit); err != nil {
		return fmt.Errorf("starting %s: %w", unit, err)
	}
	return nil
}

// Stop stops the kubelet unit and waits for the stop job: kubeadm reset asks systemd itself, but a
// caller that resets must not depend on that.
func (s *Systemd) Stop(ctx context.Context) error {
	unit := s.Unit
	if unit == "" {
		unit = "kubelet.service"
	}
	if err := s.Exec.Run(ctx, io.Discard, "systemctl", "stop", unit); err != nil {
		return fmt.Errorf("stopping %s: %w", unit, err)
	}
	return nil
}

// Run returns at once: systemd keeps the kubelet running.
func (s *Systemd) Run(context.Context) error { return nil }

// commander runs an external program.
type commander interface {
	// Run runs name with args and copies its output to out.
	Run(ctx context.Context, out io.Writer, name string, args ...string) error
}
