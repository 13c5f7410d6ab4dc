package server

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
)

// rpcAdmin is the ledger's and the metrics' name of IssueAdminCredential.
const rpcAdmin = joinledger.RPCAdminCredential

// adminNonceTTL is how long a nonce of AdminChallenge may be used.
const adminNonceTTL = time.Minute

// adminNonceSize: 16 random bytes, the expiry (8 bytes, Unix nanoseconds), a 16-byte MAC.
const adminNonceSize = 40

// adminNonces issues AdminChallenge's nonces without keeping state for them: a nonce carries its
// expiry and a MAC under a key of this process, so only this replica accepts it, and only until it
// expires. A nonce is remembered once it was spent on a proof that verified, until it expires, so
// that it is used once; only holders of the master secret can add to that set.
type adminNonces struct {
	key []byte
	mu  sync.Mutex
	// used maps spent nonces to their expiry.
	used map[string]time.Time
}

func newAdminNonces() *adminNonces {
	key := make([]byte, 32)
	_, _ = rand.Read(key) // crypto/rand.Read does not fail
	return &adminNonces{key: key, used: map[string]time.Time{}}
}

func (n *adminNonces) mac(body []byte) []byte {
	m := hmac.New(sha256.New, n.key)
	m.Write(body)
	return m.Sum(nil)[:16]
}

// issue returns a nonce that expires at now+adminNonceTTL.
func (n *adminNonces) issue(now time.Time) []byte {
	nonce := make([]byte, 24, adminNonceSize)
	_, _ = rand.Read(nonce[:16])
	binary.BigEndian.PutUint64(nonce[16:24], uint64(now.Add(adminNonceTTL).UnixNano()))
	return append(nonce, n.mac(nonce)...)
}

// valid reports whether nonce is one of this process's and has not expired at now.
func (n *adminNonces) valid(nonce []byte, now time.Time) bool {
	if len(nonce) != adminNonceSize || !hmac.Equal(nonce[24:], n.mac(nonce[:24])) {
		return false
	}
	return now.UnixNano() < int64(binary.BigEndian.Uint64(nonce[16:24]))
}

// spend marks a valid nonce used; it reports false when it was used already. Expired entries go.
func (n *adminNonces) spend(nonce []byte, now time.Time) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	for k, exp := range n.used {
		if !now.Before(exp) {
			delete(n.used, k)
		}
	}
	if _, ok := n.used[string(nonce)]; ok {
		return false
	}
	n.used[string(nonce)] = time.Unix(0, int64(binary.BigEndian.Uint64(nonce[16:24])))
	return true
}

// AdminChallenge implements the RPC: a nonce for IssueAdminCredential. It is charged to the caller's
// peer budget and, without attestation evidence, to the unverified budget, like every call anyone
// can make; it writes nothing.
func (s *Server) AdminChallenge(ctx context.Context, _ *joinproto.AdminChallengeRequest) (*joinproto.AdminChallengeResponse, error) {
	peer := peerKey(ctx)
	if !s.budgets.peers.AllowPeer(peer) || !s.budgets.unverified.Allow() {
		return nil, s.rateLimited(rpcAdmin, peer)
	}
	return &joinproto.AdminChallengeResponse{Nonce: s.adminNonces.issue(s.now())}, nil
}

// peerKey is the caller's address as the budgets and the ledger name it.
func peerKey(ctx context.Context) string {
	if ip := peerIP(ctx); ip != nil {
		return ip.String()
	}
	return "unknown"
}

