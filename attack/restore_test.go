package attack

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/proctest"
	"github.com/berth-k8s/berth/internal/workspace"
)

// sealedFor is a snapshot sealed under the keys initRequest(_, master) sends, of size bytes of etcd
// data.
func sealedFor(t *testing.T, master byte, size int) []byte {
	t.Helper()
	keys, err := clusterkeys.New(bytes.Repeat([]byte{master}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	m := backup.Manifest{ClusterID: hex.EncodeToString(keys.ClusterID()), Taken: time.Now(), KMS: backup.KMSKeysOf(keys, []uint32{1}, 1)}
	if _, err := backup.Seal(&buf, keys, m, bytes.NewReader(bytes.Repeat([]byte("etcd "), size/5))); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// restoreCall runs a Restore: the request, then snapshot in 1 MiB chunks. It returns the gRPC
// final InitFailure, if any, and the gRPC status of the call.
func restoreCall(ctx context.Context, c initproto.InitServiceClient, req *initproto.InitRequest, snapshot []byte) (*initproto.InitFailure, error) {
	stream, err := c.Restore(ctx)
	if err != nil {
		return nil, err
	}
	msgs := []*initproto.RestoreRequest{{Kind: &initproto.RestoreRequest_Init{Init: req}}}
	for off := 0; off < len(snapshot); off += 1 << 20 {
		msgs = append(msgs, &initproto.RestoreRequest{Kind: &initproto.RestoreRequest_Snapshot{Snapshot: snapshot[off:min(off+1<<20, len(snapshot))]}})
	}
	for _, m := range msgs {
		if stream.Send(m) != nil {
			break
		}
	}
	_ = stream.CloseSend()
	for {
		resp, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		if f := resp.GetFailure(); f != nil {
			return f, nil
		}
	}
}

// TestRestoreRefusals sends Restore calls to the real bootstrapper over attested TLS: a peer without
// the init secret streams a large snapshot and gets the generic PERMISSION_DENIED with nothing of it
// written to the node's disk; the operator's secret with another cluster's snapshot gets
// INVALID_REQUEST naming it, and the node stays fresh (its lock register still zero, so it still
// attests as fresh). Then the real berth restore sends a good snapshot: the node receives and opens it
// (its output says so) and only then starts the phases.
func TestRestoreRefusals(t *testing.T) {
	spool := t.TempDir()
	n := startInitNode(t, "control-plane", "--restore-snapshot-dir="+spool)
	conn := n.ready(t, "127.0.7.1")
	if conn == nil {
		t.Fatal("the InitServer never accepted an attested connection")
	}
	client := initproto.NewInitServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	big := sealedFor(t, 1, 8<<20)
	failure, err := restoreCall(ctx, client, initRequest([]byte("not the init secret"), 1), big)
	if status.Code(err) != codes.PermissionDenied || status.Convert(err).Message() != "init request rejected" || failure != nil {
		t.Errorf("Restore without the init secret = %v, %v; want the generic PERMISSION_DENIED", err, failure)
	}
	if left, _ := os.ReadDir(spool); len(left) != 0 {
		t.Errorf("a peer without the init secret got %v written to the node", left)
	}

	failure, err = restoreCall(ctx, client, initRequest(n.secret, 1), sealedFor(t, 9, 1<<20))
	if err != nil || failure.GetCode() != initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST ||
		!strings.Contains(failure.GetMessage(), backup.ErrWrongSecret.Error()) {
		t.Fatalf("Restore with another cluster's snapshot = %v, %v; want INVALID_REQUEST naming it", err, failure)
	}
	if err := n.attests(t, "127.0.7.2", freshLock); err != nil {
		t.Errorf("after the refused snapshot the node does not attest as fresh: %v", err)
	}
	if left, _ := os.ReadDir(spool); len(left) != 0 {
		t.Errorf("the refused snapshot was left on the node: %v", left)
	}

	// The real CLI, with the right master secret, attesting the node: the node opens the snapshot,
	// then its phases run (the stand-in kubeadm fails the preflight: this test has no kubeadm).
	berth := proctest.Build(t, "github.com/berth-k8s/berth/cmd/berth")
	dir := t.TempDir()
	master, salt := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)
	secretPath := filepath.Join(dir, "old-master-secret.json")
	snapPath := filepath.Join(dir, "etcd.berth-snapshot")
	config := filepath.Join(dir, "cluster.yaml")
	policyPath := filepath.Join(dir, "policy.yaml")
	for path, data := range map[string][]byte{
		policyPath: []byte(fmt.Sprintf("variant: tpm\nmeasurements:\n  15: {expected: %x}\n%s", freshLock, n.roots)),
		secretPath: workspace.EncodeSecret(master, salt),
		snapPath:   sealedFor(t, 1, 6<<20),
		config:     []byte(fmt.Sprintf("kubernetesVersion: v1.37.2\ninitSecret: %x\nattestationPolicyFile: %s\n", n.secret, policyPath)),
	} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ws := filepath.Join(dir, "ws")
	cmd := exec.CommandContext(ctx, berth, "restore", "--from", snapPath, "--master-secret", secretPath, "--endpoint", n.addr,
		"--config", config, "--workspace", ws, "--connect-timeout", "1m")
	out, err := cmd.CombinedOutput()
	t.Logf("berth restore (%v):\n%s", err, out)
	initLog, _ := os.ReadFile(filepath.Join(ws, workspace.InitLog))
	if !strings.Contains(string(out), "Sent the snapshot") || !strings.Contains(string(initLog), "[berth] received the snapshot of cluster") {
		t.Errorf("the node did not receive and open the snapshot; its output:\n%s", initLog)
	}
	if !strings.Contains(string(out), "preflight") {
		t.Errorf("the phases did not start after the snapshot")
	}
}
