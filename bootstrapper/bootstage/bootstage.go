// Package bootstage is the first phase of the node daemon on every boot. Before anything on the node
// attests or reads node state, it opens the node's encrypted state disk and re-extends the lock
// register; only then do the InitServer, the JoinClient and the kubelet start.
//
// Which key opens the disk, in order:
//
//	disk                         key                                       then
//	missing, unformatted, or     a random key, in memory only              fresh node: init or join
//	  never bound to a cluster     (the disk is formatted anew; sealed       re-keys it (Bind)
//	                               to the TPM too with SealFresh)
//	never bound, key sealed      the sealed fresh key (SealFresh; nothing  still a fresh node
//	                               of an init or join on it, else wiped)
//	bound                        the key sealed to this node's TPM         unattended reboot
//	                               (boot PCRs as sealed, lock PCR zero)
//	bound, unseal refused        a rejoin ticket from any joinservice      both wait side by side; the
//	                               (mutual aTLS, disk binding checked)       first key that opens the
//	                             or `berth recover` (recovery server)        disk wins
//
// After the sealed key opened the disk, and before the lock register is extended, the node checks in
// with the cluster (Config.CheckIn): a REVOKED answer destroys the sealed key, closes the disk and
// waits for a key from the cluster as in the last row (refused while the machine is removed); no
// answer within the check-in's bound lets the boot go on with the sealed key (a full power cut:
// no control plane is up yet). Such a node keeps checking in once it runs (KeepCheckingIn, owned
// by the daemon): the first joinservice that answers decides, and a REVOKED answer then locks the
// node as the boot stage does (sealed key destroyed, kubelet stopped, state disk closed).
//
// A disk whose node state says "join, not done" is wiped and the node starts fresh (a join that
// failed after the lock was taken can never finish). A key that came from a rejoin ticket or from
// recovery is sealed again to the boot as measured now. Then the cluster ID recorded in the disk
// header is extended into the lock register, and the disk's directories are bind-mounted over the
// node's state paths (/etc/kubernetes, /var/lib/kubelet, /var/lib/etcd, the daemon's state dir).
//
// The header is authenticated (statedisk.HeaderMAC: a MAC under the disk key over the UUID, the
// cluster ID and the disk binding, written by Bind). The sealed key alone never vouches for the
// header: when it opens the disk but the header's MAC does not verify (a header rewritten with
// another cluster ID or binding, or one taken from another disk: ErrHeaderNotAuthentic), the disk
// is closed again, nothing is extended into the lock register and nothing is wiped, and the node
// asks the cluster as if the sealed key had failed. A key from the cluster vouches for the header
// itself: the rejoin ticket's cluster ID must be the header's and the joinservice checked the
// binding for this machine; berth recover checked both against the master secret. A disk bound by
// an earlier version has no MAC: its first boot after the upgrade takes that path too (a rejoin,
// unattended whenever a joinservice answers), and the MAC is written then, with the key resealed.
//
// With Phase set, the stage's last step marks a boot phase in a measured register that the sealed
// keys require to be zero: the key unseals at most once per boot, before anything but this stage
// ran.
//
// What the MAC does not cover: someone who can create objects in this node's TPM under the boot
// policy (code running on the machine outside the genuine boot) can seal a key of their own, format
// a disk with it and write a valid MAC; and a disk this machine bound earlier (to this or another
// cluster) carries a valid MAC and sealed key. Refusing those needs the TPM's word on when the
// sealed object was created (its creation data over the lock register), which is not done yet.
package bootstage

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atomicfile"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/statedisk"
)

// Disk is the node's state disk (internal/statedisk).
type Disk interface {
	Header(ctx context.Context) (statedisk.Header, error)
	Format(ctx context.Context, key []byte) (statedisk.Header, error)
	Open(ctx context.Context, key []byte) error
	Rekey(ctx context.Context, oldKey, newKey []byte) error
	SetBinding(ctx context.Context, clusterID, binding []byte) error
	SetSealed(ctx context.Context, blob []byte) error
	SetMAC(ctx context.Context, mac []byte) error
	Opened(ctx context.Context) (bool, error)
	Root() string
	Close(ctx context.Context) error
}

// Sealer seals the disk key to the node's TPM (vtpm.Sealer).
type Sealer interface {
	Seal(ctx context.Context, secret []byte) ([]byte, error)
	Unseal(ctx context.Context, blob []byte) ([]byte, error)
}

// LockRegister is a hardware lock register (TPM PCR, TDX RTMR): the nodelock markers.
type LockRegister interface {
	MarkBootstrapped(ctx context.Context, clusterID []byte) error
	Bootstrapped(ctx context.Context) (bool, error)
}

// BootPhase marks in a measured register that the state disk is open (vtpm.BootPhase): a key
// sealed with that register unseals no more in this boot.
type BootPhase interface {
	MarkStateDiskOpen(ctx context.Context) error
}

