// Package joindial is the client side of the join protocol: it dials a joinservice over mutual
// attested TLS (the node attests, the joinservice must satisfy the node's policy) and accepts a
// ticket (join or rejoin), or a check-in's answer, only from a joinservice whose lock register holds
// the ticket's (the node's) cluster ID, as a control plane's does (ControlPlaneLock: a bootstrapped worker's register holds another value).
// The bootstrapper's JoinClient joins and rejoins through it, and the joinservice's tests use it as
// the reference node. A node whose clock refuses the joinservice's session proof as stale retries
// once over a new connection that asks for a document for its own nonce.
package joindial

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// ReasonNotBound is the rejection reason when the joinservice's lock register does not hold the
// cluster ID its ticket names.
const ReasonNotBound = "JOINSERVICE_NOT_BOUND"

// LockCheck reports whether evidence from the joinservice proves it is locked to clusterID.
type LockCheck func(ev *atls.Evidence, clusterID []byte) error

// LockRegisterCheck is the LockCheck for a lock register at measurement index whose value for a
// cluster is expected(clusterID) (vtpm.ExpectedLockValue, tdx.ExpectedLockRTMR).
func LockRegisterCheck(index uint32, expected func(clusterID []byte) []byte) LockCheck {
	return func(ev *atls.Evidence, clusterID []byte) error {
		got, ok := ev.Result.Measurements[index]
		if !ok {
			return fmt.Errorf("its attestation does not include lock register %d", index)
		}
		if want := expected(clusterID); !bytes.Equal(got, want) {
			return fmt.Errorf("lock register %d holds %x, the ticket's cluster needs %x", index, got, want)
		}
		return nil
	}
}

// ControlPlaneLock is the LockCheck a node applies to every ticket: the joinservice's lock register
// at index must hold expected(nodelock.ControlPlaneLockID(clusterID)), the value only a control
// plane of the ticket's cluster has (see nodelock.ControlPlaneLockID). A bootstrapped worker of the
// same cluster, whose TPM passes any policy that asks only for a set lock register, is refused.
func ControlPlaneLock(index uint32, expected func(clusterID []byte) []byte) LockCheck {
	check := LockRegisterCheck(index, func(clusterID []byte) []byte { return expected(nodelock.ControlPlaneLockID(clusterID)) })
	return func(ev *atls.Evidence, clusterID []byte) error {
		if err := check(ev, clusterID); err != nil {
			return fmt.Errorf("not a control plane of the ticket's cluster: %w", err)
		}
		return nil
	}
}

