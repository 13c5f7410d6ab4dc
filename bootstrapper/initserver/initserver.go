// Package initserver serves the Init RPC on a fresh node: it checks the caller's init secret before
// anything else, takes the node lock, runs the init phases and streams their progress and output
// back to `berth init`.
//
// Init's outcomes, by node state:
//
//	node state                         wrong init secret   right init secret
//	fresh                              PERMISSION_DENIED   lock, run every phase
//	init running                       PERMISSION_DENIED   InitFailure BUSY
//	init finished                      PERMISSION_DENIED   InitFailure ALREADY_INITIALIZED
//	init failed at phase P (same IDs)  PERMISSION_DENIED   resume at P (earlier phases SKIPPED)
//	init failed, other master secret   PERMISSION_DENIED   InitFailure CLUSTER_MISMATCH
//	joined another cluster             PERMISSION_DENIED   InitFailure NODE_LOCKED
//
// A caller without the init secret learns nothing: the same status and message for every reason.
//
// Before the secret is looked at, a caller is rate-limited per peer address (DefaultLimits: one
// Init a second with a burst of 5): an excess call gets RESOURCE_EXHAUSTED "too many init requests:
// retry later" and costs a map lookup. Wrong secrets are then answered from a budget of their own (5
// a second with a burst of 10 from all peers together; beyond it, RESOURCE_EXHAUSTED again), which a
// caller with the right secret never draws from: callers without the secret at any number of
// addresses cannot keep `berth init` out.
// A 32-byte init secret cannot be guessed either way; the limit keeps a peer that holds an attested
// connection from turning the node's log and CPU into its guessing machine (unlimited, one
// connection carried about 3,600 guesses a second, each logged). Rejections are logged sampled per
// peer: the first, then one line at most every rejectLogInterval with the number in between.
//
// Restore is Init with a sealed etcd snapshot (restore.go): its first message is Init's request,
// checked the same way before a byte of the snapshot is read; the snapshot's chunks follow, and the
// node opens the whole file with the request's master secret before it takes the node lock, so that
// another cluster's or a damaged snapshot leaves the node fresh (INVALID_REQUEST). A node whose
// unfinished attempt was a restore resumes only as a restore.
//
// Everything in the request is checked before the node lock is taken: the fields (names, versions,
// CIDRs, the API server's certificate SANs, the cluster's attestation policy and image policy must
// parse), and the node's role in metadata (a node that metadata calls a worker answers
// NOT_CONTROL_PLANE and stays fresh, so it can still join its cluster).
package initserver

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/serve"
	"github.com/berth-k8s/berth/internal/webhook"
	"github.com/berth-k8s/berth/nodelock"
)

// LockOwner is the owner name the InitServer takes the node lock with.
const LockOwner = "init"

// errRejected is the one answer for a caller without the right init secret.
var errRejected = status.Error(codes.PermissionDenied, "init request rejected")

// errRateLimited is the answer to a call over the rate limit, before anything is looked at.
var errRateLimited = status.Error(codes.ResourceExhausted, "too many init requests: retry later")

// DefaultLimits bound Init calls per peer address (PerPeer) and wrong secrets from all peers together
// (Global) (see the package documentation).
var DefaultLimits = atls.Limits{PerPeer: 1, PerPeerBurst: 5, Global: 5, GlobalBurst: 10, MaxPeers: 1024}

// Server implements initproto.InitServiceServer.
type Server struct {
	initproto.UnimplementedInitServiceServer

	log    *zap.Logger
	lock   locker
	hashes initSecretHasher
	init   clusterInitializer
	state  stateStore
	opts   []grpc.ServerOption
	now    func() time.Time

	// running serializes Init calls; a second concurrent call gets BUSY.
	running sync.Mutex
	// onSuccess runs once after a successful init.
	onSuccess func()
	// disk is the state disk to bind; nil when the node has none.
	disk diskBinder
	// limiter bounds Init calls per peer; refused bounds the answers to wrong secrets.
	limiter *atls.Limiter
	refused *rate.Limiter
	limits  atls.Limits
	// rejects samples the log lines of rejected calls per peer.
	rejects *rejectLog
	// snapshotDir receives a Restore's snapshot.
	snapshotDir string
}

