// Package server is the joinservice's gRPC server: it decides which nodes may join and hands each
// one a ticket with everything kubeadm join needs.
//
// The node's identity comes from the platform, never from the node: the peer's address is looked up
// in metadata, the role it asks for must be the role metadata gives it, and its kubelet certificate
// is issued for the instance name metadata reports.
//
// A ticket carries no bootstrap token: the node joins with kubeadm's discovery file, built from the
// ticket's cluster CA and kubelet certificate and its own key (see bootstrapper/joincluster), workers
// and control planes alike. So the joinservice writes nothing to the API server per join but its
// batched ledger, a new machine's entry in the machine record (batched too), and for a control plane
// the Lease that serializes control-plane joins, and no bearer token exists that anyone could use to
// request a certificate for any node name.
//
// A control-plane ticket takes the control-plane slot (ControlPlaneLock) and hands it to the node's
// join (ControlPlaneSlot.Joining), which holds it until the join finished; a worker's never waits for
// it. With WithMachineRecord, a machine an operator removed (berth node remove) is refused with
// REVOKED on join and on rejoin, by the same identity its disk binding uses (see below), whatever
// name or address it has, and every machine admitted is recorded.
//
// A ticket carries the disk key of the state disk the node names (disk_uuid, a canonical UUID) for
// the attested machine (clusterkeys.DiskKey of that UUID and the machine's identity) and a disk
// binding (clusterkeys.DiskBinding) of that disk to the same identity. A rebooted node that cannot
// open its disk with its sealed key asks IssueRejoinTicket for the disk key with the disk's UUID and
// that binding; the disk key comes back only when the binding verifies for the identity of the
// machine asking, after the same attestation and instance checks as a join. So an attested member
// cannot get another node's disk key by naming its UUID: on rejoin it is refused (DISK_NOT_BOUND),
// and on join, which has nothing to check a UUID against (a fresh node's disk is bound by the
// ticket), it gets the key that UUID would have on its own machine, which opens nothing of
// anyone else's, and a binding to itself that the rejoin RPC honours for that key only. A disk bound
// before disk keys named the machine (a legacy binding) still gets its legacy key on rejoin, from
// its owner's binding only; the join RPC never hands out a legacy key. The ledger records the UUID
// each ticket call named.
//
// The machine's identity is attestation.Result.Identity when the variant has one and the peer's
// attestation key was activated in the handshake (TPM: the digest of the endorsement key, which
// only the machine holding it can activate against). Otherwise (TDX quotes carry no per-machine
// identity, or no attestation) it is "instance/" + the instance name metadata reports for the
// peer's address. That is a known weaker binding: it ties the disk to a name the platform gives an
// address, not to the hardware, so an attested machine that takes over a node's address and name
// also gets that node's disk key. IssueJoinTicket itself stays stateless: it derives the disk key for
// the UUID a fresh node names, which the genuine image only does for the disk it has just formatted.
//
// A control-plane ticket also carries the key-encryption keys of the KMS plugin every control plane
// runs (kms_keys): every generation of the cluster's key spec (internal/kmsstate), derived from the
// master secret, so the new control plane reads what the others stored, also during a rotation.
// Its control_plane_files hold, besides the PKI's shared keys, the files of the cluster
// configuration in force (ClusterFiles, internal/cpfiles): the admission configuration, the audit
// policy and the kubeadm patches, which the API server flags kubeadm uploaded name; a configuration
// the joinservice cannot read refuses the join.
//
// CheckIn judges the peer by a policy of its own (WithCheckInAttestation, CheckInPolicy): a node
// that booted on its sealed key while no joinservice answered checks in once it runs, with its lock
// register extended, so the check-in also admits this cluster's worker and control-plane lock values
// there. Join and rejoin keep requiring a fresh (zero) lock register.
//
// Every rejection is a gRPC status whose message
// states the reason and whose ErrorInfo detail carries a stable reason code (see the Reason* constants).
//
// Every attempt, accepted or rejected, goes to a Journal (the join ledger) and an Observer (metrics);
// neither may block the call.
//
// Rate limits (DefaultLimits, per RPC call, on top of atls's per-handshake limits): per peer address
// 1 ticket/s with a burst of 5, and 100 tickets/s with a burst of 200 overall; 4096 peer addresses are
// tracked. A node needs one ticket per join and its JoinClient retries with a backoff of about a
// second, so 1/s with burst 5 never slows a genuine node but stops one address from hammering the
// service over one connection (an attested handshake is paid once per connection, not per call). The
// global limit is the tickets budget and bounds what the tickets cost the control plane: a ticket is a
// CA signature and a ledger entry (written in batches); 100/s lets a 200-node scale-up through in
// about 2 s. Only a call that passed every cheap check (the policy on the handshake's verified
// evidence, metadata, the role, the revocation list, the disk binding) spends it: attested strangers
// at addresses metadata does not know, or machines of another image, are charged to a refused budget
// of their own, and calls without evidence to an unverified one (RefusalLimits), so that no number of
// them leaves a genuine node without its ticket. A call over its peer's limit or the unverified budget
// gets ResourceExhausted with reason RATE_LIMITED before any cryptography, metadata lookup or API
// call: its cost is one map lookup under a mutex. The limits are flags of the joinservice binary.
//
// An operator whose admin credential expired gets a new one from IssueAdminCredential (admin.go,
// berth kubeconfig): a cluster-admin client certificate for a key the operator generated, after an
// HMAC proof of the master secret over a nonce of AdminChallenge. The operator does not attest; the
// calls are charged to the peer and unverified budgets and go to the ledger like a join's.
package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// Reason codes of rejections.
const (
	ReasonNoEvidence       = "NO_EVIDENCE"
	ReasonMeasurements     = "MEASUREMENT_MISMATCH"
	ReasonUnknownPeer      = "UNKNOWN_PEER"
	ReasonRoleMismatch     = "ROLE_MISMATCH"
	ReasonBadCSR           = "BAD_CSR"
	ReasonRateLimited      = "RATE_LIMITED"
	ReasonControlPlaneBusy = "CONTROL_PLANE_JOIN_BUSY"
	ReasonBadDiskUUID      = "BAD_DISK_UUID"
	ReasonDiskNotBound     = "DISK_NOT_BOUND"
	ReasonInternal         = "INTERNAL"
	reasonDomain           = "berth.joinservice"
	kubeletCertValidity    = 365 * 24 * time.Hour
)

