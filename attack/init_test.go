package attack

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/nodelock"
)

// initNode is a fresh node's bootstrapper under attack: the real binary on swtpm, with a stand-in
// kubeadm whose version check takes two seconds (so that an init holds the node for a while) and
// whose every other command fails (so that no init gets further than certs).
type initNode struct {
	addr   string
	secret []byte
	roots  string // the policy's trust roots (swtpm's local CA)
	proc   *proctest.Process
}

func startInitNode(t *testing.T, role string, extraArgs ...string) *initNode {
	t.Helper()
	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm (fails under CI=true)
	tpm := vtpmtest.StartSwtpm(t, swCA)
	dir := t.TempDir()
	n := &initNode{addr: proctest.FreeAddr(t), secret: make([]byte, 32),
		roots: "trustRoots:\n  - pem: |\n" + indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      ")}
	_, _ = rand.Read(n.secret)
	sum := sha256.Sum256(n.secret)
	files := map[string]string{
		"metadata.yaml": fmt.Sprintf("self: {name: node-0, role: %s, ips: [127.0.0.1]}\ninitSecretHash: %x\n", role, sum),
		"kubeadm":       "#!/bin/sh\ncase \"$1\" in version) sleep 2; echo v1.34.2;; *) echo \"kubeadm stand-in: $*\"; exit 1;; esac\n",
		"kubelet":       "#!/bin/sh\nexec sleep 600\n",
		"cri.sock":      "",
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	n.proc = proctest.Start(t, proctest.Cmd{
		Name: "bootstrapper", Path: proctest.Build(t, "github.com/berth-k8s/berth/bootstrapper/cmd/bootstrapper"), Grace: 20 * time.Second,
		Args: append([]string{"--metadata=static", "--metadata-file=" + filepath.Join(dir, "metadata.yaml"),
			"--attestation=tpm", "--tpm=" + tpm.Spec, "--lock-pcr=15",
			"--state-dir=" + filepath.Join(dir, "state"), "--run-dir=" + filepath.Join(dir, "run"), "--init-listen=" + n.addr,
			"--kubelet=process", "--kubelet-path=" + filepath.Join(dir, "kubelet"), "--kubeadm-path=" + filepath.Join(dir, "kubeadm"),
			"--kubernetes-dir=" + filepath.Join(dir, "etc-kubernetes"), "--kubelet-dir=" + filepath.Join(dir, "var-lib-kubelet"),
			"--cri-socket=unix://" + filepath.Join(dir, "cri.sock"), "--never-pull"}, extraArgs...),
	})
	if err := proctest.WaitReady(context.Background(), 50*time.Millisecond, time.Minute, func(ctx context.Context) error {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", n.addr)
		if err == nil {
			c.Close()
		}
		return err
	}, n.proc); err != nil {
		t.Fatalf("waiting for the InitServer: %v", err)
	}
	return n
}

// conn dials the InitServer from ip over attested TLS, as berth init does: the node must prove that
// its lock register holds lock (zeros: a fresh node).
func (n *initNode) conn(t *testing.T, ip string, lock []byte) *grpc.ClientConn {
	t.Helper()
	p, err := policy.Parse([]byte(fmt.Sprintf("variant: tpm\nmeasurements:\n  15: {expected: %x}\n%s", lock, n.roots)), "init policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	validator, err := choose.NewValidator(p, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	creds, err := atls.NewCredentials(nil, validator)
	if err != nil {
		t.Fatal(err)
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	conn, err := grpc.NewClient("passthrough:///"+n.addr, grpc.WithTransportCredentials(creds),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// ready returns an attested connection from ip to the fresh node, established: it dials again (as
// berth init does) while the node's handshake rate limit refuses it.
func (n *initNode) ready(t *testing.T, ip string) *grpc.ClientConn {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ready *grpc.ClientConn
	_ = wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		conn := n.conn(t, ip, freshLock)
		conn.Connect()
		for s := conn.GetState(); ; s = conn.GetState() {
			switch s {
			case connectivity.Ready:
				ready = conn
				return true, nil
			case connectivity.TransientFailure, connectivity.Shutdown:
				conn.Close()
				return false, nil
			}
			if !conn.WaitForStateChange(ctx, s) {
				conn.Close()
				return false, nil
			}
		}
	})
	return ready
}

// attests reports whether the node passes attestation with its lock register holding lock.
func (n *initNode) attests(t *testing.T, ip string, lock []byte) error {
	t.Helper()
	conn := n.conn(t, ip, lock)
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A call with no secret: the handshake either fails (attestation) or the call is rejected
	// generically, which proves the handshake passed.
	stream, err := initproto.NewInitServiceClient(conn).Init(ctx, &initproto.InitRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	if c := status.Code(err); c == codes.PermissionDenied || c == codes.ResourceExhausted {
		return nil
	}
	return err
}

func initRequest(secret []byte, master byte) *initproto.InitRequest {
	return &initproto.InitRequest{
		InitSecret: secret, MasterSecret: bytes.Repeat([]byte{master}, 32), Salt: bytes.Repeat([]byte{2}, 32),
		ClusterName: "attack", KubernetesVersion: "v1.34.2", ServiceCidr: "10.96.0.0/12", PodCidr: "10.244.0.0/16",
	}
}

// outcome of one Init call: the gRPC code and message, the first progress, the failure code.
type outcome struct {
	code    codes.Code
	msg     string
	started bool
	failure initproto.FailureCode
	// handshakeLimited: the node refused the handshake on its rate limit; notFresh: the node failed
	// the caller's attestation because its lock register is no longer zero.
	handshakeLimited, notFresh bool
}

func runInit(ctx context.Context, conn *grpc.ClientConn, req *initproto.InitRequest) outcome {
	stream, err := initproto.NewInitServiceClient(conn).Init(ctx, req)
	var o outcome
	for err == nil {
		var resp *initproto.InitResponse
		if resp, err = stream.Recv(); err != nil {
			break
		}
		if p := resp.GetProgress(); p != nil && p.GetState() == initproto.PhaseState_PHASE_STATE_STARTED {
			o.started = true
		}
		if f := resp.GetFailure(); f != nil {
			o.failure = f.GetCode()
		}
	}
	if !errors.Is(err, io.EOF) {
		st := status.Convert(err)
		o.code, o.msg = st.Code(), st.Message()
		o.handshakeLimited = o.code == codes.Unavailable && strings.Contains(o.msg, atls.ErrRateLimited.Error())
		o.notFresh = o.code == codes.Unavailable && strings.Contains(o.msg, "index 15: expected "+strings.Repeat("0", 64))
	}
	return o
}

var freshLock = make([]byte, 32)

// TestInitServerUnderAttack attacks a fresh node's InitServer.
func TestInitServerUnderAttack(t *testing.T) {
	ctx := context.Background()
	t.Run("a thousand wrong init secrets over one attested connection", func(t *testing.T) {
		// The init secret is checked first, in constant time, with one answer for every wrong secret;
		// the per-peer limit makes one connection worth one guess a second after a burst of five
		// (unlimited, one connection carried about 3,600 guesses a second).
		n := startInitNode(t, "control-plane")
		conn := n.conn(t, "127.0.6.1", freshLock)
		counts := map[string]int{}
		start := time.Now()
		for i := range 1000 {
			req := initRequest([]byte(fmt.Sprintf("guess number %d of the attacker", i)), 1)
			o := runInit(ctx, conn, req)
			switch {
			case o.code == codes.PermissionDenied && o.msg == "init request rejected":
				counts["rejected"]++
			case o.code == codes.ResourceExhausted && o.msg == "too many init requests: retry later":
				counts["rate-limited"]++
			default:
				t.Fatalf("guess %d: %+v, want only the generic rejection or the rate limit", i, o)
			}
		}
		took := time.Since(start)
		t.Logf("1,000 wrong secrets in %s: %d reached the secret check, %d were rate-limited", took.Round(time.Millisecond), counts["rejected"], counts["rate-limited"])
		if limit := 5 + int(took.Seconds()) + 1; counts["rejected"] > limit {
			t.Errorf("%d guesses reached the secret check in %s, want at most %d", counts["rejected"], took, limit)
		}
		// Nothing happened to the node: it still attests as fresh.
		if err := n.attests(t, "127.0.6.2", freshLock); err != nil {
			t.Fatalf("the node no longer attests as fresh after the guesses: %v", err)
		}
	})
	t.Run("50 concurrent inits from 50 addresses", func(t *testing.T) {
		// Init takes the one-way lock once: of 50 callers that all hold an attested connection to the
		// fresh node and the init secret, but each its own master secret, one runs and locks the node
		// for its cluster; every other is refused without touching the node: BUSY while it runs,
		// CLUSTER_MISMATCH after it failed. (A caller that connects after the lock was taken is
		// refused by its own attestation: the node is no longer fresh.)
		n := startInitNode(t, "control-plane")
		conns := make([]*grpc.ClientConn, 50)
		var wg sync.WaitGroup
		for i := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				conns[i] = n.ready(t, fmt.Sprintf("127.0.7.%d", i+1))
			}()
		}
		wg.Wait()
		for i, conn := range conns {
			if conn == nil {
				t.Fatalf("caller %d never connected", i)
			}
		}
		outcomes := make([]outcome, len(conns))
		for i, conn := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				callCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
				defer cancel()
				// As berth init would, a caller the node's init rate limit refused tries again.
				_ = wait.PollUntilContextCancel(callCtx, time.Second, true, func(ctx context.Context) (bool, error) {
					outcomes[i] = runInit(ctx, conn, initRequest(n.secret, byte(10+i)))
					return outcomes[i].code != codes.ResourceExhausted, nil
				})
			}()
		}
		wg.Wait()
		winner := -1
		tally := map[string]int{}
		for i, o := range outcomes {
			switch {
			case o.started:
				if winner >= 0 {
					t.Fatalf("callers %d and %d both ran init", winner, i)
				}
				winner = i
				tally["ran"]++
			case o.failure == initproto.FailureCode_FAILURE_CODE_BUSY || o.failure == initproto.FailureCode_FAILURE_CODE_CLUSTER_MISMATCH:
				tally[o.failure.String()]++
			default:
				t.Fatalf("caller %d: %+v", i, o)
			}
		}
		t.Logf("50 concurrent inits: %v", tally)
		if winner < 0 || tally["FAILURE_CODE_BUSY"] == 0 {
			t.Fatalf("want one init and callers refused as BUSY while it ran: %v", tally)
		}
		// The node is locked for the winner's cluster and for no other, as a control plane.
		keys, err := clusterkeys.New(bytes.Repeat([]byte{byte(10 + winner)}, 32), bytes.Repeat([]byte{2}, 32))
		if err != nil {
			t.Fatal(err)
		}
		if err := n.attests(t, "127.0.6.3", vtpm.ExpectedLockValue(nodelock.ControlPlaneLockID(keys.ClusterID()))); err != nil {
			t.Fatalf("the node's lock register does not hold the winner's cluster: %v", err)
		}
		// A late caller's own attestation refuses the node: it is no longer fresh.
		if o := runInit(ctx, n.conn(t, "127.0.6.4", freshLock), initRequest(n.secret, 99)); !o.notFresh {
			t.Fatalf("a caller connecting after the lock: %+v, want its attestation to refuse the node as not fresh", o)
		}
	})
	t.Run("init of a node metadata calls a worker", func(t *testing.T) {
		// The role comes from metadata and is checked before the lock: a worker answers
		// NOT_CONTROL_PLANE and stays fresh, so that it can still join its cluster.
		n := startInitNode(t, "worker")
		o := runInit(ctx, n.conn(t, "127.0.6.4", freshLock), initRequest(n.secret, 1))
		if o.failure != initproto.FailureCode_FAILURE_CODE_NOT_CONTROL_PLANE || o.started {
			t.Fatalf("init of a worker: %+v, want NOT_CONTROL_PLANE", o)
		}
		if err := n.attests(t, "127.0.6.5", freshLock); err != nil {
			t.Fatalf("the worker no longer attests as fresh: %v", err)
		}
		if strings.Contains(n.proc.Tail(200), "node locked") {
			t.Fatal("the worker took the node lock")
		}
	})
}