// Option configures a Server.
type Option func(*Server)

// WithServerOptions sets the gRPC server options (credentials, keepalive).
func WithServerOptions(opts ...grpc.ServerOption) Option {
	return func(s *Server) { s.opts = append(s.opts, opts...) }
}

// WithDisk makes Init bind the node's state disk to the new cluster right after it took the node
// lock (and again, idempotently, when an init resumes).
func WithDisk(d diskBinder) Option { return func(s *Server) { s.disk = d } }

// diskBinder re-keys the node's fresh state disk to the cluster's disk key (bootstage.Stage).
type diskBinder interface {
	BindWithKeys(ctx context.Context, keys *clusterkeys.Keys) error
}

// WithLimits replaces DefaultLimits.
func WithLimits(l atls.Limits) Option { return func(s *Server) { s.limits = l } }

// WithOnSuccess sets a function that runs once after init succeeded.
func WithOnSuccess(f func()) Option { return func(s *Server) { s.onSuccess = f } }

// New returns a Server.
func New(log *zap.Logger, lock locker, hashes initSecretHasher, init clusterInitializer, state stateStore, opts ...Option) *Server {
	s := &Server{log: log, lock: lock, hashes: hashes, init: init, state: state, now: time.Now, limits: DefaultLimits}
	for _, o := range opts {
		o(s)
	}
	s.limiter = atls.NewLimiter(s.limits)
	s.refused = rate.NewLimiter(s.limits.Global, s.limits.GlobalBurst)
	s.rejects = newRejectLog(log, s.now)
	return s
}

// gracefulStopTimeout bounds how long Serve lets a running Init finish after ctx ended before it
// closes every connection.
const gracefulStopTimeout = 30 * time.Second

// Serve serves Init on lis until ctx ends, then stops gracefully (a running Init may finish) and
// closes lis. It returns once every goroutine it started is gone.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	srv := grpc.NewServer(s.opts...)
	initproto.RegisterInitServiceServer(srv, s)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	s.log.Info("init server listening", zap.String("address", lis.Addr().String()))
	select {
	case err := <-errc:
		return fmt.Errorf("serving init: %w", err)
	case <-ctx.Done():
	}
	serve.StopGRPC(srv, gracefulStopTimeout)
	// Serve returns nil once stopped; an error here failed the server while the stop was under way.
	if err := <-errc; err != nil {
		s.log.Warn("init server failed while stopping", zap.Error(err))
	}
	s.log.Info("init server stopped")
	return nil
}

// Init implements the Init RPC.
func (s *Server) Init(req *initproto.InitRequest, stream initproto.InitService_InitServer) error {
	ctx := stream.Context()
	if !s.allowPeer(ctx) {
		return errRateLimited
	}
	if err := s.admit(ctx, req); err != nil {
		return err
	}
	log := s.log.With(zap.String("peer", atls.PeerAddr(ctx)))
	log.Info("init request accepted")
	return s.run(ctx, log, req, &sender{stream: stream, now: s.now}, nil)
}

// allowPeer applies the per-peer rate limit, before anything of the call is looked at.
func (s *Server) allowPeer(ctx context.Context) bool {
	peerHost := atls.PeerHost(ctx)
	if !s.limiter.AllowPeer(peerHost) {
		s.rejects.note(peerHost, reasonRateLimited)
		return false
	}
	return true
}

// admit checks req's init secret (a missing request is a wrong secret): nil, errRejected, or
// errRateLimited when the budget of wrong secrets is spent.
func (s *Server) admit(ctx context.Context, req *initproto.InitRequest) error {
	if req != nil && s.secretMatches(ctx, req.GetInitSecret()) {
		return nil
	}
	peerHost := atls.PeerHost(ctx)
	if !s.refused.Allow() {
		s.rejects.note(peerHost, reasonRateLimited)
		return errRateLimited
	}
	s.rejects.note(peerHost, reasonWrongSecret)
	return errRejected
}

