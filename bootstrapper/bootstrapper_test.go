package bootstrapper

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/bootstrapper/initserver"
	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/nodelock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var secret = []byte("init secret for the bootstrapper test")

type hash []byte

func (h hash) InitSecretHash(context.Context) ([]byte, error) { return h, nil }

type noPhases struct{}

func (noPhases) Prepare(context.Context, *initcluster.Job) error { return nil }
func (noPhases) Phases(bool) []initcluster.Phase {
	return []initcluster.Phase{{Name: initcluster.PhaseAdminKubeconfig, Run: func(_ context.Context, j *initcluster.Job) error {
		j.Kubeconfig = []byte("kind: Config\n")
		return nil
	}}}
}

// kubelet records starts and runs until its context ends.
type kubelet struct{ started chan struct{} }

func newKubelet() *kubelet { return &kubelet{started: make(chan struct{}, 10)} }
func (k *kubelet) Start(context.Context) error {
	k.started <- struct{}{}
	return nil
}
func (k *kubelet) Run(ctx context.Context) error { <-ctx.Done(); return nil }

// joinClient takes the lock as "join" once release is closed, like a JoinClient that got a ticket.
type joinClient struct {
	lock    *Race
	release chan struct{}
	stopped chan struct{}
}

func (j *joinClient) Run(ctx context.Context) error {
	defer close(j.stopped)
	select {
	case <-ctx.Done():
		return nil
	case <-j.release:
	}
	err := j.lock.TryLockOnce(ctx, "join", []byte{7})
	if errors.Is(err, nodelock.ErrLocked) {
		return nil
	}
	return err
}

type node struct {
	fs      afero.Fs
	lock    *Race
	state   *nodestate.Store
	kubelet *kubelet
	join    *joinClient
	addr    string
	deps    Deps
}

func newNode(t *testing.T) *node {
	t.Helper()
	fsys := afero.NewMemMapFs()
	n := &node{fs: fsys, kubelet: newKubelet(), state: nodestate.NewStore(fsys, "/state/node-state.json")}
	n.lock = NewRace(nodelock.New(nodelock.NewFileMarker(fsys, "/state/bootstrapped")))
	n.join = &joinClient{lock: n.lock, release: make(chan struct{}), stopped: make(chan struct{})}
	sum := sha256.Sum256(secret)
	srv := initserver.New(zap.NewNop(), n.lock, hash(sum[:]), noPhases{}, n.state)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n.addr = lis.Addr().String()
	n.deps = Deps{Log: zap.NewNop(), Lock: n.lock, State: n.state, InitListener: lis, InitServer: srv, JoinClient: n.join,
		Kubelet: n.kubelet, Notify: func() error { return nil }}
	return n
}

func (n *node) run(t *testing.T) (cancel func() error) {
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, n.deps) }()
	return func() error { stop(); return <-done }
}

func waitPortFree(t *testing.T, addr string) {
	t.Helper()
	var lastErr error
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			lastErr = err
			return false, nil
		}
		lis.Close()
		return true, nil
	})
	if err != nil {
		t.Fatalf("init port %s still taken after join won: %v", addr, lastErr)
	}
}

func TestJoinWinsInitServerStops(t *testing.T) {
	n := newNode(t)
	stop := n.run(t)
	close(n.join.release)
	<-n.join.stopped
	waitPortFree(t, n.addr)
	if locked, owner := n.lock.lock.Locked(); !locked || owner != "join" {
		t.Fatalf("lock = %v by %q, want taken by join", locked, owner)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run() = %v", err)
	}
}

func TestInitWinsJoinClientStops(t *testing.T) {
	n := newNode(t)
	stop := n.run(t)
	conn, err := grpc.NewClient(n.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	stream, err := initproto.NewInitServiceClient(conn).Init(context.Background(), &initproto.InitRequest{
		InitSecret: secret, MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32),
		ClusterName: "berth", KubernetesVersion: "v1.34.2", ServiceCidr: "10.96.0.0/12", PodCidr: "10.244.0.0/16",
	})
	if err != nil {
		t.Fatal(err)
	}
	var success bool
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		success = success || resp.GetSuccess() != nil
	}
	if !success {
		t.Fatal("init did not succeed")
	}
	<-n.join.stopped // the JoinClient's context was cancelled when init took the lock
	if locked, owner := n.lock.lock.Locked(); !locked || owner != initserver.LockOwner {
		t.Fatalf("lock = %v by %q, want taken by init", locked, owner)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run() = %v", err)
	}
}

func TestRestartOfJoinedNodeOnlyStartsKubelet(t *testing.T) {
	n := newNode(t)
	if err := n.deps.Lock.lock.TryLockOnce(context.Background(), "join", []byte{1}); err != nil {
		t.Fatal(err)
	}
	if err := n.state.Save(&nodestate.State{Role: nodestate.RoleJoin, ClusterID: "01", NodeName: "w", Done: true}); err != nil {
		t.Fatal(err)
	}
	// A restarted daemon has a fresh in-memory lock over the same disk.
	n.deps.Lock = NewRace(nodelock.New(nodelock.NewFileMarker(n.fs, "/state/bootstrapped")))
	stop := n.run(t)
	<-n.kubelet.started
	waitPortFree(t, n.addr)
	if err := stop(); err != nil {
		t.Fatalf("Run() = %v", err)
	}
	select {
	case <-n.join.stopped:
		t.Fatal("JoinClient ran on a joined node")
	default:
	}
}

