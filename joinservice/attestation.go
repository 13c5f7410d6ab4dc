package joinservice

import (
	"fmt"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/joinservice/policywatch"
	"github.com/berth-k8s/berth/joinservice/server"
)

// transportCredentials builds the server's transport credentials and the hot-reloadable policy from the
// cluster's attestation policy (self-contained YAML from the join configuration). The holder is nil
// without attestation.
func transportCredentials(d Deps, policyYAML string, journal server.HandshakeJournal, obs server.Observer) (credentials.TransportCredentials, *policywatch.Holder, error) {
	log := d.Log
	if d.Attestation == "insecure-none" {
		log.Warn("attestation is disabled: tickets go to any node metadata knows, over plaintext gRPC; development only")
		return insecure.NewCredentials(), nil, nil
	}
	holder, err := policywatch.NewHolder(d.Attestation, "ConfigMap "+joinconfig.Namespace+"/"+joinconfig.JoinConfigName, policyYAML,
		func(p *policy.Policy) (atls.Validator, error) {
			return server.NewHandshakeValidator(p, log.Named("validator"))
		})
	if err != nil {
		return nil, nil, fmt.Errorf("cluster attestation policy: %w", err)
	}
	creds, err := atls.NewCredentials(d.Issuer, holder.Validator(), atls.WithLimiter(atls.NewLimiter(d.AttestLimits)),
		atls.WithClaimCheck(server.ClaimCheck(holder.Policy, journal, obs)), atls.WithLogger(log.Named("atls")))
	if err != nil {
		return nil, nil, fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	return creds, holder, nil
}