// RejoinFunc asks the cluster's joinservices for the disk key (joinclient.Rejoin).
type RejoinFunc func(ctx context.Context, diskUUID string, binding []byte) (diskKey, clusterID []byte, err error)

// RecoverFunc serves the recovery server until open succeeded (nil) or ctx ends
// (recoveryserver.Server.Serve on its own listener).
type RecoverFunc func(ctx context.Context, diskUUID string, clusterID, binding []byte, open func(ctx context.Context, diskKey []byte) error) error

// Bind is one directory of the state disk mounted over a path of the node.
type Bind struct {
	// Name is the directory under the disk's root.
	Name string
	// Target is the node path it is mounted over.
	Target string
}

// Config are the stage's parts.
type Config struct {
	Log  *zap.Logger
	Disk Disk
	// Sealer is nil where sealing is not available (TDX): every later boot then rejoins or recovers.
	Sealer Sealer
	// Locks are the lock registers re-extended with the disk's cluster ID.
	Locks []LockRegister
	// Phase, when set, is marked once the disk is open and mounted, before Open returns: it closes
	// the unlock window (the sealed key cannot be unsealed a second time in this boot).
	Phase   BootPhase
	Rejoin  RejoinFunc
	Recover RecoverFunc
	// Identity returns this machine's identity as the joinservice sees it (the disk binding's
	// input): vtpm.Issuer.MachineIdentity, or "instance/NAME" where the variant has none.
	Identity func(ctx context.Context) ([]byte, error)
	// Binds are mounted in order once the disk is open.
	Binds []Bind
	// StateBind names the Bind holding the daemon's node-state.json.
	StateBind string
	// Mounter bind-mounts; nil means the mount(2) system call.
	Mounter Mounter
	// RefusedBackoff is the wait after a round of refused rejoins (default 10 s, jittered).
	RefusedBackoff time.Duration
	// CheckIn asks the cluster whether this machine may run (joinclient.CheckIn), after its sealed
	// key opened the disk and before the lock register is extended: the cluster's policy admits
	// only a node whose lock register is still zero, as for a rejoin. revoked: the cluster answered
	// REVOKED; an error: no joinservice answered within the function's bound, and the boot goes on
	// with the sealed key, asking again once the node runs (KeepCheckingIn); an error wrapping
	// ErrNoOneToAsk: no other joinservice exists (the cluster's only control plane), the boot goes
	// on with the sealed key and nothing is asked again. Nil: no check-in.
	CheckIn func(ctx context.Context, diskUUID string, clusterID []byte) (revoked bool, err error)
	// SealFresh seals the random key of a freshly formatted disk to the TPM as well, so that a node
	// rebooted before init or join unseals its disk unattended instead of wiping it (see the package
	// documentation). Needs Sealer.
	SealFresh bool
	// BootID names this boot (the kernel's random boot_id). When set, Open records it on the open
	// disk and logs the boot ID recorded there by the boot that opened the disk before.
	BootID string
	// LaterCheckIns are the waits between the check-ins of KeepCheckingIn, each of which is one
	// CheckIn call with its own rounds (default LaterCheckInBackoff).
	LaterCheckIns wait.Backoff
}

// LaterCheckInBackoff is how often a node that booted without a check-in answer asks again: after
// 10 s, then waits doubling up to a minute (jittered by up to 20 %), for as long as it runs. Each
// ask is a whole CheckIn (a worker's eight rounds over about twenty seconds), so a joinservice
// that comes back is asked within about a minute and a half.
var LaterCheckInBackoff = wait.Backoff{Duration: 10 * time.Second, Factor: 2, Jitter: 0.2, Steps: math.MaxInt32, Cap: time.Minute}

// Mounter bind-mounts directories.
type Mounter interface {
	// BindMount mounts src over dst.
	BindMount(src, dst string) error
	// IsBound reports whether dst is already a mount of the disk directory named name.
	IsBound(dst, name string) (bool, error)
	// Unmount removes the mount at dst.
	Unmount(dst string) error
	// MountsOf lists the mount points that hold the state disk's file system (the one holding root),
	// other than the disk's own mount, and every mount below them, in an order in which they can be
	// unmounted (a mount before the one it lies on): the stage's binds, binds others made from the
	// disk (mini's containerd root), the kubelet's volume mounts in its directory.
	MountsOf(root string) ([]string, error)
}

// How the disk was opened.
const (
	SourceFresh    = "fresh"
	SourceSealed   = "sealed"
	SourceRejoin   = "rejoin"
	SourceRecovery = "recovery"
	SourceAlready  = "already-open"
)

// Result says what the stage did.
type Result struct {
	// Source is how the disk was opened (Source* constants).
	Source string
	// UUID is the disk's UUID.
	UUID string
	// ClusterID is the cluster the disk belongs to; nil on a fresh node.
	ClusterID []byte
	// Wiped says a disk was wiped (never bound, or a join that did not finish).
	Wiped string
	// Took is how long the stage took.
	Took time.Duration
}

