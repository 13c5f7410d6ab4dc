package server

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// ErrControlPlaneBusy is returned by a ControlPlaneLock when another operation holds the
// control-plane slot (a control plane joining or leaving, a renewal restarting a control plane) and
// the wait for it ended. Its wrapping error names who holds the slot.
var ErrControlPlaneBusy = cpslot.ErrBusy

// ControlPlaneLock serializes changes of the control planes, across replicas and with the other
// operations that disrupt a control plane when backed by the control-plane slot (SlotLock): etcd
// grows and shrinks one member at a time.
type ControlPlaneLock interface {
	// Lock waits until holder holds the slot or ctx ends; then it fails with ErrControlPlaneBusy.
	Lock(ctx context.Context, holder string) (ControlPlaneSlot, error)
}

// ControlPlaneSlot is the slot a Lock took.
type ControlPlaneSlot interface {
	// Release frees the slot: the ticket was not issued (or the removal is done).
	Release()
	// Joining hands the slot to the join the ticket starts: it stays taken until a joinservice sees
	// the node's etcd member voting and healthy and its API server ready, or until the join timeout
	// frees it. An error means the slot could not be handed over; the ticket must not be issued.
	Joining(ctx context.Context, node, address string) error
	// WaitedFor says who held the slot while Lock waited for it; empty when it was free.
	WaitedFor() string
}

// removalPrefix starts the holder an etcd member's removal locks for (joinservice/membership).
const removalPrefix = "remove:"

// SlotLock is the ControlPlaneLock of the control-plane slot (internal/cpslot) that every
// joinservice replica and every control plane's certificate renewal share: a holder NODE is NODE's
// control-plane join, a holder remove:NODE the removal of NODE's etcd member.
type SlotLock struct{ Slot *cpslot.Slot }

// Lock takes the slot for holder.
func (l SlotLock) Lock(ctx context.Context, holder string) (ControlPlaneSlot, error) {
	op, node := cpslot.ControlPlaneJoin, holder
	if n, ok := strings.CutPrefix(holder, removalPrefix); ok {
		op, node = cpslot.EtcdMemberRemoval, n
	}
	h, err := l.Slot.Acquire(ctx, op, node)
	if err != nil {
		return nil, err
	}
	return h, nil
}

// controlPlaneSlot takes the control-plane slot for inst, reads the control-plane files and hands
// the slot to inst's join. A failure is the rejection to return, with the slot released.
func (s *Server) controlPlaneSlot(ctx context.Context, a *attempt, inst metadata.Instance, log *callLog) ([]*joinproto.File, error) {
	start := time.Now()
	slot, err := s.cpLock.Lock(ctx, inst.Name)
	if err != nil {
		log.Warn("join rejected", zap.String("reason", ReasonControlPlaneBusy), zap.Error(err))
		msg := "the control-plane slot is taken: retry later"
		if errors.Is(err, ErrControlPlaneBusy) {
			msg = err.Error() + ": retry later"
		}
		return nil, reject(codes.Unavailable, ReasonControlPlaneBusy, msg)
	}
	files, err := s.readControlPlaneFiles()
	if err != nil {
		slot.Release()
		log.Error("reading control-plane files", zap.Error(err))
		return nil, reject(codes.Unavailable, ReasonInternal, "the joinservice cannot read the control-plane files")
	}
	// The API server flags kubeadm uploaded name these files: a control plane without them would
	// not start its API server, so a failure to read them refuses the join.
	cluster, err := s.clusterFiles(ctx)
	if err != nil {
		slot.Release()
		log.Error("reading the cluster configuration's files", zap.Error(err))
		return nil, reject(codes.Unavailable, ReasonInternal, "the joinservice cannot read the cluster configuration")
	}
	files = append(files, cluster...)
	address := ""
	if len(inst.IPs) > 0 {
		address = inst.IPs[0]
	}
	if err := slot.Joining(ctx, inst.Name, address); err != nil {
		slot.Release()
		log.Error("handing the control-plane slot to the join", zap.Error(err))
		return nil, reject(codes.Unavailable, ReasonInternal, "the joinservice cannot record the control-plane join: retry later")
	}
	if by := slot.WaitedFor(); by != "" {
		// The ledger shows the wait: this join started only once the one before it finished.
		a.entry.Message = fmt.Sprintf("waited %s for the control-plane slot (%s)", time.Since(start).Round(100*time.Millisecond), by)
	}
	return files, nil
}
