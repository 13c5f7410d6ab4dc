package cli

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/tpmsim"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/prereq"
	"github.com/berth-k8s/berth/internal/workspace"
	"github.com/berth-k8s/berth/recoverproto"
)

const testDiskUUID = "3c6e1f0a-9b2d-4c8e-a1f7-5d0b2e4c6a8f"

// fakeRecovery is a node's recovery server that records what it was sent.
type fakeRecovery struct {
	recoverproto.UnimplementedRecoveryServiceServer

	mu     sync.Mutex
	info   *recoverproto.InfoResponse
	refuse error
	infos  int
	keys   [][]byte
}

func (f *fakeRecovery) Info(context.Context, *recoverproto.InfoRequest) (*recoverproto.InfoResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.infos++
	return f.info, nil
}

func (f *fakeRecovery) Recover(_ context.Context, req *recoverproto.RecoverRequest) (*recoverproto.RecoverResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.keys = append(f.keys, req.GetDiskKey())
	if f.refuse != nil {
		return nil, f.refuse
	}
	return &recoverproto.RecoverResponse{}, nil
}

// set replaces what the node answers and forgets what it was sent.
func (f *fakeRecovery) set(info *recoverproto.InfoResponse, refuse error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.info, f.refuse, f.infos, f.keys = info, refuse, 0, nil
}

func (f *fakeRecovery) sent() (infos int, keys [][]byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.infos, f.keys
}

// recoveryNode serves fake on loopback; with sim it attests with the simulator's TPM, as a node's
// recovery server does with the node's attested TLS server credentials.
func recoveryNode(t *testing.T, fake *fakeRecovery, sim *tpmsim.Simulator) string {
	t.Helper()
	creds := insecure.NewCredentials()
	if sim != nil {
		var err error
		if creds, err = atls.NewCredentials(vtpm.NewIssuer(sim.Open, zap.NewNop()), nil); err != nil {
			t.Fatal(err)
		}
	}
	srv := grpc.NewServer(grpc.Creds(creds))
	recoverproto.RegisterRecoveryServiceServer(srv, fake)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// simulatedTPM powers on the reference simulator with an EK certificate from a new CA and returns
// it and the CA's PEM.
func simulatedTPM(t *testing.T) (*tpmsim.Simulator, []byte) {
	t.Helper()
	sim, err := tpmsim.New()
	if errors.Is(err, tpmsim.ErrUnavailable) {
		prereq.Missing(t, "the TPM simulator needs cgo")
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sim.Close() })
	ca, err := vtpmtest.NewCA("node EK CA")
	if err != nil {
		t.Fatal(err)
	}
	if err := vtpmtest.ProvisionEKCert(t.Context(), sim.Open, ca); err != nil {
		t.Fatal(err)
	}
	return sim, ca.PEM()
}

// newMasterSecret writes a master-secret.json as berth init does and returns its path and keys.
func newMasterSecret(t *testing.T, dir, name string, fill byte) (string, *clusterkeys.Keys) {
	t.Helper()
	master, salt := bytes.Repeat([]byte{fill}, 32), bytes.Repeat([]byte{fill ^ 0xff}, 32)
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, workspace.EncodeSecret(master, salt), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	return path, keys
}

// secretsIn lists the forms of the master secret and the disk key found in out.
func secretsIn(out string, keys *clusterkeys.Keys) []string {
	var found []string
	for name, b := range map[string][]byte{"master secret": keys.MasterSecret(), "legacy disk key": keys.LegacyDiskKey(testDiskUUID)} {
		for _, form := range []string{string(b), hex.EncodeToString(b), base64.StdEncoding.EncodeToString(b), base64.RawStdEncoding.EncodeToString(b)} {
			if strings.Contains(out, form) {
				found = append(found, name)
			}
		}
	}
	return found
}

