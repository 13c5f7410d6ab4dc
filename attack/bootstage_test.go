package attack

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/berth-k8s/berth/bootstrapper/bootstage"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/prereq"
	"github.com/berth-k8s/berth/internal/statedisk"
	"github.com/berth-k8s/berth/joinproto"
)

// testImageSize keeps the suite's state disks small (sparse either way).
const testImageSize = 64 << 20

// requireStateDisk fails (CI) or skips without what the fscrypt state disk needs.
func requireStateDisk(t *testing.T) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	for _, path := range []string{"/dev/loop-control", "/sys/fs/ext4/features/encryption"} {
		if _, err := os.Stat(path); err != nil {
			missing = append(missing, path)
		}
	}
	for _, prog := range []string{"mkfs.ext4", "mount", "umount", "cp"} {
		if _, err := exec.LookPath(prog); err != nil {
			missing = append(missing, prog)
		}
	}
	if len(missing) > 0 {
		prereq.Missing(t, "the boot stage attack needs %s", strings.Join(missing, ", "))
	}
}

// bootNode is a node's boot stage as the bootstrapper runs it: its state disk (fscrypt image), its
// TPM (swtpm) sealing the disk key and holding the lock register, and the rejoin RPC against the
// suite's joinservice from the node's address, attesting with that TPM.
type bootNode struct {
	ip    string
	tpm   *vtpmtest.Swtpm
	image string
	disk  *statedisk.Fscrypt
	logs  *observer.ObservedLogs
	cfg   bootstage.Config
}

func (c *joinCluster) newBootNode(t *testing.T, ip string) *bootNode {
	t.Helper()
	dir := t.TempDir()
	n := &bootNode{ip: ip, tpm: vtpmtest.StartSwtpm(t, c.swCA), image: filepath.Join(dir, "state.img")}
	core, logs := observer.New(zap.InfoLevel)
	n.logs = logs
	log := zap.New(core)
	n.disk = statedisk.NewFscrypt(n.image, filepath.Join(dir, "mnt"), statedisk.Exec{}, log.Named("statedisk"), statedisk.WithImageSize(testImageSize))
	t.Cleanup(func() { _ = n.disk.Close(context.Background()) })
	issuer := vtpm.NewIssuer(n.tpm.Open, zap.NewNop())
	n.cfg = bootstage.Config{
		Log: log, Disk: n.disk,
		Sealer: vtpm.NewSealer(n.tpm.Open, []uint{4}, vtpm.DefaultLockPCR),
		Locks:  []bootstage.LockRegister{vtpm.NewLockRegister(n.tpm.Open, vtpm.DefaultLockPCR)},
		Rejoin: func(ctx context.Context, diskUUID string, binding []byte) ([]byte, []byte, error) {
			conn, err := c.dial(ip, issuer, c.joinPolicy)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close()
			resp, err := joinproto.NewJoinServiceClient(conn).IssueRejoinTicket(ctx, &joinproto.IssueRejoinTicketRequest{DiskUuid: diskUUID, DiskBinding: binding})
			if err != nil {
				return nil, nil, err
			}
			return resp.GetDiskKey(), resp.GetClusterId(), nil
		},
		Identity:       issuer.MachineIdentity,
		RefusedBackoff: time.Second,
	}
	// A first boot: a fresh disk, joined (the ticket's disk key, cluster ID and binding), sealed.
	stage := bootstage.New(n.cfg)
	if _, err := stage.Open(t.Context()); err != nil {
		t.Fatal(err)
	}
	ticket, err := c.join(t, ip, issuer, workerRequest(t, stage.UUID()))
	if err != nil {
		t.Fatalf("the join of %s: %v", ip, err)
	}
	if err := stage.Bind(t.Context(), ticket.GetDiskKey(), ticket.GetClusterId(), ticket.GetDiskBinding()); err != nil {
		t.Fatal(err)
	}
	if err := n.disk.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	return n
}

// boot runs the node's boot stage for at most d, as a reboot does.
func (n *bootNode) boot(t *testing.T, d time.Duration) (bootstage.Result, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	res, err := bootstage.New(n.cfg).Open(ctx)
	if err == nil {
		if cerr := n.disk.Close(t.Context()); cerr != nil {
			t.Fatal(cerr)
		}
	}
	return res, err
}

