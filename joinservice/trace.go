package joinservice

import (
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/joinservice/policywatch"
	"github.com/berth-k8s/berth/joinservice/server"
	"github.com/berth-k8s/berth/nodelock"
)

// joinedLocks returns the lock register's measurement index for variant and the values a worker
// and a control plane of the cluster clusterID hold there once they joined (nodelock.ForRole).
func joinedLocks(variant string, clusterID []byte) (uint32, [][]byte) {
	if variant == tdx.VariantName {
		return uint32(1 + tdx.DefaultLockRTMR), [][]byte{tdx.ExpectedLockRTMR(clusterID), tdx.ExpectedLockRTMR(nodelock.ControlPlaneLockID(clusterID))}
	}
	return vtpm.DefaultLockPCR, [][]byte{vtpm.ExpectedLockValue(clusterID), vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(clusterID))}
}

// traceOption makes the server store join traces on Machines: with the policy in force, a joined
// node's lock register may hold this cluster's values (holder nil: no attestation, nothing judged).
func traceOption(store server.TraceStore, holder *policywatch.Holder, clusterID []byte) server.Option {
	if holder == nil {
		return server.WithTraceStore(store, nil)
	}
	index, joined := joinedLocks(holder.Policy().Variant, clusterID)
	return server.WithTraceStore(store, server.JoinedPolicyCheck(holder.Policy, index, joined...))
}

// joinedClaims lets a joined node of this cluster past the handshake's claim check, so that it can
// report its join trace (server.JoinedClaims); the handlers judge its evidence again.
func joinedClaims(check atls.ClaimCheck, variant string, clusterID []byte) atls.ClaimCheck {
	index, joined := joinedLocks(variant, clusterID)
	return server.JoinedClaims(check, index, joined...)
}
