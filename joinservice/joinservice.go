// Package joinservice is the service every control-plane node runs to issue join tickets. Run is the
// only place where its parts meet:
//
//   - at start, it reads the cluster secrets (patiently: right after init the API server may not be
//     reachable yet), the join configuration and the cluster CA, and builds the ticket server with
//     its attestation policy;
//   - then one errgroup runs the gRPC server, the metrics server, the join ledger's writer, the etcd
//     backup schedule (internal/backup; it snapshots on the replica holding Lease berth-backup) and, with
//     attestation, the watcher that hot-reloads the policy (and, while this replica's attestation key
//     has no certificate from the cluster's AK CA, the attempts to get one), until ctx ends.
//
// On shutdown the gRPC server stops gracefully (forcibly after 10 s), the metrics server and
// the policy watcher stop with it, and the ledger writer stops last, after a final write of what the
// last calls recorded.
package joinservice

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/cpfiles"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/serve"
	"github.com/berth-k8s/berth/internal/version"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/certkeeper"
	"github.com/berth-k8s/berth/joinservice/health"
	"github.com/berth-k8s/berth/joinservice/ledger"
	"github.com/berth-k8s/berth/joinservice/metrics"
	"github.com/berth-k8s/berth/joinservice/policywatch"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
	"github.com/berth-k8s/berth/joinservice/server"
)

// stopGrace bounds the graceful stop of the gRPC server; then it is stopped forcibly.
const stopGrace = 10 * time.Second

// Deps are the service's parts and settings, built by the command from its flags.
type Deps struct {
	Log *zap.Logger
	// Client reaches the API server with the joinservice's identity.
	Client kubernetes.Interface
	// Metadata says which instance an address belongs to.
	Metadata interface {
		Peers(ctx context.Context) ([]metadata.Instance, error)
	}
	// Listen opens the gRPC and metrics listeners (a net.ListenConfig).
	Listen interface {
		Listen(ctx context.Context, network, address string) (net.Listener, error)
	}
	// Attestation is the variant this node attests and validates peers with: tpm, tdx, or
	// insecure-none (no attestation, plaintext gRPC).
	Attestation string
	// Issuer attests this node in handshakes; unused with insecure-none.
	Issuer atls.Issuer

	// Address is where the JoinService API is served.
	Address string
	// MetricsAddress is where /metrics and /healthz are served; empty disables them.
	MetricsAddress string
	// Namespace holds Berth's configuration, the join ledger and the control-plane Lease.
	Namespace string
	// PKIDir is kubeadm's PKI directory.
	PKIDir string
	// Replica names this replica in the join ledger and the control-plane Lease.
	Replica string
	// Limits rate-limits join tickets; AttestLimits rate-limits attested handshakes.
	Limits, AttestLimits atls.Limits
	// RefusalLimits rate-limits the refusals of join calls (server.RefusalLimits).
	RefusalLimits server.RefusalLimits
	// Records reaches the record API (internal/records) with the joinservice's identity; nil writes
	// no Machines or JoinRecords.
	Records clientset.Interface
	// RefusalRetention is how long a JoinRecord is kept after its latest refusal; 0 keeps them.
	RefusalRetention time.Duration
	// Dynamic reaches the API server with the joinservice's identity for the certificate keeper
	// (package certkeeper); nil leaves the keeper out.
	Dynamic dynamic.Interface
	// Identity returns this node's attested machine identity (attestation.Result.Identity of its own
	// documents); nil when its attestation has none (TDX, insecure-none).
	Identity func(ctx context.Context) ([]byte, error)
	// ControlPlaneJoinTimeout bounds how long a joining control plane holds the control-plane slot;
	// zero means cpslot.DefaultJoinTimeout.
	ControlPlaneJoinTimeout time.Duration
	// Backup is the etcd snapshot schedule (internal/backup); an empty Dir leaves it out.
	Backup BackupConfig
}

// Readiness conditions of /readyz (package health), in the order they are met at start.
const (
	condSecrets    = "cluster-secrets"    // the cluster Secret read and decoded, keys derived
	condJoinConfig = "join-config"        // the join ConfigMap read and decoded, the attestation policy built
	condCA         = "cluster-ca"         // the cluster CA loaded from the PKI directory
	condPolicy     = "policy-watch"       // the policy watcher listed the join ConfigMap (with attestation)
	condIssuer     = "attestation-issuer" // the last attestation self-check made a document (with attestation)
	condServing    = "join-server"        // the gRPC server serves on its listener
)

