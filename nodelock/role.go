package nodelock

import (
	"context"
	"crypto/sha256"
	"fmt"
)

// controlPlaneLockLabel prefixes the cluster ID in a control plane's lock value.
const controlPlaneLockLabel = "berth/v1/control-plane-lock\x00"

// ControlPlaneLockID is what a control plane of the cluster clusterID extends into its lock
// register instead of the cluster ID: SHA-256 of a fixed label and the cluster ID. A worker's lock
// register holds the cluster ID's extend, and an extend only ever moves a register further, so no
// worker, whatever runs on it, can make its register hold a control plane's value before a reboot
// resets it, and after a reboot the boot stage extends the worker's own value first. A node
// therefore takes a ticket only from a joinservice whose attested lock register holds this value
// for the ticket's cluster (joindial.ControlPlaneLock): a bootstrapped worker's TPM does not pass,
// whichever join policy the node started with.
func ControlPlaneLockID(clusterID []byte) []byte {
	sum := sha256.Sum256(append([]byte(controlPlaneLockLabel), clusterID...))
	return sum[:]
}

// ForRole wraps m so that MarkBootstrapped extends ControlPlaneLockID(clusterID) instead of the
// cluster ID when controlPlane reports that this node is a control plane (asked at every mark: at
// init or join and again on every boot). A failing controlPlane fails the mark.
func ForRole(m Marker, controlPlane func(ctx context.Context) (bool, error)) Marker {
	return roleMarker{m: m, controlPlane: controlPlane}
}

type roleMarker struct {
	m            Marker
	controlPlane func(ctx context.Context) (bool, error)
}

func (r roleMarker) MarkBootstrapped(ctx context.Context, clusterID []byte) error {
	cp, err := r.controlPlane(ctx)
	if err != nil {
		return fmt.Errorf("asking whether this node is a control plane: %w", err)
	}
	if cp {
		clusterID = ControlPlaneLockID(clusterID)
	}
	return r.m.MarkBootstrapped(ctx, clusterID)
}

func (r roleMarker) Bootstrapped(ctx context.Context) (bool, error) { return r.m.Bootstrapped(ctx) }