// Stage opens the state disk on boot and binds a fresh one to its cluster later. The zero value is
// not usable; create it with New.
type Stage struct {
	cfg Config
	log *zap.Logger

	mu     sync.Mutex
	header statedisk.Header
	// freshKey is the random key of a disk formatted in this boot, until Bind re-keys it.
	freshKey []byte
	// checkInPending: the sealed key opened the disk and no joinservice answered the check-in.
	checkInPending bool
	// checkedIn is the Result of the boot whose check-in is pending.
	checkedIn Result
}

// Errors of the stage.
var (
	ErrAlreadyBound     = errors.New("state disk is bound to another cluster")
	ErrNotFresh         = errors.New("state disk was not formatted in this boot; it cannot be bound to a cluster")
	ErrClusterIDDiffers = errors.New("rejoin ticket is for another cluster than the state disk")
	// ErrHeaderNotAuthentic means the state disk header's MAC does not verify under the key that
	// opened the disk: the header was not written with this disk's key.
	ErrHeaderNotAuthentic = errors.New("state disk header is not authentic: its MAC does not verify under the disk's key")
	// ErrRevoked means a check-in after the boot was answered REVOKED and the node was locked.
	ErrRevoked = errors.New("this machine was removed from the cluster: the node is locked")
	// ErrNoOneToAsk is wrapped by a Config.CheckIn error when no other joinservice exists that could
	// judge this machine: it is the cluster's only control plane (its own joinservice runs on it, and
	// only after its kubelet). Nothing is asked, now or later.
	ErrNoOneToAsk  = errors.New("no other control plane to check in with")
	errAlreadyOpen = errors.New("state disk is already open")
)

// New returns a Stage.
func New(cfg Config) *Stage {
	if cfg.Mounter == nil {
		cfg.Mounter = sysMounter{}
	}
	if cfg.RefusedBackoff == 0 {
		cfg.RefusedBackoff = 10 * time.Second
	}
	return &Stage{cfg: cfg, log: cfg.Log}
}

// UUID is the state disk's UUID once Open returned.
func (s *Stage) UUID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.header.UUID
}

// Open opens the state disk (see the package documentation), re-extends the lock registers and
// mounts the disk's directories. It blocks until a key opened the disk or ctx ends.
func (s *Stage) Open(ctx context.Context) (Result, error) {
	start := time.Now()
	res, err := s.open(ctx)
	if err != nil {
		return res, err
	}
	if res.Source == SourceSealed && s.cfg.CheckIn != nil {
		if res, err = s.checkIn(ctx, res); err != nil {
			return res, err
		}
	}
	if res.ClusterID != nil {
		if err := s.extendLocks(ctx, res.ClusterID); err != nil {
			return res, err
		}
	}
	if err := s.bindAll(); err != nil {
		return res, err
	}
	if err := s.recordBoot(); err != nil {
		return res, err
	}
	if s.cfg.Phase != nil {
		if err := s.markPhase(ctx); err != nil {
			return res, fmt.Errorf("marking the state disk phase: %w", err)
		}
		s.log.Info("boot phase marked: state disk open, its sealed key unseals no more in this boot")
	}
	res.Took = time.Since(start)
	s.log.Info("state disk open", zap.String("source", res.Source), zap.String("diskUUID", res.UUID),
		zap.String("clusterID", hex.EncodeToString(res.ClusterID)), zap.Duration("took", res.Took))
	return res, nil
}

func (s *Stage) open(ctx context.Context) (Result, error) {
	d := s.cfg.Disk
	opened, err := d.Opened(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("checking the state disk: %w", err)
	}
	if opened {
		h, err := d.Header(ctx)
		if err != nil {
			return Result{}, fmt.Errorf("reading the state disk header: %w", err)
		}
		if h.ClusterID != nil {
			s.setHeader(h)
			s.log.Info("state disk already open (the daemon restarted within this boot)")
			return s.afterOpen(ctx, Result{Source: SourceAlready, UUID: h.UUID, ClusterID: h.ClusterID}, nil)
		}
		// Its random key died with the process that formatted it: start over.
		s.log.Info("state disk open but not bound to a cluster, and its key is gone: formatting it again")
		if err := s.release(ctx); err != nil {
			return Result{}, err
		}
		return s.fresh(ctx, "open but never bound, key lost with the previous process")
	}
	h, err := d.Header(ctx)
	switch {
	case errors.Is(err, statedisk.ErrNotFormatted):
		return s.fresh(ctx, "")
	case err != nil:
		return Result{}, fmt.Errorf("reading the state disk header: %w", err)
	case h.ClusterID == nil:
		return s.openUnbound(ctx, h)
	}
	s.setHeader(h)
	res := Result{UUID: h.UUID, ClusterID: h.ClusterID}
	if key, ok := s.unseal(ctx, h); ok {
		res.Source = SourceSealed
		return s.afterOpen(ctx, res, key)
	}
	src, key, err := s.waitForKey(ctx, h)
	if err != nil {
		return res, err
	}
	res.Source = src
	return s.afterOpen(ctx, res, key)
}

