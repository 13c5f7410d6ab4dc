package joinservice

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/joinservice/health"
	"github.com/berth-k8s/berth/joinservice/metrics"
	"github.com/berth-k8s/berth/joinservice/policywatch"
	"github.com/berth-k8s/berth/joinservice/server"
)

// transportCredentials builds the server's transport credentials and the hot-reloadable policy from the
// cluster's attestation policy (self-contained YAML from the join configuration). The holder is nil
// without attestation.
func transportCredentials(d Deps, policyYAML string, journal server.HandshakeJournal, m *metrics.Metrics, session *atls.SessionProof,
	known func(peer string) bool, clusterID []byte) (credentials.TransportCredentials, *policywatch.Holder, error) {
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
	creds, err := atls.NewCredentials(countedIssuer(d.Issuer, metrics.PurposeConnection, m), holder.Validator(), atls.WithLimiter(atls.NewLimiter(d.AttestLimits)),
		atls.WithClaimCheck(joinedClaims(server.ClaimCheck(holder.Policy, journal, m), d.Attestation, clusterID)), atls.WithLogger(log.Named("atls")), atls.WithSessionProof(session),
		atls.WithKnownPeers(known),
		// An operator's berth kubeconfig attests nothing; every join RPC refuses a peer without
		// evidence (NO_EVIDENCE), charged to the unverified budget.
		atls.WithOptionalClientAttestation())
	if err != nil {
		return nil, nil, fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	return creds, holder, nil
}

// opCounter counts attestation operations (metrics.Metrics).
type opCounter interface {
	AttestationOperation(purpose, operation string)
}

// countedIssuer returns issuer counting its quotes (and activations, where it activates) for
// purpose, so the metrics show which work a join cost this replica's TPM.
func countedIssuer(issuer atls.Issuer, purpose string, c opCounter) atls.Issuer {
	if issuer == nil || c == nil {
		return issuer
	}
	ci := counting{Issuer: issuer, purpose: purpose, c: c}
	if a, ok := issuer.(atls.Activator); ok {
		return countingActivator{counting: ci, a: a}
	}
	return ci
}

type counting struct {
	atls.Issuer
	purpose string
	c       opCounter
}

func (i counting) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	i.c.AttestationOperation(i.purpose, metrics.OperationQuote)
	return i.Issuer.Issue(ctx, userData, nonce)
}

type countingActivator struct {
	counting
	a atls.Activator
}

func (i countingActivator) Identity(ctx context.Context) ([]byte, error) { return i.a.Identity(ctx) }

func (i countingActivator) Activate(ctx context.Context, challenge []byte) ([]byte, error) {
	i.c.AttestationOperation(i.purpose, metrics.OperationActivate)
	return i.a.Activate(ctx, challenge)
}

// akCertifier is an issuer whose attestation key the cluster's AK CA can certify (vtpm.Issuer).
type akCertifier interface {
	CertifyAK(ctx context.Context, certify func(akPublic, ekPublic []byte) ([]byte, error)) error
}

// certifyAK has the cluster's AK CA (derived from the master secret) certify this replica's TPM
// attestation key, after the issuer activated it against its own EK: nodes whose join policy lists
// the CA in akRoots then take this replica's session proof without activating its key or checking its
// EK chain (vtpm.Validator.ValidateCertified), so a join costs this replica's TPM nothing. Because the
// certificate stands in for the EK chain, the replica first checks its own EK and AK creation record
// against the cluster's policy (one quote per attempt) and certifies nothing its nodes would refuse.
// Without a certificate (a failed attempt, a TDX replica) nodes activate as before. The quote of that
// check is counted as a self-check on ops; p is the cluster's policy in force. It reports whether an
// attempt failed, so that a later one may succeed (recertifyAK).
func certifyAK(ctx context.Context, issuer atls.Issuer, keys *clusterkeys.Keys, p *policy.Policy, ops opCounter, log *zap.Logger) (failed bool) {
	c, ok := issuer.(akCertifier)
	if !ok {
		return false
	}
	if err := certifyOwnAK(ctx, countedIssuer(issuer, metrics.PurposeSelfCheck, ops), c, keys, p); err != nil {
		if ctx.Err() == nil {
			log.Warn("certifying the attestation key failed: nodes activate it per join until an attempt succeeds", zap.Error(err))
		}
		return true
	}
	log.Info("attestation key certified by the cluster's attestation-key CA: the session proof's next renewal carries the certificate")
	return false
}

// recertifyBackoff paces the attempts after a failed first certifyAK: a TPM that failed a command at
// start is tried again within seconds, a policy that does not root this replica's EK every 5 minutes
// (a policy update may change that).
var recertifyBackoff = wait.Backoff{Duration: 5 * time.Second, Factor: 2, Jitter: 0.1, Steps: math.MaxInt32, Cap: 5 * time.Minute}