func (n *bootNode) header(t *testing.T) statedisk.Header {
	t.Helper()
	h, err := n.disk.Header(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func (n *bootNode) locked(t *testing.T) bool {
	t.Helper()
	done, err := vtpm.NewLockRegister(n.tpm.Open, vtpm.DefaultLockPCR).Bootstrapped(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return done
}

func copyImage(t *testing.T, from, to string) {
	t.Helper()
	if out, err := exec.Command("cp", "--sparse=always", from, to).CombinedOutput(); err != nil {
		t.Fatalf("cp %s %s: %v: %s", from, to, err, out)
	}
}

// TestBootStageRefusesForeignDisk attacks a genuine node's boot stage by writing its state disk while
// it is off, as someone with brief access to the disk can. The node must open nothing it cannot
// authenticate: nothing is extended into its lock register and the disk is left as it was.
//
//	attack                                 refused because
//	header rewritten with another          the header's MAC under the disk key does not verify; the
//	  cluster ID (own disk, own sealed       cluster's rejoin ticket is for the real cluster, not the
//	  key)                                   header's
//	another node's disk swapped in         its sealed key does not load in this TPM; its binding is for
//	  (foreign header and sealed blob)       the other machine (DISK_NOT_BOUND)
func TestBootStageRefusesForeignDisk(t *testing.T) {
	requireStateDisk(t)
	c := startJoinCluster(t)
	victim := c.newBootNode(t, workerIP(38))
	other := c.newBootNode(t, workerIP(39))
	genuine := victim.header(t)
	saved := filepath.Join(t.TempDir(), "victim.img")
	copyImage(t, victim.image, saved)

	t.Run("header rewritten with another cluster ID", func(t *testing.T) {
		foreignID := bytes.Repeat([]byte{0xf0}, 32)
		if err := victim.disk.SetBinding(t.Context(), foreignID, genuine.Binding); err != nil {
			t.Fatal(err)
		}
		before := victim.header(t)
		res, err := victim.boot(t, 8*time.Second)
		if err == nil {
			t.Fatalf("the node booted its disk (%s) under cluster ID %x from a rewritten header", res.Source, res.ClusterID)
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("boot: %v, want it to wait for a key that vouches for the header", err)
		}
		if victim.locked(t) {
			t.Fatal("the lock register was extended")
		}
		if after := victim.header(t); !bytes.Equal(after.ClusterID, before.ClusterID) || !bytes.Equal(after.MAC, before.MAC) || !bytes.Equal(after.Sealed, before.Sealed) {
			t.Fatal("the disk's header changed")
		}
		refused := victim.logs.FilterMessage("state disk header refused; closing the disk, extending nothing and asking the cluster").Len()
		otherCluster := victim.logs.FilterMessageSnippet("it is for another cluster than the state disk").Len()
		if refused != 1 || otherCluster == 0 {
			t.Fatalf("logged %d header refusals and %d ticket refusals, want 1 and some", refused, otherCluster)
		}
		t.Logf("header of disk %s rewritten to cluster ID %s…: the sealed key opened the disk, the header was refused (MAC), "+
			"%d rejoin tickets for cluster %s… refused as another cluster's; lock register untouched, header unchanged",
			before.UUID, hex.EncodeToString(foreignID)[:8], otherCluster, hex.EncodeToString(genuine.ClusterID)[:8])
	})

	t.Run("another node's disk swapped in", func(t *testing.T) {
		copyImage(t, other.image, victim.image)
		before := victim.header(t)
		res, err := victim.boot(t, 8*time.Second)
		if err == nil {
			t.Fatalf("the node booted another node's disk %s (%s)", before.UUID, res.Source)
		}
		if victim.locked(t) {
			t.Fatal("the lock register was extended")
		}
		if after := victim.header(t); after.UUID != before.UUID || !bytes.Equal(after.ClusterID, before.ClusterID) || !bytes.Equal(after.Sealed, before.Sealed) {
			t.Fatal("the swapped disk's header changed")
		}
		e := c.waitLedger(t, "the rejoin for the swapped disk refused", func(e joinledger.Entry) bool {
			return e.Peer == victim.ip && e.RPC == "rejoin" && e.Reason == "DISK_NOT_BOUND" && e.DiskUUID == before.UUID
		})
		t.Logf("disk %s of %s swapped into %s: its sealed key did not unseal here, the rejoin for it was refused %s (%d times in the ledger); "+
			"lock register untouched, header unchanged", before.UUID, other.ip, victim.ip, e.Reason, max(e.Count, 1))
	})

	t.Run("the genuine disk boots", func(t *testing.T) {
		// The checks can pass: the node's own disk, as it was, opens with its sealed key.
		copyImage(t, saved, victim.image)
		res, err := victim.boot(t, 30*time.Second)
		if err != nil || res.Source != bootstage.SourceSealed || !bytes.Equal(res.ClusterID, genuine.ClusterID) {
			t.Fatalf("the genuine disk: %+v, %v", res, err)
		}
		if !victim.locked(t) {
			t.Fatal("the genuine boot did not extend the lock register")
		}
	})
}