func (s *Stage) setHeader(h statedisk.Header) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.header = h
}

// unseal tries the key sealed to the TPM.
func (s *Stage) unseal(ctx context.Context, h statedisk.Header) ([]byte, bool) {
	if s.cfg.Sealer == nil || len(h.Sealed) == 0 {
		s.log.Info("no sealed key for the state disk: asking the cluster")
		return nil, false
	}
	start := time.Now()
	key, err := s.cfg.Sealer.Unseal(ctx, h.Sealed)
	if err != nil {
		s.log.Warn("the TPM refused the sealed disk key (boot measured differently, or the TPM was cleared): asking the cluster", zap.Error(err))
		return nil, false
	}
	unsealed := time.Since(start)
	if err := s.cfg.Disk.Open(ctx, key); err != nil {
		s.log.Warn("the sealed key does not open the state disk: asking the cluster", zap.Error(err))
		return nil, false
	}
	if !statedisk.VerifyHeaderMAC(key, h) {
		clear(key)
		reason := "the header's MAC does not verify: it was rewritten, or taken from another disk"
		if len(h.MAC) == 0 {
			reason = "the header has no MAC (written by an earlier version, or stripped)"
		}
		s.log.Error("state disk header refused; closing the disk, extending nothing and asking the cluster",
			zap.Error(ErrHeaderNotAuthentic), zap.String("why", reason), zap.String("diskUUID", h.UUID),
			zap.String("headerClusterID", hex.EncodeToString(h.ClusterID)))
		if err := s.cfg.Disk.Close(ctx); err != nil {
			s.log.Error("closing the state disk after refusing its header", zap.Error(err))
		}
		return nil, false
	}
	s.log.Info("state disk opened with the key sealed to this TPM", zap.Duration("unseal", unsealed))
	return key, true
}