func TestRecoverUsage(t *testing.T) {
	dir := t.TempDir()
	secret, _ := newMasterSecret(t, dir, "master-secret.json", 1)
	damaged := filepath.Join(dir, "damaged.json")
	if err := os.WriteFile(damaged, []byte(`{"masterSecret":"AAAA","salt":"AAAA"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	policyPath := filepath.Join(dir, "policy.yaml") // never read: every case fails before
	for name, args := range map[string][]string{
		"no flags":                 {"recover"},
		"no master secret":         {"recover", "--endpoint", "127.0.0.1:1", "--policy", policyPath},
		"no endpoint":              {"recover", "--master-secret", secret, "--policy", policyPath},
		"no policy":                {"recover", "--endpoint", "127.0.0.1:1", "--master-secret", secret},
		"policy and insecure":      {"recover", "--endpoint", "127.0.0.1:1", "--master-secret", secret, "--policy", policyPath, "--insecure-skip-attestation"},
		"missing master secret":    {"recover", "--endpoint", "127.0.0.1:1", "--master-secret", filepath.Join(dir, "none.json"), "--insecure-skip-attestation"},
		"damaged master secret":    {"recover", "--endpoint", "127.0.0.1:1", "--master-secret", damaged, "--insecure-skip-attestation"},
		"master secret not json":   {"recover", "--endpoint", "127.0.0.1:1", "--master-secret", policyPath + ".x", "--insecure-skip-attestation"},
		"missing attestation file": {"recover", "--endpoint", "127.0.0.1:1", "--master-secret", secret, "--policy", policyPath},
	} {
		if code, out := run(args...); code != exitUsage {
			t.Errorf("%s: exit %d, want %d\n%s", name, code, exitUsage, out)
		}
	}
	code, out := run("recover", "--help")
	for _, want := range []string{"rejoin ticket", "full power loss", "TPM was cleared", "stays on this machine", "--master-secret", "--insecure-skip-attestation"} {
		if !strings.Contains(out, want) {
			t.Errorf("recover --help lacks %q", want)
		}
	}
	if code != 0 {
		t.Errorf("recover --help: exit %d", code)
	}
}

// TestRecoverAttested runs berth recover against a node that attests with a simulated TPM.
func TestRecoverAttested(t *testing.T) {
	sim, caPEM := simulatedTPM(t)
	fake := &fakeRecovery{}
	addr := recoveryNode(t, fake, sim)
	dir := t.TempDir()
	zero := strings.Repeat("00", 32)
	good := writePolicy(t, dir, "policy.yaml", "  15: {expected: "+zero+"}\n", caPEM)
	strict := writePolicy(t, dir, "strict.yaml", "  0: {expected: "+strings.Repeat("ab", 32)+"}\n  15: {expected: "+zero+"}\n", caPEM)
	right, keys := newMasterSecret(t, dir, "master-secret.json", 1)
	wrong, wrongKeys := newMasterSecret(t, dir, "other-master-secret.json", 2)
	identity, err := vtpm.NewIssuer(sim.Open, zap.NewNop()).MachineIdentity(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	nodeInfo := &recoverproto.InfoResponse{DiskUuid: testDiskUUID, ClusterId: keys.ClusterID(), DiskBinding: keys.DiskBinding(testDiskUUID, identity)}
	recoverWith := func(secret, policyPath string) (int, string) {
		return run("recover", "--endpoint", addr, "--master-secret", secret, "--policy", policyPath, "--connect-timeout", "30s")
	}

	t.Run("right master secret sends the disk's key", func(t *testing.T) {
		fake.set(nodeInfo, nil)
		code, out := recoverWith(right, good)
		if code != 0 || !strings.Contains(out, "Sent the disk key for state disk "+testDiskUUID+" to "+addr+"; the node opened it") {
			t.Fatalf("exit %d\n%s", code, out)
		}
		_, sent := fake.sent()
		if len(sent) != 1 || !bytes.Equal(sent[0], keys.DiskKey(testDiskUUID, identity)) {
			t.Fatalf("the node got %d keys, want exactly clusterkeys' DiskKey(%s, its identity)", len(sent), testDiskUUID)
		}
		if found := secretsIn(out, keys); len(found) > 0 || strings.Contains(out, hex.EncodeToString(keys.DiskKey(testDiskUUID, identity))) {
			t.Fatalf("the output shows the %v or the disk key", found)
		}
	})

	t.Run("a disk bound before keys named the machine gets its legacy key", func(t *testing.T) {
		fake.set(&recoverproto.InfoResponse{DiskUuid: testDiskUUID, ClusterId: keys.ClusterID(), DiskBinding: keys.LegacyDiskBinding(testDiskUUID, identity)}, nil)
		if code, out := recoverWith(right, good); code != 0 {
			t.Fatalf("exit %d\n%s", code, out)
		}
		if _, sent := fake.sent(); len(sent) != 1 || !bytes.Equal(sent[0], keys.LegacyDiskKey(testDiskUUID)) {
			t.Fatal("the node did not get its legacy disk key")
		}
	})

	// The attack: a node names another machine's disk (its UUID is public) with that disk's binding,
	// or with none; the operator's tool must not hand it that disk's key.
	for name, binding := range map[string][]byte{
		"another machine's binding":        keys.DiskBinding(testDiskUUID, []byte("EK digest of another machine")),
		"another machine's legacy binding": keys.LegacyDiskBinding(testDiskUUID, []byte("EK digest of another machine")),
		"no binding":                       nil,
		"another cluster's binding":        wrongKeys.DiskBinding(testDiskUUID, identity),
	} {
		t.Run("a disk bound to another machine gets nothing: "+name, func(t *testing.T) {
			fake.set(&recoverproto.InfoResponse{DiskUuid: testDiskUUID, ClusterId: keys.ClusterID(), DiskBinding: binding}, nil)
			code, out := recoverWith(right, good)
			if code != exitRejected || !strings.Contains(out, "the state disk is not bound to this machine that attested") || !strings.Contains(out, "nothing was sent") {
				t.Fatalf("exit %d\n%s", code, out)
			}
			if _, sent := fake.sent(); len(sent) != 0 {
				t.Fatalf("the node got %d keys for a disk bound to another machine", len(sent))
			}
		})
	}

	t.Run("wrong master secret is refused before anything is sent", func(t *testing.T) {
		fake.set(nodeInfo, nil)
		code, out := recoverWith(wrong, good)
		ours, theirs := hex.EncodeToString(wrongKeys.ClusterID())[:8], hex.EncodeToString(keys.ClusterID())[:8]
		for _, want := range []string{"the master secret in " + wrong + " derives cluster ID " + ours + "…", "belongs to cluster " + theirs + "…", "wrong master secret or wrong node", "nothing was sent"} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q", want)
			}
		}
		if code != exitRejected {
			t.Errorf("exit %d, want %d\n%s", code, exitRejected, out)
		}
		if infos, sent := fake.sent(); infos != 1 || len(sent) != 0 {
			t.Fatalf("the node was asked %d times and got %d keys, want 1 and 0", infos, len(sent))
		}
		if found := secretsIn(out, wrongKeys); len(found) > 0 {
			t.Fatalf("the output shows the %v", found)
		}
	})

	t.Run("the node refusing the key is a clear error, its text escaped", func(t *testing.T) {
		fake.set(nodeInfo, status.Error(codes.InvalidArgument, "the key does not open this node's state disk; nothing changed\x1b[2J\nforged line"))
		code, out := recoverWith(right, good)
		if code != exitRejected || !strings.Contains(out, "the node refused the disk key for state disk "+testDiskUUID) ||
			!strings.Contains(out, `InvalidArgument "the key does not open this node's state disk; nothing changed\x1b[2J\nforged line"`) {
			t.Fatalf("exit %d\n%s", code, out)
		}
		if strings.ContainsAny(out, "\x1b") || strings.Contains(out, "\nforged line") {
			t.Fatalf("the node's text reached the terminal unescaped:\n%q", out)
		}
	})

	t.Run("a malformed disk UUID gets no key", func(t *testing.T) {
		fake.set(&recoverproto.InfoResponse{DiskUuid: "../\x1b]0;x\a", ClusterId: keys.ClusterID()}, nil)
		code, out := recoverWith(right, good)
		if code == 0 || !strings.Contains(out, "no valid state disk UUID") || strings.ContainsAny(out, "\x1b\a") {
			t.Fatalf("exit %d\n%q", code, out)
		}
		if _, sent := fake.sent(); len(sent) != 0 {
			t.Fatal("a key was sent for a malformed disk UUID")
		}
	})

	t.Run("a node that fails attestation gets nothing", func(t *testing.T) {
		fake.set(nodeInfo, nil)
		code, out := recoverWith(right, strict)
		if code != exitRejected || !strings.Contains(out, "failed attestation; nothing was sent") || !strings.Contains(out, "index 0") {
			t.Fatalf("exit %d\n%s", code, out)
		}
		if infos, sent := fake.sent(); infos != 0 || len(sent) != 0 {
			t.Fatalf("an unattested node was asked %d times and got %d keys", infos, len(sent))
		}
	})

	t.Run("a node whose lock register is extended gets nothing", func(t *testing.T) {
		// A policy that allows it: the refusal is recover's own.
		lenient := writePolicy(t, dir, "lenient.yaml", "  15: {nonZero: true}\n", caPEM)
		if err := vtpm.NewLockRegister(sim.Open, vtpm.DefaultLockPCR).MarkBootstrapped(t.Context(), keys.ClusterID()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sim.Reset() })
		fake.set(nodeInfo, nil)
		code, out := recoverWith(right, lenient)
		if code != exitRejected || !strings.Contains(out, "lock register (index 15)") || !strings.Contains(out, "nothing was sent") {
			t.Fatalf("exit %d\n%s", code, out)
		}
		if infos, sent := fake.sent(); infos != 0 || len(sent) != 0 {
			t.Fatalf("a locked node was asked %d times and got %d keys", infos, len(sent))
		}
	})
}

// TestRecoverInsecure: without attestation the same checks of the master secret hold.
func TestRecoverInsecure(t *testing.T) {
	fake := &fakeRecovery{}
	addr := recoveryNode(t, fake, nil)
	dir := t.TempDir()
	right, keys := newMasterSecret(t, dir, "master-secret.json", 3)
	identity := []byte("instance/worker-3")
	fake.set(&recoverproto.InfoResponse{DiskUuid: testDiskUUID, ClusterId: keys.ClusterID(), DiskBinding: keys.DiskBinding(testDiskUUID, identity)}, nil)
	code, out := run("recover", "--endpoint", addr, "--master-secret", right, "--insecure-skip-attestation")
	if code != exitRejected || !strings.Contains(out, "pass --node-name") {
		t.Fatalf("no node name: exit %d\n%s", code, out)
	}
	code, out = run("recover", "--endpoint", addr, "--master-secret", right, "--insecure-skip-attestation", "--node-name", "worker-4")
	if code != exitRejected || !strings.Contains(out, "not bound to this machine") {
		t.Fatalf("another node's name: exit %d\n%s", code, out)
	}
	if _, sent := fake.sent(); len(sent) != 0 {
		t.Fatal("a key was sent without the node's name, or for another node's name")
	}
	code, out = run("recover", "--endpoint", addr, "--master-secret", right, "--insecure-skip-attestation", "--node-name", "worker-3")
	if code != 0 || !strings.Contains(out, "WARNING: attestation is skipped") {
		t.Fatalf("exit %d\n%s", code, out)
	}
	if _, sent := fake.sent(); len(sent) != 1 || !bytes.Equal(sent[0], keys.DiskKey(testDiskUUID, identity)) {
		t.Fatal("the node did not get its disk key")
	}
	fake.set(&recoverproto.InfoResponse{DiskUuid: testDiskUUID}, nil)
	code, out = run("recover", "--endpoint", addr, "--master-secret", right, "--insecure-skip-attestation", "--node-name", "worker-3")
	if code == 0 || !strings.Contains(out, "not bound to a cluster") {
		t.Fatalf("unbound disk: exit %d\n%s", code, out)
	}
	if _, sent := fake.sent(); len(sent) != 0 {
		t.Fatal("a key was sent for an unbound disk")
	}
}
