// Package server is the joinservice's gRPC server: it decides which nodes may join and hands each
// one a ticket with everything kubeadm join needs.
//
// The node's identity comes from the platform, never from the node: the peer's address is looked up
// in metadata, the role it asks for must be the role metadata gives it, and its kubelet certificate
// is issued for the instance name metadata reports. Every rejection is a gRPC status whose message
// states the reason and whose ErrorInfo detail carries a stable reason code (see the Reason* constants).
package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/tokens"
)

// Reason codes of rejections.
const (
	ReasonNoEvidence    = "NO_EVIDENCE"
	ReasonMeasurements  = "MEASUREMENT_MISMATCH"
	ReasonUnknownPeer   = "UNKNOWN_PEER"
	ReasonRoleMismatch  = "ROLE_MISMATCH"
	ReasonBadCSR        = "BAD_CSR"
	ReasonInternal      = "INTERNAL"
	reasonDomain        = "berth.joinservice"
	kubeletCertValidity = 365 * 24 * time.Hour
	tokenTTL            = 15 * time.Minute
)

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

	cfg    Config
	log    *zap.Logger
	keys   *clusterkeys.Keys
	salt   []byte
	ca     *ca.Authority
	tokens tokenCreator
	meta   peerLister
	// attest judges the peer's attestation; nil accepts every peer (insecure-none).
	attest AttestationCheck
	// cpJoin serializes control-plane joins: etcd grows one member at a time.
	cpJoin sync.Mutex
}

// AttestationCheck judges the attestation of the peer in ctx against the cluster's policy. It returns
// the policy's warnings, or an error: ErrNoEvidence when the peer did not attest, otherwise an error
// whose text names what deviated (index, expected, actual).
type AttestationCheck func(ctx context.Context) (warnings []string, err error)

// ErrNoEvidence is returned by an AttestationCheck for a peer that presented no attestation.
var ErrNoEvidence = errors.New("peer presented no attestation")

// New returns a Server. attest may be nil only when the service runs without attestation.
func New(cfg Config, log *zap.Logger, keys *clusterkeys.Keys, salt []byte, authority *ca.Authority, tok tokenCreator, meta peerLister, attest AttestationCheck) *Server {
	return &Server{cfg: cfg, log: log, keys: keys, salt: salt, ca: authority, tokens: tok, meta: meta, attest: attest}
}

// checkAttestation applies the attestation check, if any, and turns a failure into a rejection.
func (s *Server) checkAttestation(ctx context.Context, log *zap.Logger) error {
	if s.attest == nil {
		return nil
	}
	warnings, err := s.attest(ctx)
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

func reject(code codes.Code, reason, msg string) error {
	st, err := status.New(code, msg).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: reasonDomain})
	if err != nil {
		return status.Error(code, msg)
	}
	return st.Err()
}

// IssueJoinTicket implements the RPC.
func (s *Server) IssueJoinTicket(ctx context.Context, req *joinproto.IssueJoinTicketRequest) (*joinproto.IssueJoinTicketResponse, error) {
	peerIP := peerIP(ctx)
	log := s.log.With(zap.String("peer", peerIP.String()), zap.String("claimedRole", req.GetRole().String()))
	if err := s.checkAttestation(ctx, log); err != nil {
		return nil, err
	}
	inst, err := s.instanceFor(ctx, peerIP)
	if err != nil {
		log.Warn("join rejected", zap.String("reason", ReasonUnknownPeer), zap.Error(err))
		return nil, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster")
	}
	log = log.With(zap.String("node", inst.Name))
	wantRole := joinproto.Role_ROLE_WORKER
	if inst.Role == metadata.RoleControlPlane {
		wantRole = joinproto.Role_ROLE_CONTROL_PLANE
	}
	if req.GetRole() != wantRole {
		log.Warn("join rejected", zap.String("reason", ReasonRoleMismatch))
		return nil, reject(codes.PermissionDenied, ReasonRoleMismatch,
			fmt.Sprintf("role %s requested, metadata says this node is a %s", req.GetRole(), inst.Role))
	}
	var ips []net.IP
	for _, ip := range inst.IPs {
		ips = append(ips, net.ParseIP(ip))
	}
	cert, err := s.ca.SignKubeletClient(req.GetKubeletCsr(), inst.Name, ips, kubeletCertValidity)
	if err != nil {
		log.Warn("join rejected", zap.String("reason", ReasonBadCSR), zap.Error(err))
		return nil, reject(codes.InvalidArgument, ReasonBadCSR, "the kubelet CSR does not parse or its signature does not verify")
	}
	var files []*joinproto.File
	if wantRole == joinproto.Role_ROLE_CONTROL_PLANE {
		s.cpJoin.Lock()
		defer s.cpJoin.Unlock()
		if files, err = s.readControlPlaneFiles(); err != nil {
			log.Error("reading control-plane files", zap.Error(err))
			return nil, reject(codes.Unavailable, ReasonInternal, "the joinservice cannot read the control-plane files")
		}
	}
	tok, err := s.tokens.Create(ctx, tokenTTL, "join of "+inst.Name)
	if err != nil {
		log.Error("creating bootstrap token", zap.Error(err))
		return nil, reject(codes.Unavailable, ReasonInternal, "the joinservice cannot create a bootstrap token")
	}
	log.Info("join ticket issued")
	return &joinproto.IssueJoinTicketResponse{
		NodeName:                   inst.Name,
		ApiServerEndpoint:          s.cfg.APIServerEndpoint,
		BootstrapToken:             tok.Value,
		BootstrapTokenExpiry:       timestamppb.New(tok.Expires),
		DiscoveryTokenCaCertHashes: []string{s.ca.Pin()},
		KubeletCert:                cert,
		ClusterCaCert:              s.ca.CertPEM(),
		ControlPlaneFiles:          files,
		KubernetesVersion:          s.cfg.KubernetesVersion,
		ClusterId:                  s.keys.ClusterID(),
		DiskKey:                    s.keys.DiskKey(req.GetDiskUuid()),
		MeasurementSalt:            s.salt,
	}, nil
}

// IssueRejoinTicket implements the RPC.
func (s *Server) IssueRejoinTicket(ctx context.Context, req *joinproto.IssueRejoinTicketRequest) (*joinproto.IssueRejoinTicketResponse, error) {
	peerIP := peerIP(ctx)
	if err := s.checkAttestation(ctx, s.log.With(zap.String("peer", peerIP.String()))); err != nil {
		return nil, err
	}
	if _, err := s.instanceFor(ctx, peerIP); err != nil {
		s.log.Warn("rejoin rejected", zap.String("peer", peerIP.String()), zap.String("reason", ReasonUnknownPeer))
		return nil, reject(codes.PermissionDenied, ReasonUnknownPeer, "this address belongs to no instance of the cluster")
	}
	return &joinproto.IssueRejoinTicketResponse{DiskKey: s.keys.DiskKey(req.GetDiskUuid()), ClusterId: s.keys.ClusterID()}, nil
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

// tokenCreator creates bootstrap tokens.
type tokenCreator interface {
	Create(ctx context.Context, ttl time.Duration, description string) (tokens.Token, error)
}

// peerLister lists the cluster's instances.
type peerLister interface {
	Peers(ctx context.Context) ([]metadata.Instance, error)
}