// waitForKey runs the rejoin path and the recovery server side by side until one opened the disk.
func (s *Stage) waitForKey(ctx context.Context, h statedisk.Header) (string, []byte, error) {
	var (
		mu     sync.Mutex
		isOpen bool
		won    = make(chan struct{})
		source string
		theKey []byte
	)
	open := func(ctx context.Context, key []byte, src string) error {
		mu.Lock()
		defer mu.Unlock()
		if isOpen {
			return errAlreadyOpen
		}
		if err := s.cfg.Disk.Open(ctx, key); err != nil {
			return err
		}
		isOpen, source, theKey = true, src, append([]byte(nil), key...)
		close(won)
		return nil
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, gctx := errgroup.WithContext(wctx)
	if s.cfg.Rejoin != nil {
		g.Go(func() error { s.rejoinLoop(gctx, h, open); return nil })
	}
	if s.cfg.Recover != nil {
		g.Go(func() error {
			err := s.cfg.Recover(gctx, h.UUID, h.ClusterID, h.Binding, func(ctx context.Context, key []byte) error {
				return open(ctx, key, SourceRecovery)
			})
			if err != nil && gctx.Err() == nil {
				s.log.Error("recovery server failed; waiting for a rejoin ticket only", zap.Error(err))
			}
			return nil
		})
	}
	if s.cfg.Rejoin == nil && s.cfg.Recover == nil {
		return "", nil, errors.New("state disk is locked and neither rejoin nor recovery is configured")
	}
	select {
	case <-won:
	case <-ctx.Done():
	}
	cancel()
	_ = g.Wait()
	mu.Lock()
	defer mu.Unlock()
	if !isOpen {
		return "", nil, fmt.Errorf("waiting for the state disk key: %w", ctx.Err())
	}
	return source, theKey, nil
}

// rejoinLoop asks the joinservices for the disk key until it opened the disk or ctx ends. Refusals
// are logged with their reason and retried after a long, jittered backoff: a policy update or a
// control plane coming back can change the answer, and recovery waits beside it.
func (s *Stage) rejoinLoop(ctx context.Context, h statedisk.Header, open func(context.Context, []byte, string) error) {
	s.log.Info("asking the cluster's joinservices for a rejoin ticket", zap.String("diskUUID", h.UUID))
	for {
		start := time.Now()
		key, clusterID, err := s.cfg.Rejoin(ctx, h.UUID, h.Binding)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			s.log.Warn("rejoin refused; trying again, and berth recover can open the disk meanwhile", zap.Error(err))
		case !bytes.Equal(clusterID, h.ClusterID):
			s.log.Error("rejoin ticket refused: it is for another cluster than the state disk", zap.Error(ErrClusterIDDiffers),
				zap.String("ticketClusterID", hex.EncodeToString(clusterID)), zap.String("diskClusterID", hex.EncodeToString(h.ClusterID)))
		default:
			err := open(ctx, key, SourceRejoin)
			clear(key)
			switch {
			case err == nil:
				s.log.Info("state disk opened with a rejoin ticket", zap.Duration("rejoin", time.Since(start)))
				return
			case errors.Is(err, errAlreadyOpen):
				return
			default:
				s.log.Error("the rejoin ticket's key does not open the state disk", zap.Error(err))
			}
		}
		t := time.NewTimer(wait.Jitter(s.cfg.RefusedBackoff, 0.5))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// afterOpen wipes a disk whose join did not finish and seals a key that came from the cluster.
func (s *Stage) afterOpen(ctx context.Context, res Result, key []byte) (Result, error) {
	defer clear(key)
	st, err := s.nodeState()
	if err != nil {
		return res, err
	}
	if st != nil && st.Role == nodestate.RoleJoin && !st.Done {
		s.log.Warn("the join did not finish before this boot: wiping the state disk and starting fresh")
		if err := s.release(ctx); err != nil {
			return res, err
		}
		return s.fresh(ctx, "join did not finish")
	}
	if key != nil && res.Source != SourceSealed {
		// The cluster vouched for this header (see the package documentation): authenticate it.
		s.writeMAC(ctx, key)
		s.seal(ctx, key)
	}
	return res, nil
}

func (s *Stage) nodeState() (*nodestate.State, error) {
	if s.cfg.StateBind == "" {
		return nil, nil
	}
	st, err := nodestate.NewStore(afero.NewOsFs(), filepath.Join(s.cfg.Disk.Root(), s.cfg.StateBind, "node-state.json")).Load()
	if err != nil {
		return nil, fmt.Errorf("reading the node state on the state disk: %w", err)
	}
	return st, nil
}

// writeMAC records the MAC of the header under key, unless it already verifies. A failure is
// logged: the next boot asks the cluster again.
func (s *Stage) writeMAC(ctx context.Context, key []byte) {
	s.mu.Lock()
	h := s.header
	s.mu.Unlock()
	if statedisk.VerifyHeaderMAC(key, h) {
		return
	}
	mac, err := statedisk.HeaderMAC(key, h)
	if err == nil {
		err = s.cfg.Disk.SetMAC(ctx, mac)
	}
	if err != nil {
		s.log.Error("authenticating the state disk header failed; the next boot asks the cluster", zap.Error(err))
		return
	}
	s.mu.Lock()
	s.header.MAC = mac
	s.mu.Unlock()
	s.log.Info("state disk header authenticated with the disk's key")
}

// seal seals key to the boot as measured now. A failure is logged: the next boot rejoins instead.
func (s *Stage) seal(ctx context.Context, key []byte) {
	if s.cfg.Sealer == nil {
		return
	}
	start := time.Now()
	blob, err := s.cfg.Sealer.Seal(ctx, key)
	if err == nil {
		err = s.cfg.Disk.SetSealed(ctx, blob)
	}
	if err != nil {
		s.log.Error("sealing the disk key to the TPM failed; the next boot asks the cluster", zap.Error(err))
		return
	}
	s.log.Info("disk key sealed to this TPM's boot measurements", zap.Duration("took", time.Since(start)))
}

// openUnbound opens a disk formatted by an earlier boot that was never bound to a cluster: with its
// sealed fresh key when SealFresh is set and nothing of an init or join was written to it, else it
// is wiped.
func (s *Stage) openUnbound(ctx context.Context, h statedisk.Header) (Result, error) {
	if !s.cfg.SealFresh || len(h.Sealed) == 0 {
		s.log.Warn("state disk was never bound to a cluster (an init or join did not get that far before the reboot): wiping it")
		return s.fresh(ctx, "never bound to a cluster")
	}
	key, ok := s.unseal(ctx, h)
	if !ok {
		s.log.Warn("the sealed key of the never bound state disk does not open it: wiping it")
		return s.fresh(ctx, "never bound to a cluster, sealed key refused")
	}
	st, err := s.nodeState()
	if err != nil || st != nil {
		clear(key)
		s.log.Warn("an init or join started on the never bound state disk before this boot: wiping it", zap.Error(err))
		if err := s.release(ctx); err != nil {
			return Result{}, err
		}
		return s.fresh(ctx, "never bound to a cluster, an init or join had started")
	}
	s.mu.Lock()
	s.header, s.freshKey = h, key
	s.mu.Unlock()
	return Result{Source: SourceSealed, UUID: h.UUID}, nil
}

// fresh formats the disk with a random key kept in memory until Bind (and sealed to the TPM with
// SealFresh).
func (s *Stage) fresh(ctx context.Context, wiped string) (Result, error) {
	key := make([]byte, statedisk.KeySize)
	if _, err := rand.Read(key); err != nil {
		return Result{}, fmt.Errorf("generating a state disk key: %w", err)
	}
	h, err := s.cfg.Disk.Format(ctx, key)
	if err != nil {
		clear(key)
		return Result{}, fmt.Errorf("formatting the state disk: %w", err)
	}
	s.mu.Lock()
	s.header, s.freshKey = h, key
	s.mu.Unlock()
	s.log.Info("state disk formatted with a random key: fresh node", zap.String("diskUUID", h.UUID))
	if s.cfg.SealFresh && s.cfg.Sealer != nil {
		// The header's MAC first: a boot that finds a sealed key checks it before trusting the header.
		s.writeMAC(ctx, key)
		s.seal(ctx, key)
	}
	return Result{Source: SourceFresh, UUID: h.UUID, Wiped: wiped}, nil
}

// phaseAttempts bounds how often the stage tries to mark the boot phase. Marking is idempotent;
// under load a software TPM's connection was seen to drop once (EOF), and a daemon that exits
// instead loses a never bound disk (its key died with the process).
const phaseAttempts = 3

// markPhase marks the state disk phase, retrying a failed attempt after a second.
func (s *Stage) markPhase(ctx context.Context) error {
	var err error
	for attempt := 1; ; attempt++ {
		if err = s.cfg.Phase.MarkStateDiskOpen(ctx); err == nil || attempt == phaseAttempts {
			return err
		}
		s.log.Warn("marking the boot phase failed; trying again", zap.Error(err), zap.Int("attempt", attempt))
		t := time.NewTimer(time.Second)
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(err, ctx.Err())
		case <-t.C:
		}
	}
}

// bootRecord is the file on the disk's root naming the boot that opened the disk last.
const bootRecord = "last-boot"

// recordBoot logs the boot ID the disk recorded before and records this boot's (with BootID).
func (s *Stage) recordBoot() error {
	if s.cfg.BootID == "" {
		return nil
	}
	path := filepath.Join(s.cfg.Disk.Root(), bootRecord)
	prev, err := os.ReadFile(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		prev = nil
	case err != nil:
		return fmt.Errorf("reading the state disk's boot record: %w", err)
	}
	s.log.Info("state disk boot record", zap.String("bootID", s.cfg.BootID),
		zap.String("previousBootID", strings.TrimSpace(string(prev))))
	if err := atomicfile.Write(afero.NewOsFs(), path, []byte(s.cfg.BootID+"\n"), 0o600); err != nil {
		return fmt.Errorf("writing the state disk's boot record: %w", err)
	}
	return nil
}

// release unmounts the binds and closes the disk.
func (s *Stage) release(ctx context.Context) error {
	for i := len(s.cfg.Binds) - 1; i >= 0; i-- {
		b := s.cfg.Binds[i]
		bound, err := s.cfg.Mounter.IsBound(b.Target, b.Name)
		if err != nil {
			return err
		}
		if bound {
			if err := s.cfg.Mounter.Unmount(b.Target); err != nil {
				return fmt.Errorf("unmounting %s: %w", b.Target, err)
			}
		}
	}
	if err := s.cfg.Disk.Close(ctx); err != nil {
		return fmt.Errorf("closing the state disk: %w", err)
	}
	return nil
}

func (s *Stage) extendLocks(ctx context.Context, clusterID []byte) error {
	for _, l := range s.cfg.Locks {
		done, err := l.Bootstrapped(ctx)
		if err != nil {
			return fmt.Errorf("reading the lock register: %w", err)
		}
		if done {
			continue
		}
		if err := l.MarkBootstrapped(ctx, clusterID); err != nil {
			return fmt.Errorf("re-extending the lock register: %w", err)
		}
		s.log.Info("lock register re-extended with the cluster ID of the state disk", zap.String("clusterID", hex.EncodeToString(clusterID)))
	}
	return nil
}

func (s *Stage) bindAll() error {
	root := s.cfg.Disk.Root()
	for _, b := range s.cfg.Binds {
		src := filepath.Join(root, b.Name)
		if err := os.MkdirAll(src, 0o700); err != nil {
			return fmt.Errorf("creating %s on the state disk: %w", b.Name, err)
		}
		bound, err := s.cfg.Mounter.IsBound(b.Target, b.Name)
		if err != nil {
			return err
		}
		if bound {
			continue
		}
		if err := s.cfg.Mounter.BindMount(src, b.Target); err != nil {
			return fmt.Errorf("mounting the state disk's %s over %s: %w", b.Name, b.Target, err)
		}
	}
	return nil
}

// Bind binds a disk formatted in this boot to the cluster: its keyslot is re-wrapped from the random
// key to diskKey, the header records the cluster ID and the disk binding, and diskKey is sealed to
// the TPM. Binding again to the same cluster does nothing (a resumed init).
func (s *Stage) Bind(ctx context.Context, diskKey, clusterID, binding []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.header.ClusterID != nil {
		if bytes.Equal(s.header.ClusterID, clusterID) {
			return nil
		}
		return ErrAlreadyBound
	}
	if s.freshKey == nil {
		return ErrNotFresh
	}
	if err := s.cfg.Disk.Rekey(ctx, s.freshKey, diskKey); err != nil {
		return fmt.Errorf("re-keying the state disk: %w", err)
	}
	// Until the header records the cluster, diskKey is the key a retried Bind re-keys from.
	clear(s.freshKey)
	s.freshKey = append([]byte(nil), diskKey...)
	if err := s.cfg.Disk.SetBinding(ctx, clusterID, binding); err != nil {
		return fmt.Errorf("recording the cluster in the state disk header: %w", err)
	}
	clear(s.freshKey)
	s.freshKey = nil
	s.header.ClusterID, s.header.Binding = append([]byte(nil), clusterID...), append([]byte(nil), binding...)
	s.log.Info("state disk re-keyed to the cluster's disk key", zap.String("clusterID", hex.EncodeToString(clusterID)))
	mac, err := statedisk.HeaderMAC(diskKey, s.header)
	if err != nil {
		return fmt.Errorf("authenticating the state disk header: %w", err)
	}
	if err := s.cfg.Disk.SetMAC(ctx, mac); err != nil {
		return fmt.Errorf("authenticating the state disk header: %w", err)
	}
	s.header.MAC = mac
	s.seal(ctx, diskKey)
	return nil
}

// BindWithKeys binds the disk for the node that initializes the cluster: it derives its own disk key
// and disk binding from the cluster's keys, as the joinservice does for a joining node.
func (s *Stage) BindWithKeys(ctx context.Context, keys *clusterkeys.Keys) error {
	id, err := s.cfg.Identity(ctx)
	if err != nil {
		return fmt.Errorf("reading this machine's identity: %w", err)
	}
	uuid := s.UUID()
	key := keys.DiskKey(uuid, id)
	defer clear(key)
	return s.Bind(ctx, key, keys.ClusterID(), keys.DiskBinding(uuid, id))
}

// checkIn asks the cluster whether the machine whose sealed key opened the disk may run. REVOKED
// locks the node (lock) and closes the disk again, then the stage waits for a key from the cluster
// as after a refused unseal: a rejoin ticket, refused REVOKED until berth node readmit, or berth
// recover. No answer within the check-in's bound: the boot goes on with the sealed key.
func (s *Stage) checkIn(ctx context.Context, res Result) (Result, error) {
	revoked, err := s.cfg.CheckIn(ctx, res.UUID, res.ClusterID)
	switch {
	case err != nil && ctx.Err() != nil:
		return res, fmt.Errorf("checking in: %w", err)
	case errors.Is(err, ErrNoOneToAsk):
		s.log.Info("this node is the cluster's only control plane: no other joinservice can judge it, booting on the sealed key without a check-in", zap.Error(err))
		return res, nil
	case err != nil:
		s.log.Warn("no joinservice answered the check-in: booting on the sealed key, checking in again once the node runs", zap.Error(err))
		s.mu.Lock()
		s.checkInPending, s.checkedIn = true, res
		s.mu.Unlock()
		return res, nil
	case !revoked:
		return res, nil
	}
	s.log.Error("this machine was removed from the cluster: locking the node (sealed key destroyed, state disk closed); it waits for berth node readmit or berth recover",
		zap.String("diskUUID", res.UUID))
	if err := s.lock(ctx); err != nil {
		return res, err
	}
	if err := s.release(ctx); err != nil {
		return res, err
	}
	s.mu.Lock()
	h := s.header
	s.mu.Unlock()
	src, key, err := s.waitForKey(ctx, h)
	if err != nil {
		return res, err
	}
	res.Source = src
	return s.afterOpen(ctx, res, key)
}

// CheckInPending reports whether Open booted on the sealed key without a check-in answer: then the
// node must keep checking in (KeepCheckingIn).
func (s *Stage) CheckInPending() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checkInPending
}