// GRPCServerOptions are the gRPC server options the joinservice serves with (besides its transport
// credentials). Stream workers handle calls on long-lived goroutines whose stacks have grown already,
// instead of a new goroutine per call that grows its stack again (a tenth of a rejection's CPU time
// in make bench-join's profile).
func GRPCServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.NumStreamWorkers(uint32(4 * runtime.GOMAXPROCS(0)))}
}

// Default rate limits of IssueJoinTicket and IssueRejoinTicket (see the package documentation).
var DefaultLimits = atls.Limits{PerPeer: 1, PerPeerBurst: 5, Global: 100, GlobalBurst: 200, MaxPeers: 4096}

// controlPlaneFiles are the shared control-plane keys a joining control plane needs, relative to the
// PKI directory.
var controlPlaneFiles = []string{
	"ca.crt", "ca.key", "sa.key", "sa.pub", "front-proxy-ca.crt", "front-proxy-ca.key", "etcd/ca.crt", "etcd/ca.key",
}

// Config configures the server.
type Config struct {
	// APIServerEndpoint is HOST:PORT of the API server that goes into tickets.
	APIServerEndpoint string
	// KubernetesVersion is the cluster's version.
	KubernetesVersion string
	// PKIDir is kubeadm's PKI directory on this control plane.
	PKIDir string
}