// Run serves until ctx ends and everything has stopped; it returns nil then. A failure to start, or
// of the gRPC server, is returned. The metrics port (with /livez and /readyz) is served from the start,
// so that the probes answer while the joinservice waits for the cluster secrets.
func Run(ctx context.Context, d Deps) error {
	log := d.Log
	conditions := []string{condSecrets, condJoinConfig, condCA, condMachines, condServing}
	if d.Attestation != "insecure-none" {
		conditions = []string{condSecrets, condJoinConfig, condCA, condMachines, condPolicy, condIssuer, condServing}
	}
	probes := health.New(conditions...)
	journal := ledger.NewWriter(d.Client, d.Namespace, d.Replica, log.Named("ledger"))
	m := metrics.New(journal)

	g, gctx := errgroup.WithContext(ctx)
	if d.MetricsAddress != "" {
		mlis, err := d.Listen.Listen(ctx, "tcp", d.MetricsAddress)
		if err != nil {
			return fmt.Errorf("listening for metrics: %w", err)
		}
		g.Go(func() error {
			if err := m.Serve(gctx, mlis, probes, log.Named("metrics")); err != nil {
				log.Error("metrics server stopped", zap.Error(err))
			}
			return nil
		})
	}
	g.Go(func() error {
		err := start(gctx, g, d, probes, journal, m)
		if err != nil {
			probes.Stopping()
		}
		return err
	})
	if d.Dynamic != nil {
		// The keeper needs nothing the join server needs: it starts at once, and a joinservice that
		// waits for its secrets still keeps the certificates.
		keeper := certKeeper(d, m)
		keeperEnded := probes.Started("cert-keeper")
		g.Go(func() error {
			err := certkeeper.Run(gctx, keeper)
			keeperEnded(err)
			return err
		})
	}
	return g.Wait()
}

// certKeeper builds the certificate keeper's parts: the webhook keeper, the kubelet serving CSR
// approver (checking requests against this service's metadata) and their metrics in the
// joinservice's registry.
func certKeeper(d Deps, m *metrics.Metrics) certkeeper.Deps {
	log := d.Log.Named("certkeeper")
	km := certkeeper.NewMetrics(m.Registry(), certkeeper.NewControlPlaneCerts(d.PKIDir))
	return certkeeper.Deps{
		Log: log, Client: d.Client, Namespace: d.Namespace, Identity: d.Replica + "_" + rand.Text()[:8],
		Webhook:  install.NewKeeper(install.Config{}, d.Client, d.Dynamic, certkeeper.Progress(log.Named("webhook"))).WithRotationLock(rotationLock(d, log)),
		Approver: certkeeper.NewApprover(log.Named("csr"), d.Client, d.Metadata, km).WithRevocations(d.Namespace),
		Metrics:  km,
	}
}