// New returns a dial function for mutual attested TLS: this node attests with issuer,
// the joinservice must satisfy validator (same image, bootstrapped), and a ticket is only accepted
// if the joinservice's lock register holds the ticket's cluster ID (bound).
func New(issuer atls.Issuer, validator atls.Validator, bound LockCheck, opts ...atls.Option) (func(ctx context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error), error) {
	creds, err := atls.NewCredentials(issuer, validator, opts...)
	if err != nil {
		return nil, fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	// For a node whose clock refuses the joinservice's session proof (atls.ErrStale): a document for
	// this node's own nonce, whatever the clocks say.
	fresh, err := atls.NewCredentials(issuer, validator, append(opts, atls.WithSessionMaxAge(0))...)
	if err != nil {
		return nil, fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	return func(_ context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
		conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(creds))
		if err != nil {
			return nil, nil, err
		}
		return &boundClient{JoinServiceClient: joinproto.NewJoinServiceClient(conn), bound: bound, endpoint: endpoint, fresh: fresh}, conn, nil
	}, nil
}

// boundClient checks, for every ticket, that the joinservice that issued it is locked to the ticket's
// cluster: a replayed or relayed ticket from a joinservice of another cluster is refused.
type boundClient struct {
	joinproto.JoinServiceClient
	bound    LockCheck
	endpoint string
	fresh    *atls.Credentials
}

// retryFresh runs call; when the handshake refused the joinservice's session proof as stale (this
// node's clock and the joinservice's disagree by more than the proof's age allows), it runs call once
// more over a new connection that asks for a document for this node's nonce instead.
func (c *boundClient) retryFresh(call func(joinproto.JoinServiceClient) error) error {
	err := call(c.JoinServiceClient)
	if err == nil || !strings.Contains(status.Convert(err).Message(), atls.ErrStale.Error()) {
		return err
	}
	conn, dialErr := grpc.NewClient(c.endpoint, grpc.WithTransportCredentials(c.fresh))
	if dialErr != nil {
		return err
	}
	defer func() { _ = conn.Close() }() // the call's result is what counts
	return call(joinproto.NewJoinServiceClient(conn))
}

func (c *boundClient) IssueJoinTicket(ctx context.Context, req *joinproto.IssueJoinTicketRequest, opts ...grpc.CallOption) (*joinproto.IssueJoinTicketResponse, error) {
	return boundTicket(c, opts, func(client joinproto.JoinServiceClient, opts ...grpc.CallOption) (*joinproto.IssueJoinTicketResponse, error) {
		return client.IssueJoinTicket(ctx, req, opts...)
	})
}

func (c *boundClient) IssueRejoinTicket(ctx context.Context, req *joinproto.IssueRejoinTicketRequest, opts ...grpc.CallOption) (*joinproto.IssueRejoinTicketResponse, error) {
	return boundTicket(c, opts, func(client joinproto.JoinServiceClient, opts ...grpc.CallOption) (*joinproto.IssueRejoinTicketResponse, error) {
		return client.IssueRejoinTicket(ctx, req, opts...)
	})
}

// boundTicket runs a ticket RPC (through retryFresh) and returns its ticket only when the
// joinservice that answered is locked to the cluster the ticket names.
func boundTicket[T interface{ GetClusterId() []byte }](c *boundClient, opts []grpc.CallOption, rpc func(joinproto.JoinServiceClient, ...grpc.CallOption) (T, error)) (T, error) {
	var p peer.Peer
	var ticket, none T
	err := c.retryFresh(func(client joinproto.JoinServiceClient) (err error) {
		ticket, err = rpc(client, append(opts, grpc.Peer(&p))...)
		return err
	})
	if err != nil {
		return none, err
	}
	if err := c.checkBound(&p, ticket.GetClusterId()); err != nil {
		return none, err
	}
	return ticket, nil
}

// CheckIn checks in, and accepts the joinservice's answer, an admission or a refusal it made after
// the handshake, only when the joinservice is locked to the cluster the request names: a REVOKED
// from a worker's TPM posing as the joinservice would lock a genuine node.
func (c *boundClient) CheckIn(ctx context.Context, req *joinproto.CheckInRequest, opts ...grpc.CallOption) (*joinproto.CheckInResponse, error) {
	var p peer.Peer
	var resp *joinproto.CheckInResponse
	err := c.retryFresh(func(client joinproto.JoinServiceClient) (err error) {
		resp, err = client.CheckIn(ctx, req, append(opts, grpc.Peer(&p))...)
		return err
	})
	if _, attested := p.AuthInfo.(atls.AuthInfo); err == nil || attested {
		if err := c.checkBound(&p, req.GetClusterId()); err != nil {
			return nil, err
		}
	}
	return resp, err
}

// checkBound checks that the joinservice behind p is locked to clusterID.
func (c *boundClient) checkBound(p *peer.Peer, clusterID []byte) error {
	info, ok := p.AuthInfo.(atls.AuthInfo)
	if !ok || info.Evidence == nil {
		return notBound("the joinservice presented no attestation")
	}
	if err := c.bound(info.Evidence, clusterID); err != nil {
		return notBound(err.Error())
	}
	return nil
}

func notBound(msg string) error {
	st, err := status.New(codes.PermissionDenied, "joinservice not bound to the ticket's cluster: "+msg).
		WithDetails(&errdetails.ErrorInfo{Reason: ReasonNotBound, Domain: "berth.joinclient"})
	if err != nil {
		return status.Error(codes.PermissionDenied, msg)
	}
	return st.Err()
}