// Server implements joinproto.JoinServiceServer.
type Server struct {
	joinproto.UnimplementedJoinServiceServer

	cfg  Config
	log  *zap.Logger
	keys *clusterkeys.Keys
	salt []byte
	ca   *ca.Authority
	meta peerLister
	// attest judges the peer's attestation; nil accepts every peer (insecure-none).
	attest AttestationCheck
	// checkInAttest judges a check-in's attestation (WithCheckInAttestation); attest without it.
	checkInAttest AttestationCheck
	// cpLock serializes control-plane joins: etcd grows one member at a time.
	cpLock ControlPlaneLock
	// record knows the machines the cluster admitted and the ones an operator removed; nil: none.
	record MachineRecord
	// limits and refusalLimits configure budgets, the calls' rate limits (budget.go).
	limits        atls.Limits
	refusalLimits RefusalLimits
	budgets       *budgets
	journal       Journal
	obs           Observer
	admissions    Admissions
	// kmsSpec tells which KMS key generations a control-plane ticket carries.
	kmsSpec KMSSpec
	// clusterFiles are the cluster configuration's files a control-plane ticket carries.
	clusterFiles ClusterFiles
	// traces stores join traces (trace.go); joinedCheck judges a joined node's attestation.
	traces      TraceStore
	joinedCheck AttestationCheck
	// adminNonces are AdminChallenge's nonces (admin.go).
	adminNonces *adminNonces
	now         func() time.Time
}

// ClusterFiles returns the files the cluster configuration in force puts on every control plane
// (cpfiles.FromCluster): the admission configuration, the audit policy, the kubeadm patches.
type ClusterFiles func(ctx context.Context) ([]*joinproto.File, error)

// KMSSpec returns the cluster's KMS key spec (kmsstate.Read): which generations of the control planes'
// key-encryption key a joining control plane gets, and which one is active.
type KMSSpec func(ctx context.Context) (kmsstate.Spec, error)

// AttestationCheck judges the attestation of the peer in ctx against the cluster's policy. It returns
// the policy's warnings, or an error: ErrNoEvidence when the peer did not attest, otherwise an error
// whose text names what deviated (index, expected, actual).
type AttestationCheck func(ctx context.Context) (warnings []string, err error)

// ErrNoEvidence is returned by an AttestationCheck for a peer that presented no attestation.
var ErrNoEvidence = errors.New("peer presented no attestation")

// Journal records join attempts (ledger.Writer). Both methods must return at once.
type Journal interface {
	Record(ledger.Entry)
	RecordRateLimited(peer string)
}

// Observer receives measurements (the metrics package). Methods must return at once.
type Observer interface {
	// Attempt counts one finished attempt of rpc ("join", "rejoin") with its outcome and reason.
	Attempt(rpc, outcome, reason string)
	// Latency records how long stage ("validate", "issue", "total") of rpc took.
	Latency(rpc, stage string, d time.Duration)
	// InFlight adds delta to the number of attempts being handled.
	InFlight(delta int)
}

// Option configures a Server.
type Option func(*Server)

// WithJournal records every attempt in j.
func WithJournal(j Journal) Option { return func(s *Server) { s.journal = j } }

// WithObserver reports measurements to o.
func WithObserver(o Observer) Option { return func(s *Server) { s.obs = o } }

// WithLimits replaces DefaultLimits.
func WithLimits(l atls.Limits) Option { return func(s *Server) { s.limits = l } }

// WithRefusalLimits replaces DefaultRefusalLimits; the zero value keeps them.
func WithRefusalLimits(l RefusalLimits) Option {
	return func(s *Server) {
		if l != (RefusalLimits{}) {
			s.refusalLimits = l
		}
	}
}

// WithCheckInAttestation judges the attestation of a check-in (CheckIn) with check instead of the
// server's AttestationCheck: CheckInPolicy's Check, which admits, besides a fresh node's lock
// register, this cluster's lock values of a node that booted. Join and rejoin keep the server's.
func WithCheckInAttestation(check AttestationCheck) Option {
	return func(s *Server) { s.checkInAttest = check }
}

// WithControlPlaneLock replaces the in-process lock that serializes control-plane joins.
func WithControlPlaneLock(l ControlPlaneLock) Option { return func(s *Server) { s.cpLock = l } }

// WithKMSSpec reads the KMS key spec from f; without it a control-plane ticket carries the spec of a
// cluster that never rotated its key (kmsstate.DefaultSpec).
func WithKMSSpec(f KMSSpec) Option { return func(s *Server) { s.kmsSpec = f } }

