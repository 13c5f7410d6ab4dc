package server

import (
	"context"
	"slices"
	"sync"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/nodelock"
)

// lockValuesSource is appended to the source of the lock register's expectation in the policy a
// check-in is judged by.
const lockValuesSource = "; or, for a check-in only, this cluster's worker or control-plane lock value (a node that booted on its sealed key)"

// CheckInPolicy is the cluster's policy as a check-in (CheckIn) is judged by it. A node checks in
// before its boot stage extends the lock register (the register is still zero, as for a join), or,
// after a boot no joinservice answered (a full power cut), once it runs: its register then holds
// this cluster's lock value, vtpm.ExpectedLockValue of the cluster ID on a worker and of
// nodelock.ControlPlaneLockID on a control plane (tdx.ExpectedLockRTMR on TDX). So the lock
// register's expectation of exact values (a fresh node's zero) also admits those two values of this
// cluster; every other expectation stays as it is. A register holding another cluster's value, or
// any other, is still refused (MEASUREMENT_MISMATCH, the index named). Join and Rejoin keep the
// cluster's policy unchanged: a node joins or rejoins only before its register is extended.
//
// An expectation of the lock register that is NonZero, or none, is left alone (it admits those
// values already). The widened policy is built once per policy in force (a hot reload builds it
// anew), so the handshake's claim check, which caches its verdicts per policy, keeps its cache.
type CheckInPolicy struct {
	current   func() *policy.Policy
	clusterID []byte

	mu      sync.Mutex
	base    *policy.Policy
	widened *policy.Policy
}

// NewCheckInPolicy returns the check-in's view of current (the policy in force, policywatch.Holder's
// Policy) for the cluster clusterID.
func NewCheckInPolicy(current func() *policy.Policy, clusterID []byte) *CheckInPolicy {
	return &CheckInPolicy{current: current, clusterID: slices.Clone(clusterID)}
}

// Policy returns the policy in force with this cluster's lock values admitted at the lock register.
func (c *CheckInPolicy) Policy() *policy.Policy {
	p := c.current()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.base != p {
		c.base, c.widened = p, WithClusterLockValues(p, c.clusterID)
	}
	return c.widened
}

// Check judges the peer's measurements against Policy (an AttestationCheck for WithCheckInAttestation).
func (c *CheckInPolicy) Check(ctx context.Context) ([]string, error) {
	return PolicyCheck(c.Policy())(ctx)
}

// LockRegisterIndex returns the measurement index of the node lock register of variant (TPM: PCR
// vtpm.DefaultLockPCR; TDX: RTMR tdx.DefaultLockRTMR, index 1 + it) and the value that register
// holds once a lock value was extended into it from zero; false for a variant without one.
func LockRegisterIndex(variant string) (uint32, func(lockValue []byte) []byte, bool) {
	switch variant {
	case vtpm.Variant:
		return vtpm.DefaultLockPCR, vtpm.ExpectedLockValue, true
	case tdx.VariantName:
		return 1 + tdx.DefaultLockRTMR, tdx.ExpectedLockRTMR, true
	}
	return 0, nil, false
}

// WithClusterLockValues returns a copy of p whose lock register expectation of exact values also
// admits the register's values on a booted worker and control plane of the cluster clusterID (see
// CheckInPolicy). p is returned unchanged when its variant has no lock register or p has no such
// expectation; p itself is never modified.
func WithClusterLockValues(p *policy.Policy, clusterID []byte) *policy.Policy {
	idx, expected, ok := LockRegisterIndex(p.Variant)
	if !ok {
		return p
	}
	i := slices.IndexFunc(p.Expectations, func(e policy.Expectation) bool { return e.Index == idx && !e.NonZero })
	if i < 0 {
		return p
	}
	out := *p
	out.Expectations = slices.Clone(p.Expectations)
	e := &out.Expectations[i]
	e.AnyOf = append(slices.Clip(e.AnyOf), expected(clusterID), expected(nodelock.ControlPlaneLockID(clusterID)))
	e.Source += lockValuesSource
	return &out
}