// run is Init after the init secret matched; snapshot, for a Restore, receives the sealed snapshot
// once the request is known to be valid for this node and opens it before the node lock is taken.
func (s *Server) run(ctx context.Context, log *zap.Logger, req *initproto.InitRequest, send *sender, snapshot snapshotReceiver) error {

	if !s.running.TryLock() {
		return send.failure(initproto.FailureCode_FAILURE_CODE_BUSY, "another init is running on this node", "", true)
	}
	defer s.running.Unlock()

	parsed, err := parseRequest(req)
	if err != nil {
		return send.failure(initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST, err.Error(), "", false)
	}
	clusterID := parsed.Keys.ClusterID()
	idHex := hex.EncodeToString(clusterID)

	st, err := s.state.Load()
	if err != nil {
		log.Error("reading node state", zap.Error(err))
		return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "reading the node's state failed; see the node's log", "", true)
	}
	switch {
	case st != nil && st.Role != nodestate.RoleInit:
		return send.failure(initproto.FailureCode_FAILURE_CODE_NODE_LOCKED, "this node joined a cluster; it cannot initialize one", "", false)
	case st != nil && st.Done:
		return send.failure(initproto.FailureCode_FAILURE_CODE_ALREADY_INITIALIZED, "this node already initialized its cluster", "", false)
	case st != nil && st.ClusterID != idHex:
		return send.failure(initproto.FailureCode_FAILURE_CODE_CLUSTER_MISMATCH,
			"this node is already initializing a cluster with other secrets; retry with the master secret and salt of the first attempt", "", false)
	}
	// What the node is, before the lock: a node that metadata does not call a control plane must stay
	// fresh, so that it can still join its cluster.
	job := &initcluster.Job{Req: parsed, Out: send.logWriter(log)}
	if err := s.init.Prepare(ctx, job); err != nil {
		if errors.Is(err, initcluster.ErrNotControlPlane) {
			log.Warn("init refused: not a control plane", zap.Error(err))
			return send.failure(initproto.FailureCode_FAILURE_CODE_NOT_CONTROL_PLANE, err.Error()+"; nothing was changed on the node", "", false)
		}
		log.Error("preparing init", zap.Error(err))
		return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "preparing init: "+err.Error(), "", true)
	}
	if st != nil && st.Completed(initcluster.PhaseRestoreEtcd) && snapshot == nil {
		return send.failure(initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST,
			"this node is restoring a cluster from a snapshot; resume with berth restore and the same snapshot", "", false)
	}
	if snapshot != nil {
		restore, cleanup, err := snapshot(ctx, parsed)
		if err != nil {
			return send.restoreFailure(log, err)
		}
		defer cleanup()
		job.Req.Restore = restore
		_, _ = fmt.Fprintf(job.Out, "[berth] received the snapshot of cluster %s taken %s; it opens with the request's master secret\n",
			restore.Manifest.ClusterID, restore.Manifest.Taken.UTC().Format(time.RFC3339))
	}
	if st == nil {
		if err := s.lock.TryLockOnce(ctx, LockOwner, clusterID); err != nil {
			if errors.Is(err, nodelock.ErrLocked) {
				return send.failure(initproto.FailureCode_FAILURE_CODE_NODE_LOCKED, "this node is joining or has joined a cluster; it cannot initialize one", "", false)
			}
			log.Error("taking node lock", zap.Error(err))
			return send.failure(initproto.FailureCode_FAILURE_CODE_NODE_LOCKED, "taking the node lock failed; the node cannot be used until it is reset", "", false)
		}
		st = &nodestate.State{Role: nodestate.RoleInit, ClusterID: idHex}
		if err := s.state.Save(st); err != nil {
			log.Error("saving node state", zap.Error(err))
			return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "saving the node's state failed; see the node's log", "", true)
		}
		log.Info("node locked for init", zap.String("clusterID", idHex))
	} else {
		log.Info("resuming init", zap.Strings("completed", st.CompletedPhases))
	}

	if s.disk != nil {
		if err := s.disk.BindWithKeys(ctx, parsed.Keys); err != nil {
			log.Error("binding the state disk to the cluster", zap.Error(err))
			return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "binding the node's state disk to the cluster failed; see the node's log", "", true)
		}
	}
	phases := s.init.Phases(snapshot != nil)
	for n, phase := range phases {
		idx := uint32(n + 1)
		if st.Completed(phase.Name) && phase.Name != initcluster.PhaseAdminKubeconfig {
			if err := send.progress(phase.Name, initproto.PhaseState_PHASE_STATE_SKIPPED, "done in an earlier attempt", idx, len(phases)); err != nil {
				return err
			}
			continue
		}
		if err := send.progress(phase.Name, initproto.PhaseState_PHASE_STATE_STARTED, "", idx, len(phases)); err != nil {
			return err
		}
		start := s.now()
		log.Info("phase started", zap.String("phase", phase.Name))
		if err := phase.Run(ctx, job); err != nil {
			log.Error("phase failed", zap.String("phase", phase.Name), zap.Error(err))
			_ = send.progress(phase.Name, initproto.PhaseState_PHASE_STATE_FAILED, err.Error(), idx, len(phases))
			return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED,
				fmt.Sprintf("phase %s failed: %v", phase.Name, err), phase.Name, true)
		}
		took := s.now().Sub(start).Round(time.Millisecond)
		log.Info("phase succeeded", zap.String("phase", phase.Name), zap.Duration("took", took))
		st.CompletedPhases = append(st.CompletedPhases, phase.Name)
		if err := s.state.Save(st); err != nil {
			log.Error("saving node state", zap.Error(err))
			return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "saving the node's state failed; see the node's log", phase.Name, true)
		}
		if err := send.progress(phase.Name, initproto.PhaseState_PHASE_STATE_SUCCEEDED, "took "+took.String(), idx, len(phases)); err != nil {
			return err
		}
	}
	st.Done = true
	if err := s.state.Save(st); err != nil {
		log.Error("saving node state", zap.Error(err))
		return send.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "saving the node's state failed; see the node's log", "", true)
	}
	log.Info("init succeeded", zap.String("clusterID", idHex))
	if s.onSuccess != nil {
		s.onSuccess()
	}
	return send.send(&initproto.InitResponse{Kind: &initproto.InitResponse_Success{Success: &initproto.InitSuccess{
		Kubeconfig: job.Kubeconfig,
		ClusterId:  clusterID,
	}}})
}