// WithClusterFiles reads the cluster configuration's files from f; without it a control-plane
// ticket carries none, and the joining node writes Berth's admission configuration alone.
func WithClusterFiles(f ClusterFiles) Option { return func(s *Server) { s.clusterFiles = f } }

// New returns a Server. attest may be nil only when the service runs without attestation.
func New(cfg Config, log *zap.Logger, keys *clusterkeys.Keys, salt []byte, authority *ca.Authority, meta peerLister, attest AttestationCheck, opts ...Option) *Server {
	s := &Server{cfg: cfg, log: log, keys: keys, salt: salt, ca: authority, meta: meta, attest: attest,
		limits: DefaultLimits, refusalLimits: DefaultRefusalLimits, adminNonces: newAdminNonces(), now: time.Now}
	for _, o := range opts {
		o(s)
	}
	s.budgets = newBudgets(s.limits, s.refusalLimits)
	if s.checkInAttest == nil {
		s.checkInAttest = s.attest
	}
	if s.cpLock == nil {
		s.cpLock = NewLocalLock()
	}
	if s.journal == nil {
		s.journal = nopJournal{}
	}
	if s.obs == nil {
		s.obs = nopObserver{}
	}
	if s.clusterFiles == nil {
		s.clusterFiles = func(context.Context) ([]*joinproto.File, error) { return nil, nil }
	}
	if s.kmsSpec == nil {
		s.kmsSpec = func(context.Context) (kmsstate.Spec, error) { return kmsstate.DefaultSpec(), nil }
	}
	return s
}

type nopJournal struct{}

func (nopJournal) Record(ledger.Entry)      {}
func (nopJournal) RecordRateLimited(string) {}

type nopObserver struct{}

func (nopObserver) Attempt(string, string, string)        {}
func (nopObserver) Latency(string, string, time.Duration) {}
func (nopObserver) InFlight(int)                          {}

// rejection is a refused attempt: a gRPC status with an ErrorInfo reason.
type rejection struct {
	code   codes.Code
	reason string
	msg    string
}

func (r *rejection) Error() string { return r.msg }

// GRPCStatus lets gRPC send the rejection with its reason.
func (r *rejection) GRPCStatus() *status.Status {
	st, err := status.New(r.code, r.msg).WithDetails(&errdetails.ErrorInfo{Reason: r.reason, Domain: reasonDomain})
	if err != nil {
		return status.New(r.code, r.msg)
	}
	return st
}

func reject(code codes.Code, reason, msg string) error {
	return &rejection{code: code, reason: reason, msg: msg}
}

// checkAttestation applies the attestation check, if any, and turns a failure into a rejection.
func (s *Server) checkAttestation(ctx context.Context, log *callLog) error {
	return checkAttestationWith(ctx, s.attest, log)
}

// checkAttestationWith applies check, if any, and turns a failure into a rejection.
func checkAttestationWith(ctx context.Context, check AttestationCheck, log *callLog) error {
	if check == nil {
		return nil
	}
	warnings, err := check(ctx)
	if errors.Is(err, ErrNoEvidence) {
		log.Warn("join rejected", zap.String("reason", ReasonNoEvidence))
		return reject(codes.Unauthenticated, ReasonNoEvidence, "no attestation: connect with attested TLS")
	}
	if err != nil {
		log.Warn("join rejected", zap.String("reason", ReasonMeasurements), zap.Error(err))
		return reject(codes.PermissionDenied, ReasonMeasurements, err.Error())
	}
	for _, w := range warnings {
		log.Warn("attestation warning", zap.String("warning", w))
	}
	return nil
}

// callLog logs for one call with the call's fields, which are encoded only into lines that are
// written (zap's With encodes them at once, for every call, even when sampling drops every line).
type callLog struct {
	log    *zap.Logger
	fields []zap.Field
}

func (c *callLog) with(f ...zap.Field) { c.fields = append(c.fields, f...) }

func (c *callLog) write(level zapcore.Level, msg string, f []zap.Field) {
	if ce := c.log.Check(level, msg); ce != nil {
		ce.Write(append(c.fields[:len(c.fields):len(c.fields)], f...)...)
	}
}

