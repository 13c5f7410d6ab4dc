package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/berth-k8s/berth/bootstrapper/bootstage"
	"github.com/berth-k8s/berth/bootstrapper/joinclient"
	"github.com/berth-k8s/berth/bootstrapper/recoveryserver"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/statedisk"
)

// stateDiskName is the device-mapper name of a LUKS2 state disk.
const stateDiskName = "berth-state"

// stateBinds are the state disk's directories and the node paths they are mounted over.
func stateBinds(cfg *config) []bootstage.Bind {
	return []bootstage.Bind{
		{Name: "etc-kubernetes", Target: cfg.kubernetesDir},
		{Name: "var-lib-kubelet", Target: cfg.kubeletDir},
		{Name: "var-lib-etcd", Target: cfg.etcdDir},
		{Name: "var-lib-berth", Target: cfg.stateDir},
	}
}

// openStateDisk runs the boot stage: it returns once the state disk is open and mounted (nil Stage
// with --state-disk-backend=none).
func openStateDisk(ctx context.Context, cfg *config, log *zap.Logger, meta metadataProvider, att *attestationSetup) (*bootstage.Stage, error) {
	if cfg.diskBackend == "none" {
		log.Warn("no state disk (--state-disk-backend=none): the node's state stays unencrypted on the host's directories; development only")
		return nil, nil
	}
	var disk bootstage.Disk
	switch cfg.diskBackend {
	case "fscrypt":
		disk = statedisk.NewFscrypt(cfg.stateDisk, cfg.stateMount, statedisk.Exec{}, log.Named("statedisk"))
	case "luks":
		disk = statedisk.NewLUKS(cfg.stateDisk, stateDiskName, cfg.stateMount, statedisk.Exec{}, log.Named("statedisk"))
	}
	identity := att.identity
	if identity == nil {
		identity = func(ctx context.Context) ([]byte, error) {
			self, err := meta.Self(ctx)
			if err != nil {
				return nil, fmt.Errorf("asking metadata for this instance: %w", err)
			}
			return bootstage.InstanceIdentity(self.Name), nil
		}
	}
	binds := stateBinds(cfg)
	sc := bootstage.Config{
		Log:       log.Named("bootstage"),
		Disk:      disk,
		Binds:     binds,
		StateBind: binds[len(binds)-1].Name,
		Identity:  identity,
		Rejoin: func(ctx context.Context, diskUUID string, binding []byte) ([]byte, []byte, error) {
			return joinclient.Rejoin(ctx, log.Named("rejoin"), meta, att.dialJoin, cfg.joinPort, diskUUID, binding)
		},
		Recover: func(ctx context.Context, diskUUID string, clusterID, binding []byte, open func(context.Context, []byte) error) error {
			var lc net.ListenConfig
			lis, err := lc.Listen(ctx, "tcp", cfg.recoverListen)
			if err != nil {
				return fmt.Errorf("listening for berth recover: %w", err)
			}
			srv := recoveryserver.New(log.Named("recovery"), grpc.Creds(att.serverCreds))
			return srv.Serve(ctx, lis, recoveryserver.Info{DiskUUID: diskUUID, ClusterID: clusterID, Binding: binding}, open)
		},
	}
	if cfg.joinPolicy != "" || cfg.attestation == "insecure-none" {
		// The check-in of a node whose sealed key opened its disk (bootstage.Config.CheckIn): a
		// worker asks for about 20 s, a control plane one round (its peers may all be restarting
		// with it, and none would answer before its own kubelet runs).
		sc.CheckIn = func(ctx context.Context, diskUUID string, clusterID []byte) (bool, error) {
			backoff := joinclient.CheckInBackoff
			if self, err := meta.Self(ctx); err != nil || self.Role == metadata.RoleControlPlane {
				backoff.Steps = 1
			}
			err := joinclient.CheckIn(ctx, log.Named("checkin"), meta, att.dialJoin, cfg.joinPort, diskUUID, clusterID, backoff)
			switch {
			case errors.Is(err, joinclient.ErrRevoked):
				return true, nil
			case errors.Is(err, joinclient.ErrOnlyControlPlane):
				return false, fmt.Errorf("%w: %w", bootstage.ErrNoOneToAsk, err)
			}
			return false, err
		}
	}
	if att.sealer != nil {
		sc.Sealer = att.sealer
		sc.SealFresh = cfg.sealFresh
	}
	if att.phase != nil {
		sc.Phase = att.phase
	}
	if id, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		sc.BootID = strings.TrimSpace(string(id))
	}
	for _, m := range att.markers {
		sc.Locks = append(sc.Locks, m)
	}
	stage := bootstage.New(sc)
	if _, err := stage.Open(ctx); err != nil {
		return nil, fmt.Errorf("opening the state disk: %w", err)
	}
	return stage, nil
}

// randomUUID returns a random (version 4) UUID for a node without a state disk.
func randomUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}
