package mini

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
)

// createStateDisk gives node n a blank state disk: a sparse image file of the configured size,
// created once with the node and kept across restarts (the node's bootstrapper formats and
// encrypts it). An existing image is left as it is.
func (c *Cluster) createStateDisk(n Node) error {
	path := c.cfg.StateDisk(n.Name)
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	if err := os.MkdirAll(c.cfg.NodeDir(n.Name), 0o755); err != nil {
		return fmt.Errorf("creating node directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("creating state disk: %w", err)
	}
	if err := f.Truncate(c.cfg.StateDiskBytes()); err != nil {
		f.Close()
		return fmt.Errorf("sizing state disk: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("closing state disk: %w", err)
	}
	return nil
}

// How long a power-off waits for the loop devices of a node's state disk to go. The kernel
// detaches an auto-clearing loop device by itself once the node's mounts are gone; one that is
// left after loopSettle is detached explicitly (a busy one is then detached on its last close),
// and after loopDetachTimeout the node must not boot.
const (
	loopPoll          = 50 * time.Millisecond
	loopSettle        = time.Second
	loopDetachTimeout = 20 * time.Second
)

// ErrStateDiskAttached is returned when a node's state disk image stays attached to a loop
// device after its power-off: booting the node would put a second file system on the same image.
var ErrStateDiskAttached = errors.New("state disk is still attached to a loop device")

// detachStateDisks makes sure no loop device backs the state disk image of any of nodes. It runs
// after the nodes' processes are dead and their mount namespaces unpinned, before they boot again.
func (c *Cluster) detachStateDisks(ctx context.Context, nodes []Node) error {
	var errs []error
	for _, n := range nodes {
		if err := c.detachStateDisk(ctx, n); err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
		}
	}
	return errors.Join(errs...)
}

func (c *Cluster) detachStateDisk(ctx context.Context, n Node) error {
	img := c.cfg.StateDisk(n.Name)
	if _, err := os.Stat(img); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	var devs []string
	var last error
	// losetup runs under ctx, not the poll's deadline, so that the last listing is never cut off.
	gone := func(context.Context) (bool, error) {
		devs, last = c.loopDevices(ctx, img)
		return last == nil && len(devs) == 0, nil
	}
	if err := wait.PollUntilContextTimeout(ctx, loopPoll, loopSettle, true, gone); err == nil {
		return nil
	}
	if last != nil {
		return fmt.Errorf("listing loop devices of %s: %w", img, last)
	}
	for _, d := range devs {
		c.log.Info("detaching state disk loop device", zap.String("node", n.Name), zap.String("device", d), zap.String("image", img))
		if _, err := c.run.Run(ctx, Cmd{Path: "losetup", Args: []string{"-d", d}}); err != nil {
			c.log.Warn("detaching state disk loop device failed", zap.String("node", n.Name), zap.String("device", d), zap.Error(err))
		}
	}
	if err := wait.PollUntilContextTimeout(ctx, loopPoll, loopDetachTimeout, true, gone); err != nil {
		if last != nil {
			return fmt.Errorf("listing loop devices of %s: %w", img, last)
		}
		return fmt.Errorf("%w: %s on %s", ErrStateDiskAttached, img, strings.Join(devs, " "))
	}
	return nil
}

// loopDevices lists the loop devices backed by img (`losetup -j`).
func (c *Cluster) loopDevices(ctx context.Context, img string) ([]string, error) {
	out, err := c.run.Run(ctx, Cmd{Path: "losetup", Args: []string{"-j", img}})
	if err != nil {
		return nil, err
	}
	return parseLosetupJ(string(out)), nil
}

// parseLosetupJ returns the device names of `losetup -j` output, one device a line:
// "/dev/loop3: [64769]:1234 (/path/state.img)".
func parseLosetupJ(out string) []string {
	var devs []string
	for _, l := range strings.Split(out, "\n") {
		dev, _, ok := strings.Cut(strings.TrimSpace(l), ":")
		if ok && strings.HasPrefix(dev, "/dev/") {
			devs = append(devs, dev)
		}
	}
	return devs
}