func (c *callLog) Info(msg string, f ...zap.Field)  { c.write(zapcore.InfoLevel, msg, f) }
func (c *callLog) Warn(msg string, f ...zap.Field)  { c.write(zapcore.WarnLevel, msg, f) }
func (c *callLog) Error(msg string, f ...zap.Field) { c.write(zapcore.ErrorLevel, msg, f) }

// attempt is what the ledger and the metrics learn about one call.
type attempt struct {
	rpc   string
	start time.Time
	entry ledger.Entry
	// limited: the tickets budget refused the call.
	limited bool
	// evidence is the peer's verified attestation; nil without.
	evidence *atls.Evidence
}

// begin rate-limits the call and opens its attempt. A non-nil error is the rejection to return: it
// costs a map lookup, before any cryptography or API call. The call is charged to its peer, and a call
// without attestation evidence to the unverified budget; the tickets budget is charged later
// (chargeTicket), once the call passed the cheap checks.
func (s *Server) begin(ctx context.Context, rpc string, role joinproto.Role) (*attempt, net.IP, error) {
	ip := peerIP(ctx)
	peerKey := "unknown"
	if ip != nil {
		peerKey = ip.String()
	}
	ev, verified := atls.PeerEvidence(ctx)
	if !s.budgets.peers.AllowPeer(peerKey) || s.attest != nil && !verified && !s.budgets.unverified.Allow() {
		return nil, nil, s.rateLimited(rpc, peerKey)
	}
	s.obs.InFlight(1)
	a := &attempt{rpc: rpc, start: time.Now(), entry: ledger.Entry{Peer: peerKey, RPC: rpc}, evidence: evidenceOf(ev, verified)}
	if rpc == "join" {
		a.entry.Role = roleName(role)
	}
	if verified {
		sum := sha256.Sum256(ev.Document)
		a.entry.EvidenceSHA256 = hex.EncodeToString(sum[:])
	}
	return a, ip, nil
}

// rateLimited counts a call refused by a budget and returns its rejection.
func (s *Server) rateLimited(rpc, peer string) error {
	s.journal.RecordRateLimited(peer)
	s.obs.Attempt(rpc, ledger.OutcomeRejected, ReasonRateLimited)
	return reject(codes.ResourceExhausted, ReasonRateLimited, "too many join attempts: retry later")
}

// chargeTicket charges a call that passed every cheap check to the tickets budget; a non-nil error
// is the rejection to return.
func (s *Server) chargeTicket(a *attempt) error {
	if s.budgets.tickets.Allow() {
		return nil
	}
	a.limited = true
	return reject(codes.ResourceExhausted, ReasonRateLimited, "too many join attempts: retry later")
}

// finish records the attempt's outcome. A refusal is charged to the refused budget (attested peers)
// or was charged to the unverified one (begin); one beyond the refused budget is counted as
// rate-limited instead of recorded as its own entry.
func (s *Server) finish(a *attempt, err error) {
	d := time.Since(a.start)
	s.obs.InFlight(-1)
	s.obs.Latency(a.rpc, "total", d)
	a.entry.Time = a.start.UTC()
	a.entry.Outcome = ledger.OutcomeAccepted
	reason := ""
	if err != nil {
		a.entry.Outcome = ledger.OutcomeRejected
		var r *rejection
		if errors.As(err, &r) {
			reason, a.entry.Message = r.reason, r.msg
		} else {
			reason, a.entry.Message = ReasonInternal, "internal error"
		}
		a.entry.Reason = reason
	}
	a.entry.Kind = entryKind(a.entry)
	s.obs.Attempt(a.rpc, a.entry.Outcome, reason)
	if a.limited || err != nil && a.entry.EvidenceSHA256 != "" && !s.budgets.refused.Allow() {
		s.journal.RecordRateLimited(a.entry.Peer)
		return
	}
	s.journal.Record(a.entry)
	if err == nil {
		s.recordAdmission(a)
	}
}

