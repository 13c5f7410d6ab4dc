package server

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
)

// RPCReportTrace names ReportTrace in the logs.
const RPCReportTrace = "report-trace"

// Reason codes of ReportTrace's refusals.
const (
	// ReasonNoMachine: the caller has no Machine to store its trace on (the cluster never admitted it).
	ReasonNoMachine = "NO_MACHINE"
	// ReasonBadTrace: the trace is malformed or out of bounds (jointrace.FromProto).
	ReasonBadTrace = "BAD_TRACE"
)

// traceWriteTimeout bounds storing one trace.
const traceWriteTimeout = 10 * time.Second

// ErrNoMachine is what a TraceStore returns when the identity has no Machine.
var ErrNoMachine = recordwriter.ErrNoMachine

// TraceStore stores a node's join trace on the Machine of identity, and on no other
// (recordwriter.Writer). It returns the Machine's name, or an error wrapping ErrNoMachine when
// identity has none; it never creates one.
type TraceStore interface {
	StoreTrace(ctx context.Context, identity string, trace *v1alpha1.JoinTrace) (string, error)
}

// WithTraceStore makes ReportTrace store traces in t, after checking the caller's attestation with
// joined: a node that joined has extended its lock register, which the join policy wants still
// zero, so the joinservice passes CheckInPolicy.Check, which admits this cluster's lock values
// there. Without it ReportTrace is refused as unimplemented.
func WithTraceStore(t TraceStore, joined AttestationCheck) Option {
	return func(s *Server) { s.traces, s.joinedCheck = t, joined }
}

// ReportTrace implements the RPC: it stores the caller's join trace on the caller's own Machine.
// The Machine is the one of the identity the caller attested (or, without an attested identity, of
// its instance name), never one the request names: it names none. It is charged like every call
// (per address, and to the unverified budget without evidence) and writes nothing to the ledger.
func (s *Server) ReportTrace(ctx context.Context, req *joinproto.ReportTraceRequest) (*joinproto.ReportTraceResponse, error) {
	if s.traces == nil {
		return nil, reject(codes.Unimplemented, ReasonInternal, "this joinservice does not store join traces")
	}
	ip := peerIP(ctx)
	peerKey := "unknown"
	if ip != nil {
		peerKey = ip.String()
	}
	_, verified := atls.PeerEvidence(ctx)
	if !s.budgets.peers.AllowPeer(peerKey) || s.attest != nil && !verified && !s.budgets.unverified.Allow() {
		return nil, reject(codes.ResourceExhausted, ReasonRateLimited, "too many calls: retry later")
	}
	log := &callLog{log: s.log, fields: []zap.Field{zap.String("peer", peerKey), zap.String("rpc", RPCReportTrace)}}
	if s.attest != nil {
		check := s.joinedCheck
		if check == nil {
			check = s.attest
		}
		if _, err := check(ctx); errors.Is(err, ErrNoEvidence) {
			log.Warn("join trace refused", zap.String("reason", ReasonNoEvidence))
			return nil, reject(codes.Unauthenticated, ReasonNoEvidence, "no attestation: connect with attested TLS")
		} else if err != nil {
			log.Warn("join trace refused", zap.String("reason", ReasonMeasurements), zap.Error(err))
			return nil, reject(codes.PermissionDenied, ReasonMeasurements, err.Error())
		}
	}
	inst, err := s.instanceFor(ctx, ip)
	if err != nil {
		log.Warn("join trace refused", zap.String("reason", ReasonUnknownPeer), zap.Error(err))
		return nil, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster")
	}
	log.with(zap.String("node", inst.Name))
	identity := recordIdentity(ctx, inst)
	if err := s.checkRevoked(identity, RPCReportTrace, log); err != nil {
		return nil, err
	}
	trace, err := jointrace.FromProto(req.GetPhases())
	if err != nil {
		log.Warn("join trace refused", zap.String("reason", ReasonBadTrace), zap.Error(err))
		return nil, reject(codes.InvalidArgument, ReasonBadTrace, err.Error())
	}
	wctx, cancel := context.WithTimeout(ctx, traceWriteTimeout)
	defer cancel()
	name, err := s.traces.StoreTrace(wctx, identity, trace.Status(s.now()))
	if errors.Is(err, ErrNoMachine) {
		log.Warn("join trace refused", zap.String("reason", ReasonNoMachine))
		return nil, reject(codes.FailedPrecondition, ReasonNoMachine, "the cluster has no machine record of this node: it was never admitted")
	}
	if err != nil {
		log.Error("storing a join trace", zap.Error(err))
		return nil, reject(codes.Internal, ReasonInternal, "internal error")
	}
	failed, _ := trace.Failed()
	log.Info("join trace stored", zap.String("machine", name), zap.Int("phases", len(trace.Phases)), zap.String("failedPhase", failed.Name))
	return &joinproto.ReportTraceResponse{Machine: name}, nil
}