// IssueAdminCredential implements the RPC: a cluster-admin client certificate for a caller that
// proves it holds the master secret (clusterkeys.AdminProof over a nonce of AdminChallenge, the
// public key and the validity). The caller does not attest: an operator's machine has nothing to
// attest with; the proof is what admits it. Every call goes to the ledger (an issued credential is
// the audit trail, a refusal one of a peer that proved nothing) and is charged to the caller's peer
// budget and the unverified budget before anything else; a refusal tells which check failed and
// nothing about the secret.
func (s *Server) IssueAdminCredential(ctx context.Context, req *joinproto.IssueAdminCredentialRequest) (resp *joinproto.IssueAdminCredentialResponse, err error) {
	// begin charges the unverified budget only where attestation is checked and the caller presented
	// none; an admin credential's caller never needs to attest, so every other call is charged here.
	if _, verified := atls.PeerEvidence(ctx); s.attest == nil || verified {
		if !s.budgets.unverified.Allow() {
			return nil, s.rateLimited(rpcAdmin, peerKey(ctx))
		}
	}
	a, _, err := s.begin(ctx, rpcAdmin, joinproto.Role_ROLE_UNSPECIFIED)
	if err != nil {
		return nil, err
	}
	defer func() { s.finish(a, err) }()
	log := &callLog{log: s.log, fields: []zap.Field{zap.String("peer", a.entry.Peer)}}
	now := s.now()
	nonce := req.GetNonce()
	if !s.adminNonces.valid(nonce, now) {
		log.Warn("admin credential refused", zap.String("reason", joinproto.ReasonAdminChallengeStale))
		return nil, reject(codes.PermissionDenied, joinproto.ReasonAdminChallengeStale, "the challenge is unknown or expired: ask for a new one")
	}
	if !s.keys.VerifyAdminProof(nonce, req.GetPublicKey(), req.GetValiditySeconds(), req.GetProof()) {
		log.Warn("admin credential refused", zap.String("reason", joinproto.ReasonAdminProofMismatch))
		return nil, reject(codes.PermissionDenied, joinproto.ReasonAdminProofMismatch, "the master secret does not match this cluster")
	}
	if !s.adminNonces.spend(nonce, now) {
		log.Warn("admin credential refused", zap.String("reason", joinproto.ReasonAdminChallengeStale))
		return nil, reject(codes.PermissionDenied, joinproto.ReasonAdminChallengeStale, "the challenge was used already: ask for a new one")
	}
	validity := time.Duration(req.GetValiditySeconds()) * time.Second
	if req.GetValiditySeconds() > int64(joinproto.MaxAdminValidity/time.Second) || validity < joinproto.MinAdminValidity {
		log.Warn("admin credential refused", zap.String("reason", joinproto.ReasonBadValidity), zap.Int64("validitySeconds", req.GetValiditySeconds()))
		return nil, reject(codes.InvalidArgument, joinproto.ReasonBadValidity,
			fmt.Sprintf("validity %ds is outside %s..%s", req.GetValiditySeconds(), joinproto.MinAdminValidity, joinproto.MaxAdminValidity))
	}
	if err := s.chargeTicket(a); err != nil {
		return nil, err
	}
	certPEM, serial, err := s.ca.SignAdminClient(req.GetPublicKey(), validity)
	if errors.Is(err, ca.ErrBadPublicKey) {
		log.Warn("admin credential refused", zap.String("reason", joinproto.ReasonBadPublicKey), zap.Error(err))
		return nil, reject(codes.InvalidArgument, joinproto.ReasonBadPublicKey, err.Error())
	}
	if err != nil {
		log.Error("admin credential failed", zap.Error(err))
		return nil, reject(codes.Internal, ReasonInternal, "internal error")
	}
	keySum := sha256.Sum256(req.GetPublicKey())
	a.entry.Message = fmt.Sprintf("%s in %s, serial %x, until %s", ca.AdminUser, ca.AdminGroup, serial, now.Add(validity).UTC().Format(time.RFC3339))
	// The audit trail: who (the peer's address, the key's digest), what (the serial), how long.
	log.Info("admin credential issued", zap.String("user", ca.AdminUser), zap.String("group", ca.AdminGroup),
		zap.String("serial", fmt.Sprintf("%x", serial)), zap.String("publicKeySHA256", hex.EncodeToString(keySum[:])),
		zap.Duration("validity", validity), zap.Time("notAfter", now.Add(validity).UTC()))
	return &joinproto.IssueAdminCredentialResponse{Certificate: certPEM, ClusterCaCert: s.ca.CertPEM(), ApiServerEndpoint: s.cfg.APIServerEndpoint}, nil
}