// entryKind is the ledger kind of a finished call: a refusal of a peer whose attestation verified
// in the handshake (its evidence digest is known) is evidence, kept apart from refusals of peers
// that proved nothing.
func entryKind(e ledger.Entry) string {
	switch {
	case e.Outcome == ledger.OutcomeAccepted:
		return joinledger.KindAccepted
	case e.EvidenceSHA256 != "" && e.Reason != ReasonNoEvidence && e.Reason != ReasonRateLimited:
		return joinledger.KindEvidence
	default:
		return joinledger.KindUnverified
	}
}

func roleName(r joinproto.Role) string {
	switch r {
	case joinproto.Role_ROLE_WORKER:
		return "worker"
	case joinproto.Role_ROLE_CONTROL_PLANE:
		return "control-plane"
	}
	return r.String()
}

// IssueJoinTicket implements the RPC.
func (s *Server) IssueJoinTicket(ctx context.Context, req *joinproto.IssueJoinTicketRequest) (resp *joinproto.IssueJoinTicketResponse, err error) {
	a, peerIP, err := s.begin(ctx, "join", req.GetRole())
	if err != nil {
		return nil, err
	}
	defer func() { s.finish(a, err) }()
	log := &callLog{log: s.log, fields: []zap.Field{zap.String("peer", a.entry.Peer), zap.Stringer("claimedRole", req.GetRole())}}
	if err := s.checkAttestation(ctx, log); err != nil {
		return nil, err
	}
	inst, err := s.instanceFor(ctx, peerIP)
	if err != nil {
		log.Warn("join rejected", zap.String("reason", ReasonUnknownPeer), zap.Error(err))
		return nil, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster")
	}
	a.entry.Node = inst.Name
	log.with(zap.String("node", inst.Name))
	wantRole := joinproto.Role_ROLE_WORKER
	if inst.Role == metadata.RoleControlPlane {
		wantRole = joinproto.Role_ROLE_CONTROL_PLANE
	}
	if req.GetRole() != wantRole {
		log.Warn("join rejected", zap.String("reason", ReasonRoleMismatch))
		return nil, reject(codes.PermissionDenied, ReasonRoleMismatch,
			fmt.Sprintf("role %s requested, metadata says this node is a %s", req.GetRole(), inst.Role))
	}
	if err := checkDiskUUID(req.GetDiskUuid(), log); err != nil {
		return nil, err
	}
	a.entry.DiskUUID = strings.ToLower(req.GetDiskUuid())
	identity, source := peerIdentity(ctx, inst)
	a.entry.Identity = recordIdentity(ctx, inst)
	if err := s.checkRevoked(a.entry.Identity, "join", log); err != nil {
		return nil, err
	}
	if err := s.chargeTicket(a); err != nil {
		return nil, err
	}
	s.obs.Latency("join", "validate", time.Since(a.start))
	issueStart := time.Now()
	var ips []net.IP
	for _, ip := range inst.IPs {
		ips = append(ips, net.ParseIP(ip))
	}
	cert, err := s.ca.SignKubeletClient(req.GetKubeletCsr(), inst.Name, ips, kubeletCertValidity)
	if err != nil {
		log.Warn("join rejected", zap.String("reason", ReasonBadCSR), zap.Error(err))
		return nil, reject(codes.InvalidArgument, ReasonBadCSR, "the kubelet CSR does not parse or its key cannot be certified")
	}
	var files []*joinproto.File
	var kmsKeys []*joinproto.KMSKey
	var kmsActive uint32
	if wantRole == joinproto.Role_ROLE_CONTROL_PLANE {
		if files, err = s.controlPlaneSlot(ctx, a, inst, log); err != nil {
			return nil, err
		}
		// Every generation the control planes hold: the new one must read what the others stored.
		spec, err := s.kmsSpec(ctx)
		if err == nil {
			err = spec.Validate()
		}
		if err != nil {
			log.Error("reading the KMS key spec", zap.Error(err))
			return nil, reject(codes.Unavailable, ReasonInternal, "the joinservice cannot read the KMS key spec")
		}
		for _, g := range spec.Generations {
			kmsKeys = append(kmsKeys, &joinproto.KMSKey{Generation: g, Key: s.keys.KMSKey(g)})
		}
		kmsActive = spec.Active
	}
	// No bootstrap token (see the package documentation): the node joins with the CA and certificate.
	s.obs.Latency("join", "issue", time.Since(issueStart))
	s.admit(a.entry.Identity, inst)
	log.Info("join ticket issued", zap.String("identitySource", source))
	return &joinproto.IssueJoinTicketResponse{
		NodeName:                   inst.Name,
		ApiServerEndpoint:          s.cfg.APIServerEndpoint,
		DiscoveryTokenCaCertHashes: []string{s.ca.Pin()},
		KubeletCert:                cert,
		ClusterCaCert:              s.ca.CertPEM(),
		ControlPlaneFiles:          files,
		KubernetesVersion:          s.cfg.KubernetesVersion,
		ClusterId:                  s.keys.ClusterID(),
		DiskKey:                    s.keys.DiskKey(req.GetDiskUuid(), identity),
		MeasurementSalt:            s.salt,
		DiskBinding:                s.keys.DiskBinding(req.GetDiskUuid(), identity),
		KmsKeys:                    kmsKeys,
		KmsActiveGeneration:        kmsActive,
	}, nil
}

