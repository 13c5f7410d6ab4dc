package server

import (
	"context"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/metadata"
)

// ReasonRevoked is the reason code of a join or rejoin of a machine an operator removed.
const ReasonRevoked = joinledger.ReasonRevoked

// RPCCheckIn is the ledger's RPC name of a joined node's check-in (CheckIn).
const RPCCheckIn = "checkin"

// ReasonWrongCluster is the reason code of a check-in of a node that names another cluster.
const ReasonWrongCluster = "WRONG_CLUSTER"

// ReasonRecordUnavailable is the reason code of a join or rejoin refused because this replica has
// not read the machine record yet, so it cannot tell whether the machine was removed.
const ReasonRecordUnavailable = "MACHINE_RECORD_UNAVAILABLE"

// MachineRecord is the cluster's record of admitted and removed machines (registry.Registry).
type MachineRecord interface {
	// Lookup returns the recorded machine with identity and whether there is one; an error while
	// the record has not been read.
	Lookup(identity string) (machines.Machine, bool, error)
	// Admit records m unless its identity is recorded already; it must return at once.
	Admit(m machines.Machine)
}

// WithMachineRecord makes the server refuse machines an operator removed (REVOKED) and record every
// machine it admits in rec. Without it nothing is refused or recorded.
func WithMachineRecord(rec MachineRecord) Option { return func(s *Server) { s.record = rec } }

// checkRevoked refuses a machine an operator removed. identity is its record identity; rpc names
// the call for the log.
func (s *Server) checkRevoked(identity, rpc string, log *callLog) error {
	if s.record == nil {
		return nil
	}
	m, ok, err := s.record.Lookup(identity)
	if err != nil {
		log.Warn(rpc+" rejected", zap.String("reason", ReasonRecordUnavailable), zap.Error(err))
		return reject(codes.Unavailable, ReasonRecordUnavailable, "the joinservice has not read the cluster's machine record yet: retry later")
	}
	if ok && m.Revoked() {
		log.Warn(rpc+" rejected", zap.String("reason", ReasonRevoked), zap.String("removedNode", m.Node))
		return reject(codes.PermissionDenied, ReasonRevoked,
			"machine "+machines.Short(identity)+" was removed from the cluster (as node "+m.Node+" at "+m.Removal.Time.UTC().Format(time.RFC3339)+
				"): it may not join, rejoin or run until an operator re-admits it with berth node readmit")
	}
	return nil
}

// admit records the machine the server just admitted.
func (s *Server) admit(identity string, inst metadata.Instance) {
	if s.record == nil {
		return
	}
	role := machines.RoleWorker
	if inst.Role == metadata.RoleControlPlane {
		role = machines.RoleControlPlane
	}
	s.record.Admit(machines.Machine{Identity: identity, Node: inst.Name, Role: role, Admitted: time.Now().UTC().Truncate(time.Second)})
}

// recordIdentity is the machine record's identity of the peer in ctx (see peerIdentity).
func recordIdentity(ctx context.Context, inst metadata.Instance) string {
	identity, source := peerIdentity(ctx, inst)
	if source == identityAttested {
		return machines.Identity(identity, inst.Name)
	}
	return machines.Identity(nil, inst.Name)
}