// recertifyAK repeats certifyAK, paced by b, with the policy in force at each attempt, until one
// succeeds or ctx ends. The issuer keeps the certificate, and the session proof's next renewal
// carries it.
func recertifyAK(ctx context.Context, b wait.Backoff, issuer atls.Issuer, keys *clusterkeys.Keys, policy func() *policy.Policy, ops opCounter, log *zap.Logger) {
	for {
		// Past its cap, Step keeps returning the cap (jittered).
		select {
		case <-ctx.Done():
			return
		case <-time.After(b.Step()):
		}
		if !certifyAK(ctx, issuer, keys, policy(), ops, log) {
			return
		}
	}
}

func certifyOwnAK(ctx context.Context, issuer atls.Issuer, c akCertifier, keys *clusterkeys.Keys, p *policy.Policy) error {
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		return fmt.Errorf("cluster attestation policy: %w", err)
	}
	raw, err := issueOnce(ctx, issuer)
	if err != nil {
		return err
	}
	own, err := vtpm.ParseDocument(raw)
	if err != nil {
		return err
	}
	if err := v.VerifyIdentity(own); err != nil {
		return fmt.Errorf("the cluster's policy does not trust this replica's own TPM identity: %w", err)
	}
	ca, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		return err
	}
	return c.CertifyAK(ctx, func(akPublic, ekPublic []byte) ([]byte, error) {
		if !bytes.Equal(akPublic, own.AKPublic) || !bytes.Equal(ekPublic, own.EKPublic) {
			return nil, errors.New("the attestation key changed after its identity was checked")
		}
		return ca.Certify(akPublic, ekPublic)
	})
}

// The attestation self-check behind readiness: every issuerCheckInterval the issuer makes a document
// for a fresh nonce, bounded by issuerCheckTimeout. One quote a minute is nothing next to the
// handshakes' rate limit (atls.DefaultLimits), and it finds a TPM or TDX device that stopped
// answering before a joining node does.
const (
	issuerCheckInterval = time.Minute
	issuerCheckTimeout  = 20 * time.Second
)

// selfCheckUserData is the user data of the self-check's documents. They never leave the process.
var selfCheckUserData = sha256.Sum256([]byte("berth joinservice readiness self-check"))

// checkIssuer runs the self-check until ctx ends, recording each result as condIssuer.
func checkIssuer(ctx context.Context, issuer atls.Issuer, probes *health.Probes, log *zap.Logger) {
	var failing bool
	for {
		_, err := issueOnce(ctx, issuer)
		if ctx.Err() != nil {
			return
		}
		probes.Set(condIssuer, err)
		switch {
		case err != nil && !failing:
			log.Warn("attestation self-check failed: not ready", zap.Error(err))
		case err == nil && failing:
			log.Info("attestation self-check passes again")
		}
		failing = err != nil
		select {
		case <-ctx.Done():
			return
		case <-time.After(issuerCheckInterval):
		}
	}
}

// issueOnce has issuer make one document of this replica for a fresh nonce, bounded by
// issuerCheckTimeout: the readiness self-check and certifyAK's check of its own identity.
func issueOnce(ctx context.Context, issuer atls.Issuer) ([]byte, error) {
	if issuer == nil {
		return nil, errors.New("no attestation issuer")
	}
	nonce := make([]byte, 32)
	if _, err := rand.Read(nonce); err != nil {
		return nil, fmt.Errorf("making a nonce: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, issuerCheckTimeout)
	defer cancel()
	doc, err := issuer.Issue(ctx, selfCheckUserData[:], nonce)
	if err != nil {
		return nil, fmt.Errorf("issuing a %s attestation document: %w", issuer.Variant(), err)
	}
	if len(doc) == 0 {
		return nil, fmt.Errorf("issuing a %s attestation document: the issuer returned an empty document", issuer.Variant())
	}
	return doc, nil
}

// waitPolicySynced records condPolicy: not ready, with the last list or watch error, until the
// policy watcher has listed the join ConfigMap.
func waitPolicySynced(ctx context.Context, w *policywatch.Watcher, probes *health.Probes) error {
	const poll = time.Second
	probes.Set(condPolicy, errors.New("the policy watcher has not listed the join ConfigMap yet"))
	// It ends with ctx (or once synced); ctx's error is no failure of the service.
	_ = wait.PollUntilContextCancel(ctx, poll, true, func(context.Context) (bool, error) {
		select {
		case <-w.Synced():
			probes.Set(condPolicy, nil)
			return true, nil
		default:
		}
		if err := w.SyncError(); err != nil {
			probes.Set(condPolicy, fmt.Errorf("the policy watcher cannot list the join ConfigMap: %w", err))
		}
		return false, nil
	})
	return nil
}