// IssueRejoinTicket implements the RPC.
func (s *Server) IssueRejoinTicket(ctx context.Context, req *joinproto.IssueRejoinTicketRequest) (resp *joinproto.IssueRejoinTicketResponse, err error) {
	a, peerIP, err := s.begin(ctx, "rejoin", joinproto.Role_ROLE_UNSPECIFIED)
	if err != nil {
		return nil, err
	}
	defer func() { s.finish(a, err) }()
	log := &callLog{log: s.log, fields: []zap.Field{zap.String("peer", a.entry.Peer)}}
	if err := s.checkAttestation(ctx, log); err != nil {
		return nil, err
	}
	inst, err := s.instanceFor(ctx, peerIP)
	if err != nil {
		log.Warn("rejoin rejected", zap.String("reason", ReasonUnknownPeer), zap.Error(err))
		return nil, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster")
	}
	a.entry.Node = inst.Name
	log.with(zap.String("node", inst.Name))
	if err := checkDiskUUID(req.GetDiskUuid(), log); err != nil {
		return nil, err
	}
	a.entry.DiskUUID = strings.ToLower(req.GetDiskUuid())
	identity, source := peerIdentity(ctx, inst)
	a.entry.Identity = recordIdentity(ctx, inst)
	if err := s.checkRevoked(a.entry.Identity, "rejoin", log); err != nil {
		return nil, err
	}
	diskKey, bound := s.keys.BoundDiskKey(req.GetDiskUuid(), identity, req.GetDiskBinding())
	if !bound {
		log.Warn("rejoin rejected", zap.String("reason", ReasonDiskNotBound), zap.String("identitySource", source))
		return nil, reject(codes.PermissionDenied, ReasonDiskNotBound, "this disk does not belong to the attested machine")
	}
	if err := s.chargeTicket(a); err != nil {
		return nil, err
	}
	s.obs.Latency("rejoin", "validate", time.Since(a.start))
	log.Info("rejoin ticket issued", zap.String("identitySource", source))
	return &joinproto.IssueRejoinTicketResponse{DiskKey: diskKey, ClusterId: s.keys.ClusterID()}, nil
}

