package initserver

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// readRestore is what the fake restore-etcd phase records: the snapshot's cluster and whether its
// file is there, e.g. "ab12... file 1234 bytes".
func readRestore(job *initcluster.Job) string {
	r := job.Req.Restore
	if r == nil {
		return "no restore"
	}
	fi, err := os.Stat(r.Snapshot)
	if err != nil {
		return r.Manifest.ClusterID + " " + err.Error()
	}
	return fmt.Sprintf("%s file %d bytes", r.Manifest.ClusterID, fi.Size())
}

// sealed returns a snapshot of etcd data sealed under the keys of master (as request(master) sends).
func sealed(t *testing.T, master byte, data []byte) ([]byte, *clusterkeys.Keys) {
	t.Helper()
	keys, err := clusterkeys.New(bytes.Repeat([]byte{master}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	m := backup.Manifest{ClusterID: hex.EncodeToString(keys.ClusterID()), Taken: time.Unix(1_900_000_000, 0), KMS: backup.KMSKeysOf(keys, []uint32{1, 2}, 2)}
	if _, err := backup.Seal(&buf, keys, m, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), keys
}

// restoreTranscript sends req and then snapshot in chunks of chunk bytes (messages, when set,
// replaces the chunks) and renders the answer as transcript does, a failure with its message.
func (h *harness) restoreTranscript(t *testing.T, req *initproto.InitRequest, snapshot []byte, chunk int, messages ...*initproto.RestoreRequest) ([]string, error) {
	t.Helper()
	stream, err := h.client.Restore(context.Background())
	if err != nil {
		return nil, err
	}
	msgs := []*initproto.RestoreRequest{{Kind: &initproto.RestoreRequest_Init{Init: req}}}
	if messages != nil {
		msgs = append(msgs, messages...)
	}
	for off := 0; messages == nil && off < len(snapshot); off += chunk {
		msgs = append(msgs, &initproto.RestoreRequest{Kind: &initproto.RestoreRequest_Snapshot{Snapshot: snapshot[off:min(off+chunk, len(snapshot))]}})
	}
	for _, m := range msgs {
		if err := stream.Send(m); err != nil {
			break // the server answered early; its answer is in the stream
		}
	}
	_ = stream.CloseSend()
	return render(stream, (*initproto.InitFailure).GetMessage)
}

// A snapshot larger than gRPC's 4 MiB message limit arrives in chunks, is opened with the request's
// master secret, and reaches the restore phases as a file that is gone once the call ended.
func TestRestoreReceivesSnapshotInChunks(t *testing.T) {
	dir := t.TempDir()
	f := &fakeInit{}
	h := newHarness(t, f, WithSnapshotDir(dir))
	data := bytes.Repeat([]byte("etcd data "), 600_000) // 6 MB
	snap, keys := sealed(t, 1, data)
	got, err := h.restoreTranscript(t, request(1), snap, MaxSnapshotChunk)
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, append([]string{"log"}, append(phasesOK("preflight", "kubeadm-config", "certs", initcluster.PhaseRestoreEtcd,
		"kubeadm-init", "wait-apiserver", "components", initcluster.PhaseAdminKubeconfig), "SUCCESS")...))
	if want := fmt.Sprintf("%x file %d bytes", keys.ClusterID(), len(snap)); f.restored != want {
		t.Errorf("restore-etcd saw %q, want %q", f.restored, want)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("the received snapshot is still there: %v", left)
	}
}

// What the node refuses before it takes the node lock, named, leaving it fresh and its snapshot
// directory empty.
func TestRestoreRefusesBadSnapshots(t *testing.T) {
	// Several of age's 64 KiB chunks: a cut or change at the end is past the manifest's chunk.
	good, _ := sealed(t, 1, bytes.Repeat([]byte("etcd data "), 30000))
	other, _ := sealed(t, 7, []byte("etcd data"))
	flipped := bytes.Clone(good)
	flipped[len(flipped)-20] ^= 1
	for _, tc := range []struct {
		name     string
		snapshot []byte
		messages []*initproto.RestoreRequest
		want     string
	}{
		{name: "another cluster's", snapshot: other, want: backup.ErrWrongSecret.Error()},
		{name: "cut short", snapshot: good[:len(good)-30], want: backup.ErrCorrupt.Error()},
		{name: "changed", snapshot: flipped, want: backup.ErrCorrupt.Error()},
		{name: "empty", messages: []*initproto.RestoreRequest{}, want: ErrSnapshotStream.Error()},
		{name: "a second request", messages: []*initproto.RestoreRequest{{Kind: &initproto.RestoreRequest_Init{Init: request(1)}}}, want: ErrSnapshotStream.Error()},
		{name: "a chunk over 1 MiB", messages: []*initproto.RestoreRequest{{Kind: &initproto.RestoreRequest_Snapshot{Snapshot: make([]byte, MaxSnapshotChunk+1)}}}, want: ErrSnapshotStream.Error()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			f := &fakeInit{}
			h := newHarness(t, f, WithSnapshotDir(dir))
			got, err := h.restoreTranscript(t, request(1), tc.snapshot, 1000, tc.messages...)
			if err != nil {
				t.Fatal(err)
			}
			want := "FAILURE INVALID_REQUEST snapshot: " + tc.want + "; nothing was changed on the node"
			if len(got) == 0 || got[len(got)-1] != want {
				t.Fatalf("stream = %q, want it to end with %q", got, want)
			}
			if ran := f.Ran(); len(ran) != 0 {
				t.Errorf("phases ran: %v", ran)
			}
			if st, err := h.state.Load(); err != nil || st != nil {
				t.Errorf("node state = %+v, %v; want none (the node stays fresh)", st, err)
			}
			if locked, _ := h.lock.Locked(); locked {
				t.Error("the node lock was taken")
			}
			if left, _ := os.ReadDir(dir); len(left) != 0 {
				t.Errorf("the refused snapshot is still there: %v", left)
			}
		})
	}
}