// start reads what the service needs, then runs its loops on g. It returns once they run, or with
// the reason it could not start.
func start(ctx context.Context, g *errgroup.Group, d Deps, probes *health.Probes, journal *ledger.Writer, m *metrics.Metrics) error {
	log := d.Log
	keys, salt, err := loadKeysPatiently(ctx, d.Client, d.Namespace, startupPatience, log,
		func(err error) { probes.Set(condSecrets, err) })
	probes.Set(condSecrets, err)
	if err != nil {
		return err
	}
	cm, err := d.Client.CoreV1().ConfigMaps(d.Namespace).Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
	if err != nil {
		err = fmt.Errorf("reading join configuration: %w", err)
		probes.Set(condJoinConfig, err)
		return err
	}
	cfg, err := joinconfig.DecodeConfig(cm.Data)
	if err != nil {
		err = fmt.Errorf("reading join configuration: %w", err)
		probes.Set(condJoinConfig, err)
		return err
	}
	authority, err := ca.Load(d.PKIDir)
	probes.Set(condCA, err)
	if err != nil {
		return err
	}
	// The session proof spares the TPM a quote per join (atls.SessionProof); certifying the AK spares
	// it the activation per new node.
	var session *atls.SessionProof
	if d.Attestation != "insecure-none" && d.Issuer != nil {
		session = atls.NewSessionProof(countedIssuer(d.Issuer, metrics.PurposeSession, m), log.Named("session"))
	}
	// Addresses metadata knows get an attested budget of their own (atls.WithKnownPeers).
	known := server.NewKnownPeers(d.Metadata, log.Named("known-peers"))
	if err := known.Refresh(ctx); err != nil {
		log.Warn("listing the cluster's instances for the known peers' budget", zap.Error(err))
	}
	// The record API gets what the ledger gets (refusals) and the admissions with their evidence.
	var journalTo interface {
		server.Journal
		server.HandshakeJournal
	} = journal
	var records *recordwriter.Writer
	if d.Records != nil {
		records = recordwriter.New(d.Records, d.Client, d.Namespace, d.Replica, log.Named("records"))
		journalTo = teeJournal{journal, records}
	}
	creds, holder, checkIn, err := transportCredentials(d, string(cfg.AttestationPolicy), keys.ClusterID(), journalTo, m, session, known.Known)
	probes.Set(condJoinConfig, err)
	if err != nil {
		return err
	}
	var check server.AttestationCheck
	if holder != nil {
		// Before the session proof's first renewal (started below), so that it carries the certificate;
		// after a failure, again in the background until an attempt succeeds.
		if session != nil && certifyAK(ctx, d.Issuer, keys, holder.Policy(), m, log) {
			g.Go(func() error {
				recertifyAK(ctx, recertifyBackoff, d.Issuer, keys, holder.Policy, m, log)
				return nil
			})
		}
		check = holder.Check
		creds = server.RecordHandshakes(creds, journalTo, m)
	}
	members := newMembership(d, journal)
	opts := []server.Option{server.WithJournal(journalTo)}
	if checkIn != nil {
		// A node that booted on its sealed key while no joinservice answered checks in with its lock
		// register extended: this cluster's lock values pass for CheckIn alone.
		opts = append(opts, server.WithCheckInAttestation(checkIn.Check))
	}
	if records != nil {
		members.record.OnChange(records.SyncRemovals)
		opts = append(opts, server.WithAdmissions(records), traceOption(records, checkIn))
	}
	srv := server.New(server.Config{
		APIServerEndpoint: cfg.APIServerEndpoint,
		KubernetesVersion: cfg.KubernetesVersion,
		PKIDir:            d.PKIDir,
	}, log.Named("joinservice"), keys, salt, authority, d.Metadata, check,
		append(opts, server.WithLimits(d.Limits), server.WithRefusalLimits(d.RefusalLimits), server.WithObserver(m),
			server.WithControlPlaneLock(server.SlotLock{Slot: members.lock}), server.WithMachineRecord(members.record),
			server.WithKMSSpec(func(ctx context.Context) (kmsstate.Spec, error) {
				st, err := kmsstate.Read(ctx, d.Client)
				return st.Spec, err
			}),
			server.WithClusterFiles(func(ctx context.Context) ([]*joinproto.File, error) {
				return cpfiles.FromCluster(ctx, d.Client)
			}))...)

	lis, err := d.Listen.Listen(ctx, "tcp", d.Address)
	if err != nil {
		err = fmt.Errorf("listening: %w", err)
		probes.Set(condServing, err)
		return err
	}
	gs := grpc.NewServer(append(server.GRPCServerOptions(), grpc.Creds(creds))...)
	joinproto.RegisterJoinServiceServer(gs, srv)

	// The ledger writer outlives the gRPC server by its final flush: it stops after the server.
	ledgerCtx, stopLedger := context.WithCancel(context.WithoutCancel(ctx))
	ledgerEnded := probes.Started("ledger")
	g.Go(func() error {
		defer stopLedger()
		err := journal.Run(ledgerCtx)
		ledgerEnded(err)
		return err
	})
	if records != nil {
		recordsEnded := probes.Started("records")
		g.Go(func() error {
			err := records.Run(ledgerCtx)
			recordsEnded(err)
			return err
		})
		g.Go(func() error {
			return records.RunPruning(ctx, clock.RealClock{}, d.RefusalRetention, recordwriter.PruneInterval)
		})
	}
	members.run(ctx, g, d, probes)
	if d.Backup.Dir != "" {
		sched := backupSchedule(ctx, d, keys, m)
		backupEnded := probes.Started("backup")
		g.Go(func() error {
			err := sched.Run(ctx)
			backupEnded(err)
			return err
		})
	}
	if holder != nil {
		w := policywatch.NewWatcher(d.Client, d.Namespace, joinconfig.JoinConfigName, d.Replica, holder, m, log.Named("policy"))
		watchEnded := probes.Started("policy-watch")
		g.Go(func() error {
			err := w.Run(ctx)
			if err != nil {
				log.Error("policy watcher stopped", zap.Error(err))
			}
			watchEnded(err)
			return nil
		})
		g.Go(func() error { return waitPolicySynced(ctx, w, probes) })
		if session != nil {
			g.Go(func() error { return session.Run(ctx) })
		}
		g.Go(func() error { return known.Run(ctx) })
		checkEnded := probes.Started("attestation-check")
		g.Go(func() error {
			checkIssuer(ctx, countedIssuer(d.Issuer, metrics.PurposeSelfCheck, m), probes, log)
			checkEnded(nil)
			return nil
		})
	}
	// Joins are served once the machine record was read: before, a removed machine could not be
	// told from a new one, and every join would be refused.
	if !members.waitRead(ctx, d, probes) {
		return nil // ctx ended
	}
	serveEnded := probes.Started("join-server")
	g.Go(func() error {
		defer stopLedger()
		probes.Set(condServing, nil)
		err := serve.GRPC(ctx, gs, lis, stopGrace)
		if err != nil {
			err = fmt.Errorf("serving: %w", err)
		}
		serveEnded(err)
		return err
	})
	// Readiness fails as soon as the service starts stopping, before the gRPC server drains.
	g.Go(func() error {
		<-ctx.Done()
		probes.Stopping()
		return nil
	})
	log.Info("joinservice serving", zap.String("address", lis.Addr().String()), zap.String("version", version.Version))
	return nil
}

// teeJournal hands every join attempt to the ledger and to the record API's writer.
type teeJournal struct {
	ledger  *ledger.Writer
	records *recordwriter.Writer
}

func (t teeJournal) Record(e ledger.Entry) {
	t.ledger.Record(e)
	t.records.Record(e)
}

func (t teeJournal) RecordRateLimited(peer string) {
	t.ledger.RecordRateLimited(peer)
	t.records.RecordRateLimited(peer)
}