// KeepCheckingIn checks in with the cluster (Config.CheckIn) after a boot whose check-in nobody
// answered, waiting LaterCheckIns between the attempts, until a joinservice answers or ctx ends.
// It returns nil at once when no check-in is pending, nil once the cluster admitted the node, and
// nil when CheckIn reports that nobody is left to ask (ErrNoOneToAsk).
// A REVOKED answer locks the node as the boot stage does: the sealed key is destroyed, stop stops
// what runs on the state disk (the kubelet, then its pod sandboxes through the container runtime),
// the disk's directories are unmounted and the disk is closed, the reason is logged, and an error
// wrapping ErrRevoked is returned. When stop fails the disk is not touched (what did not stop may
// still write to it); a disk that cannot be closed (files of processes stop did not end are still
// open) is logged too, and either way the disk stays open until the node reboots; with its sealed key destroyed, that boot waits for a key from the cluster or berth
// recover. ctx's end returns ctx's error. The caller owns the call: run it in the daemon's group.
func (s *Stage) KeepCheckingIn(ctx context.Context, stop func(context.Context) error) error {
	s.mu.Lock()
	pending, res := s.checkInPending, s.checkedIn
	s.mu.Unlock()
	if !pending {
		return nil
	}
	backoff := s.cfg.LaterCheckIns
	if backoff.Duration == 0 {
		backoff = LaterCheckInBackoff
	}
	for attempt := 1; ; attempt++ {
		t := time.NewTimer(backoff.Step())
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("checking in after the boot: %w", ctx.Err())
		case <-t.C:
		}
		revoked, err := s.cfg.CheckIn(ctx, res.UUID, res.ClusterID)
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("checking in after the boot: %w", ctx.Err())
		case errors.Is(err, ErrNoOneToAsk):
			// The other control planes were removed meanwhile: nobody is left to ask.
			s.mu.Lock()
			s.checkInPending = false
			s.mu.Unlock()
			s.log.Info("this node is now the cluster's only control plane: no other joinservice can judge it, no more check-ins", zap.Int("attempt", attempt))
			return nil
		case err != nil:
			s.log.Info("still no joinservice answers the check-in; asking again", zap.Int("attempt", attempt), zap.Error(err))
			continue
		case !revoked:
			s.mu.Lock()
			s.checkInPending = false
			s.mu.Unlock()
			s.log.Info("checked in with the cluster after booting on the sealed key", zap.Int("attempt", attempt))
			return nil
		}
		return s.lockRunning(ctx, res, stop)
	}
}

