package attack

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/bootstrapper/bootstage"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/internal/statedisk"
	"github.com/berth-k8s/berth/internal/workspace"
	"github.com/berth-k8s/berth/recoverproto"
)

// recoveryNode is a worker whose bootstrapper waits for berth recover: the real binary on swtpm with
// an fscrypt state disk bound to the cluster (its disk key derived from the master secret for this
// machine, as the joinservice derives it) but no key sealed to its TPM, and a control plane in
// metadata that does not answer, so that no rejoin ticket comes either.
type recoveryNode struct {
	addr string
	proc *proctest.Process
	log  string
	// secret is master-secret.json, policy the policy berth recover checks the node against.
	secret, policy string
	// berth is the operator's CLI, built before any flood starts.
	berth string
}

func startRecoveryNode(t *testing.T) *recoveryNode {
	t.Helper()
	requireStateDisk(t)
	swCA := vtpmtest.NewSwtpmCA(t) // skips without swtpm (fails under CI=true)
	tpm := vtpmtest.StartSwtpm(t, swCA)
	dir := t.TempDir()
	n := &recoveryNode{addr: proctest.FreeAddr(t), log: filepath.Join(dir, "bootstrapper.log"),
		secret: filepath.Join(dir, "master-secret.json"), policy: filepath.Join(dir, "policy.yaml"),
		berth: proctest.Build(t, "github.com/berth-k8s/berth/cmd/berth")}

	// The disk as a worker's join left it, without the sealed key: a cleared TPM, or a boot measured
	// differently, needs the cluster's key again.
	master, salt := make([]byte, 32), make([]byte, 32)
	_, _ = rand.Read(master)
	_, _ = rand.Read(salt)
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	image, mnt := filepath.Join(dir, "state.img"), filepath.Join(dir, "state-mount")
	disk := statedisk.NewFscrypt(image, mnt, statedisk.Exec{}, zap.NewNop(), statedisk.WithImageSize(testImageSize))
	issuer := vtpm.NewIssuer(tpm.Open, zap.NewNop())
	stage := bootstage.New(bootstage.Config{Log: zap.NewNop(), Disk: disk, Identity: issuer.MachineIdentity})
	if _, err := stage.Open(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := stage.BindWithKeys(t.Context(), keys); err != nil {
		t.Fatal(err)
	}
	// The worker's join finished: once the disk is open again its daemon starts its kubelet.
	statePath := filepath.Join(disk.Root(), "var-lib-berth", "node-state.json")
	if err := os.MkdirAll(filepath.Dir(statePath), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := nodestate.NewStore(afero.NewOsFs(), statePath).Save(&nodestate.State{
		Role: nodestate.RoleJoin, ClusterID: hex.EncodeToString(keys.ClusterID()), NodeName: "worker-r", Done: true}); err != nil {
		t.Fatal(err)
	}
	if err := disk.Close(t.Context()); err != nil {
		t.Fatal(err)
	}

	targets := map[string]string{}
	for _, name := range []string{"etc-kubernetes", "var-lib-kubelet", "var-lib-etcd", "state"} {
		targets[name] = filepath.Join(dir, name)
	}
	// Once the daemon stopped (cleanups run in reverse): the state disk's bind mounts and the disk.
	t.Cleanup(func() {
		for _, target := range targets {
			for syscall.Unmount(target, 0) == nil {
			}
		}
		if err := disk.Close(context.Background()); err != nil {
			t.Errorf("closing the recovered state disk: %v", err)
		}
	})
	files := map[string]string{
		"metadata.yaml": "self: {name: worker-r, role: worker, ips: [127.0.0.1]}\npeers:\n  - {name: cp-1, role: control-plane, ips: [" + unknownIP + "]}\n",
		"kubeadm":       "#!/bin/sh\necho \"kubeadm stand-in: $*\"; exit 1\n",
		"kubelet":       "#!/bin/sh\nexec sleep 600\n",
		"cri.sock":      "",
		"policy.yaml": "variant: tpm\nmeasurements:\n  15: {expected: " + zero + "}\ntrustRoots:\n  - pem: |\n" +
			indent(string(swCA.RootPEM(t))+string(swCA.IssuerPEM(t)), "      "),
		"master-secret.json": string(workspace.EncodeSecret(master, salt)),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	n.proc = proctest.Start(t, proctest.Cmd{
		Name: "bootstrapper", Path: proctest.Build(t, "github.com/berth-k8s/berth/bootstrapper/cmd/bootstrapper"), Grace: 20 * time.Second,
		LogFile: n.log,
		Args: []string{"--metadata=static", "--metadata-file=" + filepath.Join(dir, "metadata.yaml"),
			"--attestation=tpm", "--tpm=" + tpm.Spec, "--lock-pcr=15",
			"--state-disk-backend=fscrypt", "--state-disk=" + image, "--state-mount=" + mnt, "--recovery-listen=" + n.addr,
			"--state-dir=" + targets["state"], "--run-dir=" + filepath.Join(dir, "run"), "--init-listen=" + proctest.FreeAddr(t),
			"--kubelet=process", "--kubelet-path=" + filepath.Join(dir, "kubelet"), "--kubeadm-path=" + filepath.Join(dir, "kubeadm"),
			"--kubernetes-dir=" + targets["etc-kubernetes"], "--kubelet-dir=" + targets["var-lib-kubelet"], "--etcd-dir=" + targets["var-lib-etcd"],
			"--cri-socket=unix://" + filepath.Join(dir, "cri.sock"), "--never-pull"},
	})
	// Ready once the recovery server waits: the boot stage found no key it could use.
	if err := proctest.WaitReady(t.Context(), 50*time.Millisecond, time.Minute, func(context.Context) error {
		if len(n.lines(t, "recovery server waiting for berth recover")) == 0 {
			return errors.New("the recovery server does not wait yet")
		}
		return nil
	}, n.proc); err != nil {
		t.Fatalf("waiting for the recovery server: %v", err)
	}
	return n
}

// logLine is a line of the bootstrapper's JSON log.
type logLine struct {
	Msg  string `json:"msg"`
	Peer string `json:"peer"`
}

// lines returns the node's log lines whose message is one of msgs (all lines without msgs), in order.
func (n *recoveryNode) lines(t *testing.T, msgs ...string) []logLine {
	t.Helper()
	b, err := os.ReadFile(n.log)
	if err != nil {
		t.Fatal(err)
	}
	var out []logLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l logLine
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			continue
		}
		for _, m := range msgs {
			if l.Msg == m {
				out = append(out, l)
				break
			}
		}
		if len(msgs) == 0 {
			out = append(out, l)
		}
	}
	return out
}

// recover runs the real berth recover against the node from 127.0.0.1 and returns how long it took.
func (n *recoveryNode) recover(t *testing.T) (time.Duration, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Second)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, n.berth, "recover", "--endpoint", n.addr, "--master-secret", n.secret, "--policy", n.policy,
		"--connect-timeout", "30s", "--timeout", "30s").CombinedOutput()
	took := time.Since(start)
	if err != nil {
		return took, fmt.Errorf("berth recover: %w\n%s", err, out)
	}
	if !strings.Contains(string(out), "the node opened it and continues booting") {
		return took, fmt.Errorf("berth recover succeeded without saying the node opened its disk:\n%s", out)
	}
	return took, nil
}

