package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/joindial"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/nodelock"
)

// attestationSetup is what the attestation variant contributes to the daemon.
type attestationSetup struct {
	// markers are the hardware lock registers, taken before the on-disk marker.
	markers []nodelock.Marker
	// serverCreds make the InitServer attest itself to `berth init`.
	serverCreds credentials.TransportCredentials
	// dialJoin opens a joinservice client.
	dialJoin func(ctx context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error)
	// identity is this machine's hardware identity as the joinservice sees it; nil where the
	// variant has none (the disk binding then names the instance).
	identity func(ctx context.Context) ([]byte, error)
	// sealer seals the state disk key to the TPM; nil where sealing is not available.
	sealer *vtpm.Sealer
	// phase marks the state disk open (--phase-pcr); nil marks nothing.
	phase *vtpm.BootPhase
}

// errNoJoinPolicy: an attesting node without --join-policy cannot check the joinservice, so it
// does not join.
var errNoJoinPolicy = errors.New("no --join-policy: this node does not join")

func newAttestation(cfg *config, log *zap.Logger) (*attestationSetup, error) {
	var issuer atls.Issuer
	var markers []nodelock.Marker
	var identity func(ctx context.Context) ([]byte, error)
	var sealer *vtpm.Sealer
	var phase *vtpm.BootPhase
	switch cfg.attestation {
	case "insecure-none":
		log.Warn("attestation is disabled: secrets travel over plaintext gRPC; use this only for development")
		return &attestationSetup{serverCreds: insecure.NewCredentials(), dialJoin: dialInsecure}, nil
	case "tpm":
		open, err := vtpm.OpenerFromSpec(cfg.tpm)
		if err != nil {
			return nil, fmt.Errorf("--tpm: %w", err)
		}
		tpmIssuer := vtpm.NewIssuer(open, log.Named("tpm"))
		issuer = tpmIssuer
		markers = append(markers, vtpm.NewLockRegister(open, cfg.lockPCR))
		identity = tpmIssuer.MachineIdentity
		if cfg.phasePCR != 0 {
			sealer = vtpm.NewSealer(open, cfg.sealPCRs, cfg.lockPCR, cfg.phasePCR)
			phase = vtpm.NewBootPhase(open, cfg.phasePCR)
		} else {
			sealer = vtpm.NewSealer(open, cfg.sealPCRs, cfg.lockPCR)
		}
	case "tdx":
		open := tdx.OpenAuto()
		issuer = tdx.NewIssuer(open, log.Named("tdx"))
		reg, err := tdx.NewLockRegister(open, tdx.DefaultLockRTMR)
		if err != nil {
			return nil, fmt.Errorf("creating TDX lock register: %w", err)
		}
		markers = append(markers, reg)
	}
	creds, err := atls.NewCredentials(issuer, nil, atls.WithLimiter(atls.NewLimiter(atls.DefaultLimits)), atls.WithLogger(log.Named("atls")))
	if err != nil {
		return nil, fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	setup := &attestationSetup{markers: markers, serverCreds: creds, identity: identity, sealer: sealer, phase: phase}
	if cfg.joinPolicy == "" {
		log.Warn("no --join-policy: this node can be initialized but will not join a cluster")
		setup.dialJoin = func(context.Context, string) (joinproto.JoinServiceClient, io.Closer, error) {
			return nil, nil, errNoJoinPolicy
		}
		return setup, nil
	}
	p, err := policy.Load(cfg.joinPolicy)
	if err != nil {
		return nil, fmt.Errorf("--join-policy: %w", err)
	}
	if p.Variant != cfg.attestation {
		return nil, fmt.Errorf("--join-policy is for %q, this node attests with %q", p.Variant, cfg.attestation)
	}
	validator, err := choose.NewValidator(p, log.Named("join-validator"))
	if err != nil {
		return nil, fmt.Errorf("--join-policy: %w", err)
	}
	setup.dialJoin, err = joindial.New(issuer, validator, lockCheck(cfg), atls.WithLogger(log.Named("atls")))
	if err != nil {
		return nil, err
	}
	return setup, nil
}

// lockCheck verifies that the joinservice's lock register holds the control-plane value of its
// ticket's cluster (nodelock.ControlPlaneLockID): a bootstrapped worker's TPM is refused.
func lockCheck(cfg *config) joindial.LockCheck {
	if cfg.attestation == "tdx" {
		return joindial.ControlPlaneLock(uint32(1+tdx.DefaultLockRTMR), tdx.ExpectedLockRTMR)
	}
	return joindial.ControlPlaneLock(uint32(cfg.lockPCR), vtpm.ExpectedLockValue)
}

// dialInsecure opens a plaintext joinservice client; only for --attestation=insecure-none.
func dialInsecure(_ context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return joinproto.NewJoinServiceClient(conn), conn, nil
}