// secretMatches compares SHA-256(secret) with the hash from metadata in constant time. A missing
// hash matches nothing.
func (s *Server) secretMatches(ctx context.Context, secret []byte) bool {
	want, err := s.hashes.InitSecretHash(ctx)
	if err != nil || len(want) != sha256.Size {
		s.log.Warn("init secret hash unavailable", zap.Error(err))
		return false
	}
	got := sha256.Sum256(secret)
	return subtle.ConstantTimeCompare(got[:], want) == 1
}

var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

var kubeVersion = regexp.MustCompile(`^v1\.[0-9]+\.[0-9]+$`)

// parseRequest validates the request's fields and names the first bad one.
func parseRequest(req *initproto.InitRequest) (initcluster.Request, error) {
	keys, err := clusterkeys.New(req.GetMasterSecret(), req.GetSalt())
	if err != nil {
		return initcluster.Request{}, fmt.Errorf("master_secret, salt: %w", err)
	}
	if !dnsLabel.MatchString(req.GetClusterName()) {
		return initcluster.Request{}, fmt.Errorf("cluster_name %q is not a DNS label", req.GetClusterName())
	}
	if !kubeVersion.MatchString(req.GetKubernetesVersion()) {
		return initcluster.Request{}, fmt.Errorf("kubernetes_version %q is not of the form v1.N.N", req.GetKubernetesVersion())
	}
	for name, cidr := range map[string]string{"service_cidr": req.GetServiceCidr(), "pod_cidr": req.GetPodCidr()} {
		if _, _, err := net.ParseCIDR(cidr); err != nil {
			return initcluster.Request{}, fmt.Errorf("%s %q is not a CIDR", name, cidr)
		}
	}
	if err := checkSANs(req.GetApiserverCertSans()); err != nil {
		return initcluster.Request{}, err
	}
	if p := req.GetAttestationPolicy(); len(p) > 0 {
		parsed, err := policy.Parse(p, "attestation_policy", nil)
		if err != nil {
			return initcluster.Request{}, fmt.Errorf("attestation_policy: %w", err)
		}
		if _, err := choose.NewValidator(parsed, zap.NewNop()); err != nil {
			return initcluster.Request{}, fmt.Errorf("attestation_policy: %w", err)
		}
	}
	if p := req.GetComponents().GetImagePolicy(); len(p) > 0 {
		if _, err := webhook.ParsePolicy(p); err != nil {
			return initcluster.Request{}, fmt.Errorf("components.image_policy: %w", err)
		}
	}
	cluster, err := requestClusterConfig(req)
	if err != nil {
		return initcluster.Request{}, err
	}
	return initcluster.Request{
		Cluster:           cluster,
		ClusterName:       req.GetClusterName(),
		KubernetesVersion: req.GetKubernetesVersion(),
		ServiceCIDR:       req.GetServiceCidr(),
		PodCIDR:           req.GetPodCidr(),
		CertSANs:          req.GetApiserverCertSans(),
		Keys:              keys,
		Salt:              req.GetSalt(),
		AttestationPolicy: req.GetAttestationPolicy(),
		SkipKubeProxy:     req.GetComponents().GetSkipKubeProxy(),
		SkipCoreDNS:       req.GetComponents().GetSkipCoredns(),
		ImagePolicy:       req.GetComponents().GetImagePolicy(),
	}, nil
}