// wrongKeyAnswers counts the answers of a wrong-key flood by how each call ended.
type wrongKeyAnswers struct {
	mu     sync.Mutex
	byCode map[codes.Code]int
}

func (a *wrongKeyAnswers) add(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.byCode[status.Code(err)]++
}

func (a *wrongKeyAnswers) String() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var parts []string
	for _, c := range []codes.Code{codes.ResourceExhausted, codes.InvalidArgument, codes.FailedPrecondition, codes.Unavailable, codes.Canceled, codes.DeadlineExceeded, codes.OK} {
		if a.byCode[c] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", a.byCode[c], c))
		}
	}
	for c, k := range a.byCode {
		switch c {
		case codes.ResourceExhausted, codes.InvalidArgument, codes.FailedPrecondition, codes.Unavailable, codes.Canceled, codes.DeadlineExceeded, codes.OK:
		default:
			parts = append(parts, fmt.Sprintf("%d %s", k, c))
		}
	}
	return strings.Join(parts, ", ")
}

// The messages of the node's recovery server that the wrong-key test reads in its log.
const (
	msgWrongKey = "recovery key does not open the state disk"
	msgInfo     = "recovery info requested"
	msgOpened   = "state disk opened by berth recover"
	msgRefused  = "recovery calls refused: over the per-address limit"
)