// lockRunning locks a node that runs on its state disk after a REVOKED check-in: sealed key
// destroyed, stop (the kubelet and its pods), the disk's directories unmounted and the disk closed.
func (s *Stage) lockRunning(ctx context.Context, res Result, stop func(context.Context) error) error {
	s.log.Error("this machine was removed from the cluster: locking the running node (sealed key destroyed, kubelet stopped, state disk closed); it waits for berth node readmit and a reboot, or berth recover",
		zap.String("diskUUID", res.UUID), zap.String("clusterID", hex.EncodeToString(res.ClusterID)))
	if err := s.lock(ctx); err != nil {
		return fmt.Errorf("%w, but: %w", ErrRevoked, err)
	}
	s.mu.Lock()
	s.checkInPending = false
	s.mu.Unlock()
	if err := stop(ctx); err != nil {
		// Whatever did not stop may still write to the disk: it stays open, and with its sealed
		// key destroyed the next boot cannot open it without a key from the cluster or berth recover.
		s.log.Error("stopping what runs on the state disk of the locked node failed; the state disk stays open until the node reboots",
			zap.Error(err))
		return fmt.Errorf("%w (state disk not closed: %w)", ErrRevoked, err)
	}
	s.log.Warn("kubelet and its pods stopped: this machine was removed from the cluster")
	if err := s.unmountAll(); err != nil {
		s.log.Error("unmounting the state disk's mounts of the locked node failed (files on it still open); it stays open until the node reboots, and that boot cannot open it without a key from the cluster or berth recover",
			zap.Error(err))
		return fmt.Errorf("%w (state disk not closed: %w)", ErrRevoked, err)
	}
	if err := s.release(ctx); err != nil {
		s.log.Error("closing the state disk of the locked node failed (files on it still open); it stays open until the node reboots, and that boot cannot open it without a key from the cluster or berth recover",
			zap.Error(err))
		return fmt.Errorf("%w (state disk not closed: %w)", ErrRevoked, err)
	}
	s.log.Warn("state disk closed: this machine was removed from the cluster")
	return ErrRevoked
}