// A caller without the init secret is refused as by Init, and the node reads none of its snapshot.
func TestRestoreWrongInitSecret(t *testing.T) {
	dir := t.TempDir()
	h := newHarness(t, &fakeInit{}, WithSnapshotDir(dir))
	snap, _ := sealed(t, 1, []byte("etcd data"))
	req := request(1)
	req.InitSecret = []byte("not the init secret")
	_, err := h.restoreTranscript(t, req, snap, 10)
	if status.Code(err) != codes.PermissionDenied || status.Convert(err).Message() != "init request rejected" {
		t.Fatalf("Restore with a wrong init secret = %v, want Init's PERMISSION_DENIED", err)
	}
	stream, err := h.client.Restore(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	_ = stream.Send(&initproto.RestoreRequest{Kind: &initproto.RestoreRequest_Snapshot{Snapshot: snap}})
	_ = stream.CloseSend()
	if _, err := stream.Recv(); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Restore starting with a chunk = %v, want PERMISSION_DENIED", err)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("a snapshot was received: %v", left)
	}
}

// An unfinished restore resumes only as a restore: a plain Init would run kubeadm init on an etcd
// directory it reset, a new empty cluster under the old one's ID.
func TestRestoreResumesOnlyAsRestore(t *testing.T) {
	f := &fakeInit{failAt: map[string]int{"kubeadm-init": 1}}
	h := newHarness(t, f, WithSnapshotDir(t.TempDir()))
	snap, _ := sealed(t, 1, []byte("etcd data"))
	got, err := h.restoreTranscript(t, request(1), snap, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if last := got[len(got)-1]; !strings.HasPrefix(last, "FAILURE PHASE_FAILED") {
		t.Fatalf("first attempt ended %q", last)
	}
	got, err = h.transcript(t, request(1))
	if err != nil {
		t.Fatal(err)
	}
	equal(t, got, []string{"FAILURE INVALID_REQUEST "})
	got, err = h.restoreTranscript(t, request(1), snap, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if got[len(got)-1] != "SUCCESS" || !strings.Contains(strings.Join(got, ","), initcluster.PhaseRestoreEtcd+" SKIPPED") {
		t.Fatalf("resumed restore: %q", got)
	}
}
