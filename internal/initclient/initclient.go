// Package initclient is the client side of the Init protocol (initproto) and the dial both
// `berth init` and `berth recover` use: connecting to a node's attested gRPC endpoint and learning
// what the node proved, the lock register a resumed init accepts, and reading the node's init
// stream until its result. The CLI prints what it is told; this package prints nothing.
package initclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/nodelock"
)

// ErrAttestationFailed is returned by WaitConnected when the node failed attestation; it wraps the
// validator's reason.
var ErrAttestationFailed = errors.New("the node failed attestation; nothing was sent")

// Errors of Receive: the node refused the init request (wrong init secret, or not the node the
// operator meant), it is rate-limiting init requests, or it ended the stream without a result.
var (
	ErrRejected    = errors.New("the node rejected the init request")
	ErrRateLimited = errors.New("the node is rate-limiting init requests")
	ErrNoResult    = errors.New("the node ended init without a result")
)

// EndpointError is returned by NewConn when the endpoint cannot be dialed at all.
type EndpointError struct {
	Endpoint string
	Err      error
}

func (e *EndpointError) Error() string { return fmt.Sprintf("endpoint %q: %v", e.Endpoint, e.Err) }
func (e *EndpointError) Unwrap() error { return e.Err }

// FailureError is the node's InitFailure.
type FailureError struct{ Failure *initproto.InitFailure }

func (e *FailureError) Error() string { return "init failed: " + e.Failure.GetMessage() }

// Verdict remembers what the node proved, or why it was rejected, in the last handshake.
type Verdict struct {
	mu       sync.Mutex
	ev       *atls.Evidence
	rejected error
}

func (v *Verdict) observe(ev atls.Evidence, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if err != nil {
		// A rate-limited handshake is retried; anything else the node proved (or failed to) is final.
		if !errors.Is(err, atls.ErrRateLimited) {
			v.rejected = err
		}
		return
	}
	v.ev = &ev
}

func (v *Verdict) rejection() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.rejected
}

// Accepted is the evidence of the node's last accepted handshake; nil when none was (or
// attestation was skipped).
func (v *Verdict) Accepted() *atls.Evidence {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.ev
}

// NewConn makes a connection (not yet connected) to a node's attested gRPC endpoint, checking its
// attestation with validator; nil skips attestation. The Verdict tells what the node proved.
func NewConn(endpoint string, validator atls.Validator) (*grpc.ClientConn, *Verdict, error) {
	creds := insecure.NewCredentials()
	verdict := &Verdict{}
	if validator != nil {
		var err error
		if creds, err = atls.NewCredentials(nil, validator, atls.WithObserver(verdict.observe)); err != nil {
			return nil, nil, fmt.Errorf("creating attested TLS credentials: %w", err)
		}
	}
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, nil, &EndpointError{Endpoint: endpoint, Err: err}
	}
	return conn, verdict, nil
}

// connectPoll is how often WaitConnected looks at the connection and the attestation verdict. It
// polls because a channel that failed once stays in TRANSIENT_FAILURE while it retries: a node
// rejected in a later attempt changes no state there is to wait for.
const connectPoll = 100 * time.Millisecond

// WaitConnected retries connecting until the connection is ready or timeout passes. It is the only
// retry: once connected, a failure is reported, not retried. A node that fails attestation is not
// retried either (ErrAttestationFailed): nothing it can do in the next handshake will change what
// it measured.
func WaitConnected(ctx context.Context, conn *grpc.ClientConn, timeout time.Duration, verdict *Verdict) error {
	conn.Connect()
	last := conn.GetState()
	var rejected error
	err := wait.PollUntilContextTimeout(ctx, connectPoll, timeout, true, func(context.Context) (bool, error) {
		if rejected = verdict.rejection(); rejected != nil {
			return true, nil
		}
		last = conn.GetState()
		if last == connectivity.Idle {
			conn.Connect()
		}
		return last == connectivity.Ready, nil
	})
	if rejected != nil {
		return fmt.Errorf("%w: %w", ErrAttestationFailed, rejected)
	}
	if err != nil {
		return fmt.Errorf("could not reach the node within %s (last state %s)", timeout, last)
	}
	return nil
}

// AcceptResumedLock lets p accept, besides what it expects of a fresh node's lock register, the
// value the register holds once the node took the lock for clusterID: an unfinished init that got
// as far as the lock resumes on a node that is no longer fresh. It changes only an expectation of
// exact values at the variant's lock index (TPM PCR 15, TDX RTMR3 = index 4) and returns that
// index, or false when p has none.
func AcceptResumedLock(p *policy.Policy, clusterID []byte) (uint32, bool) {
	var idx uint32
	var value []byte
	switch p.Variant {
	case vtpm.Variant:
		idx, value = vtpm.DefaultLockPCR, vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(clusterID))
	case tdx.VariantName:
		idx, value = tdx.DefaultLockRTMR+1, tdx.ExpectedLockRTMR(nodelock.ControlPlaneLockID(clusterID))
	default:
		return 0, false
	}
	for i := range p.Expectations {
		e := &p.Expectations[i]
		if e.Index != idx || e.NonZero {
			continue
		}
		e.AnyOf = append(e.AnyOf, value)
		e.Source += "; or the lock value of the cluster this workspace's unfinished init locked the node for"
		return idx, true
	}
	return 0, false
}

// Handler receives what the node streams before its result.
type Handler struct {
	Progress func(*initproto.Progress)
	Log      func([]byte)
}

// Stream is the answer stream of Init and of Restore.
type Stream interface {
	Recv() (*initproto.InitResponse, error)
}

// Receive reads the node's init stream, handing progress and output to h, until the result: the
// node's InitSuccess, or an error: *FailureError (the node's InitFailure), ErrRejected
// (PermissionDenied), ErrRateLimited (ResourceExhausted), ErrNoResult (the stream ended), or the
// stream's error.
func Receive(stream Stream, h Handler) (*initproto.InitSuccess, error) {
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil, ErrNoResult
		}
		if err != nil {
			switch status.Code(err) {
			case codes.PermissionDenied:
				return nil, ErrRejected
			case codes.ResourceExhausted:
				return nil, ErrRateLimited
			}
			return nil, err
		}
		switch k := resp.GetKind().(type) {
		case *initproto.InitResponse_Progress:
			if h.Progress != nil {
				h.Progress(k.Progress)
			}
		case *initproto.InitResponse_Log:
			if h.Log != nil {
				h.Log(k.Log.GetData())
			}
		case *initproto.InitResponse_Failure:
			return nil, &FailureError{Failure: k.Failure}
		case *initproto.InitResponse_Success:
			return k.Success, nil
		}
	}
}