// unmountAll unmounts every mount of the state disk's file system outside the disk's own mount and
// every mount below them (Mounter.MountsOf), each logged; the first that fails ends it.
func (s *Stage) unmountAll() error {
	mounts, err := s.cfg.Mounter.MountsOf(s.cfg.Disk.Root())
	if err != nil {
		return fmt.Errorf("listing the state disk's mounts: %w", err)
	}
	for _, m := range mounts {
		err := s.cfg.Mounter.Unmount(m)
		switch {
		case errors.Is(err, syscall.EINVAL):
			// Not a mount point any more: its peer's unmount propagated to it.
			s.log.Info("a mount on the state disk was already gone", zap.String("path", m))
			continue
		case err != nil:
			return fmt.Errorf("unmounting %s: %w", m, err)
		}
		s.log.Info("unmounted a mount on the state disk", zap.String("path", m))
	}
	return nil
}

// lock destroys the key sealed to the TPM (the header's sealed blob cleared; the MAC does not cover
// it), so no later boot opens the state disk unattended: it asks the cluster, which refuses a
// removed machine, or waits for berth recover. A key the cluster gives again (a rejoin after berth
// node readmit) is sealed anew (afterOpen).
func (s *Stage) lock(ctx context.Context) error {
	if err := s.cfg.Disk.SetSealed(ctx, nil); err != nil {
		return fmt.Errorf("destroying the sealed disk key: %w", err)
	}
	s.mu.Lock()
	s.header.Sealed = nil
	s.mu.Unlock()
	s.log.Warn("sealed disk key destroyed: the next boot opens the state disk only with a key from the cluster or berth recover")
	return nil
}

// InstanceIdentity is the disk binding's identity of a machine whose attestation variant has no
// hardware identity (the joinservice's fallback).
func InstanceIdentity(name string) []byte { return []byte("instance/" + name) }

// mountRootHas reports whether a mountinfo root field names the disk directory name.
func mountRootHas(root, name string) bool {
	return root == "/"+name || strings.HasSuffix(root, "/"+name)
}