func TestRestartWithIncompleteJoinFails(t *testing.T) {
	n := newNode(t)
	if err := n.state.Save(&nodestate.State{Role: nodestate.RoleJoin, ClusterID: "01"}); err != nil {
		t.Fatal(err)
	}
	if err := Run(context.Background(), n.deps); !errors.Is(err, ErrIncompleteJoin) {
		t.Fatalf("Run() = %v, want ErrIncompleteJoin", err)
	}
	waitPortFree(t, n.addr)
}

func TestRestartOfInitializedNodeReconcilesComponents(t *testing.T) {
	for _, tc := range []struct {
		name          string
		done          bool
		wantReconcile bool
	}{
		{"init done", true, true},
		{"init not done", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			if err := n.deps.Lock.lock.TryLockOnce(context.Background(), initserver.LockOwner, []byte{1}); err != nil {
				t.Fatal(err)
			}
			if err := n.state.Save(&nodestate.State{Role: nodestate.RoleInit, ClusterID: "01", Done: tc.done}); err != nil {
				t.Fatal(err)
			}
			n.deps.Lock = NewRace(nodelock.New(nodelock.NewFileMarker(n.fs, "/state/bootstrapped")))
			reconciled := make(chan struct{})
			n.deps.Reconcile = func(ctx context.Context) error {
				close(reconciled)
				return errors.New("webhook not back") // logged, never fatal
			}
			stop := n.run(t)
			if tc.wantReconcile {
				<-reconciled
			}
			// The daemon still serves init requests (answering "already initialized").
			conn, err := net.Dial("tcp", n.addr)
			if err != nil {
				t.Fatalf("InitServer not serving after the restart: %v", err)
			}
			conn.Close()
			if err := stop(); err != nil {
				t.Fatalf("Run() = %v", err)
			}
			select {
			case <-reconciled:
				if !tc.wantReconcile {
					t.Fatal("Reconcile ran on a node whose init did not finish")
				}
			default:
			}
		})
	}
}

// kms records Restore and whether the keeper and plugin ran.
type kms struct {
	restored bool
	kubelet  *kubelet
	// beforeKubelet is whether Restore ran before the kubelet was started.
	beforeKubelet bool
	ran           chan string
}

func (k *kms) Restore() (bool, error) {
	k.beforeKubelet = len(k.kubelet.started) == 0
	return k.restored, nil
}
func (k *kms) Run(ctx context.Context) error { k.ran <- "keeper"; <-ctx.Done(); return nil }

type kmsPlugin struct{ k *kms }

func (p kmsPlugin) Run(ctx context.Context) error { p.k.ran <- "plugin"; <-ctx.Done(); return nil }

// A restarted control plane restores its KMS keys before the kubelet starts its API server, and runs
// the keeper and the plugin; a joined node without keys (a worker) runs neither.
func TestRestartRestoresKMSKeysFirst(t *testing.T) {
	for _, cp := range []bool{true, false} {
		n := newNode(t)
		if err := n.deps.Lock.lock.TryLockOnce(context.Background(), "join", []byte{1}); err != nil {
			t.Fatal(err)
		}
		if err := n.state.Save(&nodestate.State{Role: nodestate.RoleJoin, ClusterID: "01", NodeName: "n", Done: true}); err != nil {
			t.Fatal(err)
		}
		n.deps.Lock = NewRace(nodelock.New(nodelock.NewFileMarker(n.fs, "/state/bootstrapped")))
		k := &kms{restored: cp, kubelet: n.kubelet, ran: make(chan string, 2)}
		n.deps.KMS, n.deps.KMSPlugin = k, kmsPlugin{k}
		stop := n.run(t)
		<-n.kubelet.started
		if cp {
			got := map[string]bool{<-k.ran: true, <-k.ran: true}
			if !got["keeper"] || !got["plugin"] || !k.beforeKubelet {
				t.Errorf("control plane: ran %v, restored before the kubelet: %v", got, k.beforeKubelet)
			}
		}
		if err := stop(); err != nil {
			t.Fatalf("Run() = %v", err)
		}
		if !cp && len(k.ran) != 0 {
			t.Errorf("a worker ran the KMS %s", <-k.ran)
		}
	}
}

// TestLaterCheckInRunsAndItsErrorKeepsTheDaemon: the later check-in runs in the daemon's group once
// the kubelet was started; its error (a lock after REVOKED) is logged and the daemon keeps running
// until its context ends; the check-in's context ends with it.
func TestLaterCheckInRunsAndItsErrorKeepsTheDaemon(t *testing.T) {
	n := newNode(t)
	if err := n.deps.Lock.lock.TryLockOnce(context.Background(), "join", []byte{1}); err != nil {
		t.Fatal(err)
	}
	if err := n.state.Save(&nodestate.State{Role: nodestate.RoleJoin, ClusterID: "01", NodeName: "w", Done: true}); err != nil {
		t.Fatal(err)
	}
	n.deps.Lock = NewRace(nodelock.New(nodelock.NewFileMarker(n.fs, "/state/bootstrapped")))
	checkedIn := make(chan error, 1)
	n.deps.CheckIn = func(context.Context) error {
		select {
		case <-n.kubelet.started:
		default:
			checkedIn <- errors.New("the check-in ran before the kubelet was started")
			return nil
		}
		checkedIn <- nil
		return errors.New("this machine was removed from the cluster: the node is locked")
	}
	stop := n.run(t)
	if err := <-checkedIn; err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run() = %v; want the daemon to outlive the check-in's error until its context ends", err)
	}
}