// requestClusterConfig returns the request's cluster configuration: cluster_config, strictly
// decoded and validated, whose name, version and networks must be the request's; from an older
// CLI without it, the request's fields over the defaults.
func requestClusterConfig(req *initproto.InitRequest) (clusterconfig.ClusterConfiguration, error) {
	if len(req.GetClusterConfig()) == 0 {
		c := clusterconfig.Default()
		c.ClusterName, c.KubernetesVersion = req.GetClusterName(), req.GetKubernetesVersion()
		c.Networking = clusterconfig.Networking{ServiceSubnet: req.GetServiceCidr(), PodSubnet: req.GetPodCidr()}
		c.APIServer.CertSANs = req.GetApiserverCertSans()
		c.Components = clusterconfig.Components{SkipKubeProxy: req.GetComponents().GetSkipKubeProxy(), SkipCoreDNS: req.GetComponents().GetSkipCoredns()}
		return c, nil
	}
	c, _, err := clusterconfig.Parse(req.GetClusterConfig())
	if err != nil {
		return c, fmt.Errorf("cluster_config: %w", err)
	}
	for _, f := range []struct{ field, config, request string }{
		{"clusterName", c.ClusterName, req.GetClusterName()},
		{"kubernetesVersion", c.KubernetesVersion, req.GetKubernetesVersion()},
		{"networking.serviceSubnet", c.Networking.ServiceSubnet, req.GetServiceCidr()},
		{"networking.podSubnet", c.Networking.PodSubnet, req.GetPodCidr()},
	} {
		if f.config != f.request {
			return c, fmt.Errorf("cluster_config: %s %q is not the request's %q", f.field, f.config, f.request)
		}
	}
	if !slices.Equal(c.APIServer.CertSANs, req.GetApiserverCertSans()) {
		return c, fmt.Errorf("cluster_config: apiServer.certSANs are not the request's apiserver_cert_sans")
	}
	if c.Components.SkipKubeProxy != req.GetComponents().GetSkipKubeProxy() || c.Components.SkipCoreDNS != req.GetComponents().GetSkipCoredns() {
		return c, fmt.Errorf("cluster_config: components are not the request's")
	}
	return c, nil
}

