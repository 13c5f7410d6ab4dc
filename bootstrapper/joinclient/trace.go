package joinclient

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/kubeclient"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/joinproto"
)

// Waits of the trace's last phases: how long the node waits for its Node to be Ready, how often
// it looks, and how it retries sending the trace (from reportFirstWait, doubling up to
// reportMaxWait, reportSteps attempts: about two minutes in all).
const (
	readyTimeout    = 5 * time.Minute
	readyInterval   = 2 * time.Second
	reportFirstWait = time.Second
	reportMaxWait   = 30 * time.Second
	reportSteps     = 8
)

// WithTrace records the join's phases in rec (internal/jointrace) and, once the node joined or
// failed after it took a ticket, sends the trace to the joinservice (ReportTrace) so that it
// lands on the node's Machine. ready, when not nil, adds the node-ready phase: the wait until the
// Node reports Ready.
func (c *Client) WithTrace(rec *jointrace.Recorder, ready nodeReadiness) *Client {
	c.trace, c.ready = rec, ready
	return c
}

// nodeReadiness waits until the Node name reports Ready.
type nodeReadiness interface {
	WaitReady(ctx context.Context, name string) error
}

// afterJoin records the end of the kubeadm-join phase (joinErr), waits for the Node to be Ready,
// and reports the trace. Nothing here fails the join: the trace is a record.
func (c *Client) afterJoin(ctx context.Context, log *zap.Logger, self metadata.Instance, nodeName string, joinErr error) {
	if joinErr != nil {
		c.trace.Fail(jointrace.ReasonJoinFailed, joinErr.Error())
	} else {
		c.trace.Succeed("")
		if c.ready != nil {
			c.trace.Begin(jointrace.PhaseReady)
			rctx, cancel := context.WithTimeout(ctx, readyTimeout)
			err := c.ready.WaitReady(rctx, nodeName)
			cancel()
			switch {
			case err == nil:
				c.trace.Succeed("")
			case ctx.Err() != nil:
				return
			default:
				c.trace.Fail(jointrace.ReasonNotReady, fmt.Sprintf("node %s not Ready after %s: %v", nodeName, readyTimeout, err))
			}
		}
	}
	c.reportTrace(ctx, log, self)
}

// reportTrace sends the trace to a joinservice until one stores it, one answers that the cluster
// has no Machine for this node (the trace stays on the node), or the retries run out.
func (c *Client) reportTrace(ctx context.Context, log *zap.Logger, self metadata.Instance) {
	req := &joinproto.ReportTraceRequest{Phases: c.trace.Snapshot().Proto()}
	backoff := wait.Backoff{Duration: reportFirstWait, Factor: 2, Cap: reportMaxWait, Steps: reportSteps}
	errDone := errors.New("done")
	err := wait.ExponentialBackoffWithContext(ctx, backoff, func(ctx context.Context) (bool, error) {
		endpoints, err := c.endpoints(ctx, self)
		if err != nil {
			log.Debug("listing joinservice endpoints", zap.Error(err))
		}
		for _, ep := range endpoints {
			resp, err := c.askReportTrace(ctx, ep, req)
			if err == nil {
				log.Info("join trace reported", zap.String("endpoint", ep), zap.String("machine", printable(resp.GetMachine(), maxReasonLen)))
				return true, nil
			}
			if status.Code(err) == codes.Unimplemented {
				// A joinservice of an earlier version: the trace stays on the node.
				log.Info("the joinservice does not store join traces", zap.String("endpoint", ep))
				return false, errDone
			}
			if r, ok := asRejection(err); ok {
				log.Warn("join trace refused", zap.String("endpoint", ep), zap.String("reason", printable(r.reason, maxReasonLen)),
					zap.String("message", printable(r.message, maxMessageLen)))
				if r.reason == reasonNoMachine {
					return false, errDone
				}
				continue
			}
			log.Debug("reporting the join trace", zap.String("endpoint", ep), zap.Error(err))
		}
		return false, nil
	})
	if err != nil && !errors.Is(err, errDone) && ctx.Err() == nil {
		log.Warn("the join trace was not reported; it stays on the node", zap.Error(err))
	}
}

// reasonNoMachine is the joinservice's reason for a trace of a node it has no Machine of.
const reasonNoMachine = "NO_MACHINE"

func (c *Client) askReportTrace(ctx context.Context, endpoint string, req *joinproto.ReportTraceRequest) (*joinproto.ReportTraceResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	client, closer, err := c.dial(ctx, endpoint)
	if err != nil {
		return nil, fmt.Errorf("dialing joinservice: %w", err)
	}
	defer func() { _ = closer.Close() }() // the call's outcome is decided
	return client.ReportTrace(ctx, req)
}

// KubeletReadiness waits for the Node with the kubelet's own credentials (the kubeconfig kubeadm
// join wrote; the Node authorizer lets a node read its own Node).
type KubeletReadiness struct {
	// Kubeconfig is the kubelet's kubeconfig (/etc/kubernetes/kubelet.conf).
	Kubeconfig string
}

// WaitReady polls the Node until it reports Ready or ctx ends.
func (k KubeletReadiness) WaitReady(ctx context.Context, name string) error {
	var client kubernetes.Interface
	var last error
	err := wait.PollUntilContextCancel(ctx, readyInterval, true, func(ctx context.Context) (bool, error) {
		if client == nil {
			cfg, err := kubeclient.FromFile(k.Kubeconfig)
			if err != nil {
				last = err
				return false, nil
			}
			if client, err = kubeclient.Clientset(cfg); err != nil {
				last = err
				return false, nil
			}
		}
		ready, err := nodeReady(ctx, client, name)
		last = err
		return ready, nil
	})
	if err != nil && last != nil {
		return fmt.Errorf("%w (last: %w)", err, last)
	}
	return err
}

// nodeReady reports whether the Node name's Ready condition is True.
func nodeReady(ctx context.Context, client kubernetes.Interface, name string) (bool, error) {
	n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("reading node %s: %w", name, err)
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status == corev1.ConditionTrue {
				return true, nil
			}
			return false, fmt.Errorf("node %s: Ready is %s (%s)", name, c.Status, c.Reason)
		}
	}
	return false, fmt.Errorf("node %s has no Ready condition yet", name)
}
