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
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
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
}

// errJoinNotAttested: the joinservice does not attest itself yet, so an attesting node cannot
// verify it before joining; joins need --attestation=insecure-none until it does.
var errJoinNotAttested = errors.New("joining over attested TLS needs an attesting joinservice, which is not wired yet")

func newAttestation(cfg *config, log *zap.Logger) (*attestationSetup, error) {
	var issuer atls.Issuer
	var markers []nodelock.Marker
	switch cfg.attestation {
	case "insecure-none":
		log.Warn("attestation is disabled: secrets travel over plaintext gRPC; use this only for development")
		return &attestationSetup{serverCreds: insecure.NewCredentials(), dialJoin: dialInsecure}, nil
	case "tpm":
		open, err := vtpm.OpenerFromSpec(cfg.tpm)
		if err != nil {
			return nil, fmt.Errorf("--tpm: %w", err)
		}
		issuer = vtpm.NewIssuer(open, log.Named("tpm"))
		markers = append(markers, vtpm.NewLockRegister(open, cfg.lockPCR))
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
	log.Warn("this node can be initialized over attested TLS but cannot join yet: the joinservice does not attest itself")
	dialJoin := func(context.Context, string) (joinproto.JoinServiceClient, io.Closer, error) {
		return nil, nil, errJoinNotAttested
	}
	return &attestationSetup{markers: markers, serverCreds: creds, dialJoin: dialJoin}, nil
}

// dialInsecure opens a plaintext joinservice client; only for --attestation=insecure-none.
func dialInsecure(_ context.Context, endpoint string) (joinproto.JoinServiceClient, io.Closer, error) {
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return joinproto.NewJoinServiceClient(conn), conn, nil
}