// maxSANs bounds the API server certificate's extra names.
const maxSANs = 64

// dnsName is a DNS name as a certificate's SAN may hold it: labels of a DNS-1123 subdomain, the
// first of which may be a wildcard.
var dnsName = regexp.MustCompile(`^(\*\.)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$`)

// checkSANs accepts IP addresses and DNS names (at most maxSANs, each at most 253 characters).
func checkSANs(sans []string) error {
	if len(sans) > maxSANs {
		return fmt.Errorf("apiserver_cert_sans: %d names, at most %d", len(sans), maxSANs)
	}
	for i, san := range sans {
		if net.ParseIP(san) != nil {
			continue
		}
		if len(san) > 253 || !dnsName.MatchString(san) {
			return fmt.Errorf("apiserver_cert_sans[%d] %s is neither an IP address nor a DNS name", i, strconv.QuoteToASCII(truncate(san, 64)))
		}
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// sender serializes writes to the stream: phase output arrives from command goroutines.
type sender struct {
	mu     sync.Mutex
	stream interface {
		Send(*initproto.InitResponse) error
	}
	now func() time.Time
}

func (s *sender) send(resp *initproto.InitResponse) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stream.Send(resp)
}

func (s *sender) progress(phase string, state initproto.PhaseState, msg string, idx uint32, total int) error {
	return s.send(&initproto.InitResponse{Kind: &initproto.InitResponse_Progress{Progress: &initproto.Progress{
		Phase: phase, State: state, Message: msg, Time: timestamppb.New(s.now()), Index: idx, Total: uint32(total),
	}}})
}

// failure sends the final InitFailure. The stream then ends with an OK status: the failure is the
// answer, not a transport error.
func (s *sender) failure(code initproto.FailureCode, msg, phase string, retryable bool) error {
	return s.send(&initproto.InitResponse{Kind: &initproto.InitResponse_Failure{Failure: &initproto.InitFailure{
		Code: code, Message: msg, Phase: phase, Retryable: retryable,
	}}})
}

// logWriter returns a writer that streams phase output to the client as log chunks and to the
// node's log line by line.
func (s *sender) logWriter(log *zap.Logger) io.Writer { return &logChunker{s: s, log: log} }

type logChunker struct {
	s   *sender
	log *zap.Logger
}

// maxChunk bounds one LogChunk message.
const maxChunk = 16 << 10

func (c *logChunker) Write(p []byte) (int, error) {
	for off := 0; off < len(p); off += maxChunk {
		end := min(off+maxChunk, len(p))
		chunk := append([]byte(nil), p[off:end]...)
		if err := c.s.send(&initproto.InitResponse{Kind: &initproto.InitResponse_Log{Log: &initproto.LogChunk{Data: chunk}}}); err != nil {
			// The client went away; keep the phase running to its end and keep the node's own log.
			c.log.Debug("sending log chunk", zap.Error(err))
			break
		}
	}
	c.log.Debug("phase output", zap.ByteString("output", p))
	return len(p), nil
}

// locker is the node lock.
type locker interface {
	// TryLockOnce takes the lock for owner and marks the node as belonging to clusterID; it returns
	// an error wrapping nodelock.ErrLocked if anyone took it before.
	TryLockOnce(ctx context.Context, owner string, clusterID []byte) error
}

// initSecretHasher supplies the expected init secret hash.
type initSecretHasher interface {
	// InitSecretHash returns SHA-256 of the init secret.
	InitSecretHash(ctx context.Context) ([]byte, error)
}

// clusterInitializer provides the init phases.
type clusterInitializer interface {
	// Prepare fills in the job's node data before the first phase of an attempt.
	Prepare(ctx context.Context, job *initcluster.Job) error
	// Phases returns the phases in order, a restore's when restore is set.
	Phases(restore bool) []initcluster.Phase
}

// stateStore persists the node state.
type stateStore interface {
	Load() (*nodestate.State, error)
	Save(*nodestate.State) error
}