// CheckIn implements the RPC: a joined node that opened its state disk with its own sealed key asks
// whether it may run: before its kubelet starts, or, when no joinservice answered during its boot (a
// full power cut), while it runs (its lock register extended then: WithCheckInAttestation admits this
// cluster's lock values for this RPC alone). It is admitted (its attested instance name in the
// answer) unless an operator removed the machine (REVOKED, in the ledger with the machine's identity,
// node and disk). It hands out nothing, so it charges no tickets budget; refusals are charged like
// every other call's (begin, finish).
func (s *Server) CheckIn(ctx context.Context, req *joinproto.CheckInRequest) (resp *joinproto.CheckInResponse, err error) {
	a, peerIP, err := s.begin(ctx, RPCCheckIn, joinproto.Role_ROLE_UNSPECIFIED)
	if err != nil {
		return nil, err
	}
	defer func() { s.finish(a, err) }()
	log := &callLog{log: s.log, fields: []zap.Field{zap.String("peer", a.entry.Peer)}}
	// The check-in's own judgement: a node that booted has extended its lock register with this
	// cluster's lock value (CheckInPolicy); everything else as for a join.
	if err := checkAttestationWith(ctx, s.checkInAttest, log); err != nil {
		return nil, err
	}
	inst, err := s.instanceFor(ctx, peerIP)
	if err != nil {
		log.Warn("check-in rejected", zap.String("reason", ReasonUnknownPeer), zap.Error(err))
		return nil, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster")
	}
	a.entry.Node = inst.Name
	log.with(zap.String("node", inst.Name))
	if err := checkDiskUUID(req.GetDiskUuid(), log); err != nil {
		return nil, err
	}
	a.entry.DiskUUID = strings.ToLower(req.GetDiskUuid())
	if !bytes.Equal(req.GetClusterId(), s.keys.ClusterID()) {
		log.Warn("check-in rejected", zap.String("reason", ReasonWrongCluster))
		return nil, reject(codes.PermissionDenied, ReasonWrongCluster, "this node joined another cluster")
	}
	a.entry.Identity = recordIdentity(ctx, inst)
	if err := s.checkRevoked(a.entry.Identity, "check-in", log); err != nil {
		return nil, err
	}
	log.Info("node checked in")
	return &joinproto.CheckInResponse{NodeName: inst.Name}, nil
}

// Sources of a peer's identity (see the package documentation), for the logs.
const (
	identityAttested = "attested"
	identityInstance = "instance"
)

// peerIdentity is the identity a disk binding ties a disk to: the attested machine identity when the
// peer's attestation key was activated and its variant has one, else "instance/" + inst's name.
func peerIdentity(ctx context.Context, inst metadata.Instance) (identity []byte, source string) {
	if ev, ok := atls.PeerEvidence(ctx); ok && ev.Activated && len(ev.Result.Identity) > 0 {
		return ev.Result.Identity, identityAttested
	}
	return []byte("instance/" + inst.Name), identityInstance
}

// checkDiskUUID refuses a disk UUID that is not canonical: 8-4-4-4-12 hexadecimal digits.
func checkDiskUUID(u string, log *callLog) error {
	if canonicalUUID(u) {
		return nil
	}
	log.Warn("ticket rejected", zap.String("reason", ReasonBadDiskUUID))
	return reject(codes.InvalidArgument, ReasonBadDiskUUID, "disk_uuid is not a canonical UUID (8-4-4-4-12 hexadecimal digits)")
}

func isHexDigit(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func canonicalUUID(u string) bool {
	if len(u) != 36 {
		return false
	}
	for i := 0; i < len(u); i++ {
		c := u[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !isHexDigit(c) {
				return false
			}
		}
	}
	return true
}

func (s *Server) instanceFor(ctx context.Context, ip net.IP) (metadata.Instance, error) {
	if ip == nil {
		return metadata.Instance{}, errors.New("no peer address")
	}
	peers, err := s.meta.Peers(ctx)
	if err != nil {
		return metadata.Instance{}, fmt.Errorf("listing instances: %w", err)
	}
	for _, p := range peers {
		if p.HasIP(ip) {
			return p, nil
		}
	}
	return metadata.Instance{}, fmt.Errorf("no instance has address %s", ip)
}

func (s *Server) readControlPlaneFiles() ([]*joinproto.File, error) {
	var files []*joinproto.File
	for _, name := range controlPlaneFiles {
		data, err := os.ReadFile(filepath.Join(s.cfg.PKIDir, filepath.FromSlash(name)))
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", name, err)
		}
		mode := uint32(0o600)
		if strings.HasSuffix(name, ".crt") || strings.HasSuffix(name, ".pub") {
			mode = 0o644
		}
		files = append(files, &joinproto.File{Path: name, Data: data, Mode: mode})
	}
	return files, nil
}

func peerIP(ctx context.Context) net.IP {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return nil
	}
	host, _, err := net.SplitHostPort(p.Addr.String())
	if err != nil {
		return nil
	}
	return net.ParseIP(host)
}

// peerLister lists the cluster's instances.
type peerLister interface {
	Peers(ctx context.Context) ([]metadata.Instance, error)
}