// TestRecoverThroughWrongKeyFlood: 2,000 Recover calls with wrong keys, sent at once over 8 attested
// connections from 8 loopback addresses, are in the hands of a real bootstrapper waiting for
// recovery when the operator's real berth recover connects from another address. The node bounds
// Recover calls per peer address (one waiting or running, one a second after a burst of 3;
// bootstrapper/recoveryserver): the rest are refused RESOURCE_EXHAUSTED at once, and the operator's
// key waits for at most one open per flooding address and the one being tried. (Queued, as they
// were, the operator's key waited for every wrong key before it.) It prints berth recover's time
// alone and under the flood, how the 2,000 calls were answered and how many log lines they cost.
func TestRecoverThroughWrongKeyFlood(t *testing.T) {
	const addresses, calls = 8, 2000

	alone, err := startRecoveryNode(t).recover(t)
	if err != nil {
		t.Fatalf("berth recover without a flood: %v", err)
	}

	n := startRecoveryNode(t)
	floodCtx, stop := context.WithTimeout(t.Context(), time.Minute)
	defer stop()
	// The attacker verifies the node as the operator does (anyone can: its policy names only the
	// image and the TPM vendor's CA) and gets attested connections.
	p, err := policy.Load(n.policy)
	if err != nil {
		t.Fatal(err)
	}
	validator, err := choose.NewValidator(p, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	clientCreds, err := atls.NewCredentials(nil, validator)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*grpc.ClientConn, addresses)
	for i := range conns {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 30, byte(i+1))}}
		conn, err := grpc.NewClient("passthrough:///"+n.addr, grpc.WithTransportCredentials(clientCreds),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conns[i] = conn
	}
	linesBefore := len(n.lines(t))
	answers := &wrongKeyAnswers{byCode: map[codes.Code]int{}}
	var wg sync.WaitGroup
	var sent atomic.Int64
	wrongKey := bytes.Repeat([]byte{0x5a}, 32)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sent.Add(1)
			_, err := recoverproto.NewRecoveryServiceClient(conns[i%addresses]).Recover(floodCtx, &recoverproto.RecoverRequest{DiskKey: wrongKey})
			answers.add(err)
		}()
	}
	// The flood is in the node's hands once every call was sent and the node tried a first wrong key.
	if err := wait.PollUntilContextCancel(floodCtx, 20*time.Millisecond, true, func(context.Context) (bool, error) {
		return sent.Load() == calls && len(n.lines(t, msgWrongKey)) > 0, nil
	}); err != nil {
		t.Fatalf("the flood never reached the node: %d calls sent, answers so far: %s", sent.Load(), answers)
	}
	flooded, err := n.recover(t)
	if err != nil {
		t.Fatalf("berth recover under %d wrong keys: %v", calls, err)
	}
	wg.Wait()
	stop()

	// Wrong keys the node tried between the operator's Info call and the open of its key.
	var ahead, tried int
	operator := false
	all := n.lines(t)
	for _, l := range all[linesBefore:] {
		switch {
		case l.Msg == msgInfo && strings.HasPrefix(l.Peer, "127.0.0.1:"):
			operator = true
		case l.Msg == msgWrongKey:
			tried++
			if operator {
				ahead++
			}
		case l.Msg == msgOpened:
			operator = false
		}
	}
	t.Logf("berth recover alone: %s; under %d wrong-key Recover calls from %d addresses: %s",
		alone.Round(time.Millisecond), calls, addresses, flooded.Round(time.Millisecond))
	t.Logf("the %d wrong-key calls were answered: %s; the node tried %d wrong keys (%d of them ahead of the operator's) and wrote %d log lines (%d sampled refusal lines)",
		calls, answers, tried, ahead, len(all)-linesBefore, len(n.lines(t, msgRefused)))
	if limit := addresses + 1; ahead > limit {
		t.Errorf("the node tried %d wrong keys ahead of the operator's, want at most one per flooding address and the one being tried (%d)", ahead, limit)
	}
	if answers.byCode[codes.ResourceExhausted] == 0 {
		t.Errorf("no wrong-key call was refused on its address's limit: %s", answers)
	}
}

// TestRecoverThroughProbeFlood: 500 addresses send identity probes to a node waiting for recovery as
// fast as they can while the operator's berth recover connects (probing the node's identity,
// activating its key, dialing again while refused) and sends the key. The probes are charged to
// the node's unauthenticated budget and never to the attested one (internal/atls), so the flood
// cannot use up the handshake berth recover needs. It prints berth recover's time under the flood.
func TestRecoverThroughProbeFlood(t *testing.T) {
	n := startRecoveryNode(t)
	// Longer than berth recover may try to connect: the flood outlasts every dial it makes.
	floodCtx, stop := context.WithTimeout(t.Context(), 55*time.Second)
	defer stop()
	start := time.Now()
	pf := startProbeFlood(floodCtx, n.addr, 500, 8)
	defer pf.stop()
	if err := pf.waitGoing(floodCtx); err != nil {
		t.Fatal(err)
	}
	t.Logf("berth recover starts with the flood at %d probes, %d rate-limited, after %s", pf.probes.Load(), pf.limited.Load(), time.Since(start).Round(time.Millisecond))
	cpu0 := processCPU(n.proc.PID())
	took, err := n.recover(t)
	cpu := processCPU(n.proc.PID()) - cpu0
	elapsed := time.Since(start)
	probes, limited := pf.probes.Load(), pf.limited.Load()
	pf.stop()
	t.Logf("probe flood: %d probes from %d addresses in %.1f s, %d rate-limited; the bootstrapper's CPU %.1f s over berth recover's %.1f s",
		probes, pf.addresses, elapsed.Seconds(), limited, cpu, took.Seconds())
	if err != nil {
		t.Fatalf("berth recover under the probe flood (%s): %v", took.Round(time.Millisecond), err)
	}
	t.Logf("berth recover under the probe flood: the node opened its disk after %s", took.Round(time.Millisecond))
	if len(n.lines(t, msgOpened)) != 1 {
		t.Fatal("berth recover succeeded but the node did not log the open")
	}
}
