// Command joinservice runs on every control-plane node (DaemonSet berth-joinservice, host network)
// and issues join tickets to nodes that may join the cluster.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"k8s.io/client-go/dynamic"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kubeclient"
	"github.com/berth-k8s/berth/internal/logging"
	metachoose "github.com/berth-k8s/berth/internal/metadata/choose"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/joinservice"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
	"github.com/berth-k8s/berth/joinservice/server"
)

type options struct {
	listen       string
	metricsAddr  string
	pkiDir       string
	kubeconfig   string
	namespace    string
	metadata     string
	metadataURL  string
	metadataFile string
	metadataAPI  string
	attestation  string
	tpm          string
	tdxRoot      string
	replica      string
	limits       atls.Limits
	attestLimits atls.Limits
	refusals     server.RefusalLimits
	log          logging.Config
	joinTimeout  time.Duration
	backup       joinservice.BackupConfig
	// refusalRetention is how long a JoinRecord is kept after its latest refusal.
	refusalRetention time.Duration
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	o := options{listen: fmt.Sprintf(":%d", joinconfig.JoinPort), metricsAddr: fmt.Sprintf("127.0.0.1:%d", joinconfig.MetricsPort), pkiDir: "/etc/kubernetes/pki",
		namespace: joinconfig.Namespace, backup: joinservice.BackupConfig{Interval: backup.DefaultInterval, Keep: backup.DefaultKeep}, limits: server.DefaultLimits, attestLimits: atls.DefaultLimits, refusals: server.DefaultRefusalLimits,
		log: logging.Config{Level: envOr(joinconfig.EnvLogLevel, "info"), Format: envOr(joinconfig.EnvLogFormat, logging.FormatJSON), Sample: true}}
	cmd := &cobra.Command{
		Use:   "joinservice",
		Short: "Issue join tickets to nodes that may join the cluster",
		Long: `joinservice runs on the control-plane nodes and answers IssueJoinTicket and IssueRejoinTicket.
It reads the cluster's master secret and join configuration from the berth-system namespace, the
cluster CA from kubeadm's PKI directory, and which address belongs to which instance from the
platform's metadata.

With attestation, every connection is mutual attested TLS: this node proves it runs the cluster's
image and is bootstrapped, the joining node proves what it runs, and the cluster's attestation
policy (ConfigMap berth-join-config, reloaded on every change; a bad update is refused with an
Event and the old policy stays) decides; a rejected node is told which measurement deviated. A node
that claims its measurements up front (TPM nodes do) and claims wrong ones is refused before this
node quotes or activates anything for it.

With --attestation=tdx this node quotes through configfs-tsm (or, in a build with the tag
berth_qpl, the legacy /dev/tdx-guest) under --tdx-root, and checks TDX nodes with the collateral
the policy's tdx section names: collateralBundle (shipped with the policy, never fetched),
collateralDir, or a PCS (pcsURL, default Intel's), cached in memory; a node whose collateral
cannot be had is refused as UNTRUSTED_ROOT with the reason in the join ledger.

The joinservice on every control plane also runs the certificate keeper (package certkeeper):
the replica that holds Lease berth-cert-keeper renews the image-policy webhook's certificates,
rotates its CA, repairs its caBundle and approves kubelet serving certificates for the nodes that
ask for them, and every replica reports its node's control-plane certificate expiry in /metrics.

The replica that holds Lease berth-backup takes an etcd snapshot every --backup-interval (and on
berth backup now), sealed under a key derived from the master secret with the KMS keys inside, into
--backup-dir and, when Secret berth-backup-store names one, an S3-compatible object store; each store
keeps the newest --backup-keep. ConfigMap berth-backup and berth_backup_* metrics report it.

Every attempt goes to the join ledger (ConfigMap berth-join-ledger and Events on it; berth status
prints it). Calls are rate-limited per peer address and overall (--rate-*), and so are attested
handshakes (--attest-rate-*): per peer address, then from a budget of the cluster's instances (as
metadata knows them) and a budget of everyone else, so that a flood from unknown addresses never
uses up what the cluster's nodes need; identity probes and refusals on claims, which cost no TPM
work, have a budget of their own; control-plane joins take
the control-plane slot (Lease berth-control-plane-slot, shared with the control planes' certificate
renewals), held from a control plane's ticket until its etcd member votes and answers and its API server is ready (or
--control-plane-join-timeout passed). Every machine admitted is recorded by its attested identity in
ConfigMap berth-machines; a machine an operator removed (berth node remove) is refused with REVOKED,
and a removed control plane's etcd member is removed here, never breaking etcd's quorum unless the
removal was forced. Prometheus metrics (/metrics) and
the probes are served on --metrics-listen (loopback unless told; the DaemonSet binds the node's own
address): /livez is 200 while every loop of the service runs, /readyz only once it has read the
cluster secrets and the join configuration, loaded the CA, synced its policy watcher, made an
attestation document in its last self-check and serves joins.

--metadata, --metadata-url, --metadata-api-url, --metadata-file, --attestation, --tpm, --tdx-root,
--log-level and --log-format default to BERTH_METADATA, BERTH_METADATA_URL, BERTH_METADATA_API_URL,
BERTH_METADATA_FILE, BERTH_ATTESTATION, BERTH_TPM, BERTH_TDX_ROOT, BERTH_LOG_LEVEL and
BERTH_LOG_FORMAT; the bootstrapper passes its own to the DaemonSet.`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd.Context(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.listen, "listen", o.listen, "address to serve on")
	f.StringVar(&o.metricsAddr, "metrics-listen", o.metricsAddr, "address to serve Prometheus metrics (/metrics) and the probes (/livez, /readyz) on; empty disables")
	f.StringVar(&o.pkiDir, "pki-dir", o.pkiDir, "kubeadm's PKI directory")
	f.StringVar(&o.kubeconfig, "kubeconfig", o.kubeconfig, "kubeconfig; empty means in-cluster")
	f.StringVar(&o.namespace, "namespace", o.namespace, "namespace of Berth's configuration")
	f.StringVar(&o.metadata, "metadata", envOr(joinconfig.EnvMetadata, ""), "metadata provider: static, mini, qemu, gcp, aws or azure")
	f.StringVar(&o.metadataURL, "metadata-url", envOr(joinconfig.EnvMetadataURL, ""), "metadata API for --metadata=mini|qemu; for gcp, aws and azure the instance metadata service (default: the cloud's well-known address)")
	f.StringVar(&o.metadataAPI, "metadata-api-url", envOr(joinconfig.EnvMetadataAPIURL, ""), "for --metadata=gcp|aws|azure: the cloud's compute API (default: the cloud's own endpoint)")
	f.StringVar(&o.metadataFile, "metadata-file", envOr(joinconfig.EnvMetadataFile, ""), "metadata file for --metadata=static")
	f.StringVar(&o.attestation, "attestation", envOr(joinconfig.EnvAttestation, ""), "attestation variant: tpm, tdx, or insecure-none (development only)")
	f.StringVar(&o.tpm, "tpm", envOr(joinconfig.EnvTPM, ""), "TPM of this node for --attestation=tpm (device path, tcp:HOST:PORT or unix:PATH)")
	f.StringVar(&o.tdxRoot, "tdx-root", envOr(joinconfig.EnvTDXRoot, "/"), "directory under which --attestation=tdx finds this node's TD guest interface: ROOT"+tdx.TSMReportDir+" (configfs-tsm), else ROOT"+tdx.LegacyGuestDevice+" (only in a build with the tag berth_qpl)")
	f.StringVar(&o.replica, "replica", envOr(joinconfig.EnvNodeName, ""), "name of this replica in the join ledger and the control-plane Lease (default: NODE_NAME, else the host name)")
	f.Float64Var((*float64)(&o.limits.PerPeer), "rate-per-peer", float64(o.limits.PerPeer), "join tickets per second per peer address")
	f.IntVar(&o.limits.PerPeerBurst, "rate-per-peer-burst", o.limits.PerPeerBurst, "burst of --rate-per-peer")
	f.Float64Var((*float64)(&o.limits.Global), "rate-global", float64(o.limits.Global), "join tickets per second over all peers")
	f.IntVar(&o.limits.GlobalBurst, "rate-global-burst", o.limits.GlobalBurst, "burst of --rate-global")
	f.Float64Var((*float64)(&o.refusals.Refused), "rate-refused", float64(o.refusals.Refused), "refusals per second of attested join calls (policy, metadata, role, revocation), recorded one by one; the tickets budget (--rate-global) is spent only by calls that pass")
	f.IntVar(&o.refusals.RefusedBurst, "rate-refused-burst", o.refusals.RefusedBurst, "burst of --rate-refused")
	f.Float64Var((*float64)(&o.refusals.Unverified), "rate-unverified", float64(o.refusals.Unverified), "join calls per second without attestation evidence, over all peers")
	f.IntVar(&o.refusals.UnverifiedBurst, "rate-unverified-burst", o.refusals.UnverifiedBurst, "burst of --rate-unverified")
	f.Float64Var((*float64)(&o.attestLimits.PerPeer), "attest-rate-per-peer", float64(o.attestLimits.PerPeer), "attestation attempts per second per peer address (an identity probe and the handshake it precedes are one)")
	f.IntVar(&o.attestLimits.PerPeerBurst, "attest-rate-per-peer-burst", o.attestLimits.PerPeerBurst, "burst of --attest-rate-per-peer")
	f.Float64Var((*float64)(&o.attestLimits.Global), "attest-rate-global", float64(o.attestLimits.Global), "attested handshakes per second of peers metadata does not know as the cluster's instances; size it to this node's TPM")
	f.IntVar(&o.attestLimits.GlobalBurst, "attest-rate-global-burst", o.attestLimits.GlobalBurst, "burst of --attest-rate-global")
	f.Float64Var((*float64)(&o.attestLimits.Known), "attest-rate-known", float64(o.attestLimits.Known), "attested handshakes per second of the cluster's instances (metadata), a budget of their own that no flood from elsewhere touches")
	f.IntVar(&o.attestLimits.KnownBurst, "attest-rate-known-burst", o.attestLimits.KnownBurst, "burst of --attest-rate-known")
	f.Float64Var((*float64)(&o.attestLimits.Unauthenticated), "attest-rate-unauthenticated", float64(o.attestLimits.Unauthenticated), "identity probes and claim refusals per second over all peers (no TPM work; 0: unlimited)")
	f.IntVar(&o.attestLimits.UnauthenticatedBurst, "attest-rate-unauthenticated-burst", o.attestLimits.UnauthenticatedBurst, "burst of --attest-rate-unauthenticated")
	f.DurationVar(&o.joinTimeout, "control-plane-join-timeout", cpslot.DefaultJoinTimeout, "how long a control plane's join holds the control-plane slot at most, from its ticket until its etcd member votes and its API server is ready")
	f.StringVar(&o.backup.Dir, "backup-dir", o.backup.Dir, "directory of the etcd snapshots on this control plane's state disk (the DaemonSet passes "+joinconfig.BackupDir+"); empty turns the backup schedule off")
	f.DurationVar(&o.backup.Interval, "backup-interval", o.backup.Interval, "time between two scheduled etcd snapshots (at most 6h)")
	f.IntVar(&o.backup.Keep, "backup-keep", o.backup.Keep, "etcd snapshots kept in every store (at least 5)")
	f.DurationVar(&o.refusalRetention, "join-record-retention", recordwriter.DefaultRefusalRetention, "how long a JoinRecord (kubectl get bjr) is kept after its latest refusal; 0 keeps them all")
	o.log.AddFlags(f)
	cmd.SetArgs(os.Args[1:])
	if err := cmd.ExecuteContext(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "joinservice: %v\n", err)
		os.Exit(1)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// run builds the service's parts from o and runs it.
func run(ctx context.Context, o options) error {
	log, err := logging.New(o.log, os.Stderr)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	d, err := deps(ctx, o, log)
	if err != nil {
		return err
	}
	return joinservice.Run(ctx, d)
}

// deps builds the service's parts from o.
func deps(ctx context.Context, o options, log *zap.Logger) (joinservice.Deps, error) {
	d := joinservice.Deps{
		Log: log, Listen: &net.ListenConfig{}, Attestation: o.attestation,
		Address: o.listen, MetricsAddress: o.metricsAddr, Namespace: o.namespace, PKIDir: o.pkiDir, Replica: o.replica,
		Limits: o.limits, AttestLimits: o.attestLimits, RefusalLimits: o.refusals, ControlPlaneJoinTimeout: o.joinTimeout,
		RefusalRetention: o.refusalRetention,
	}
	if o.refusalRetention < 0 {
		return d, fmt.Errorf("--join-record-retention %v: want 0 (keep) or a positive duration", o.refusalRetention)
	}
	if o.backup.Interval <= 0 || o.backup.Interval > backup.DefaultInterval || o.backup.Keep < backup.DefaultKeep {
		return d, fmt.Errorf("--backup-interval %v, --backup-keep %d: want at most %v and at least %d", o.backup.Interval, o.backup.Keep, backup.DefaultInterval, backup.DefaultKeep)
	}
	d.Backup = o.backup
	if o.joinTimeout <= 0 {
		return d, fmt.Errorf("--control-plane-join-timeout %v: want a positive duration", o.joinTimeout)
	}
	switch o.attestation {
	case "insecure-none", "tpm", "tdx":
	default:
		return d, fmt.Errorf("--attestation %q: want tpm, tdx, or insecure-none", o.attestation)
	}
	meta, err := metachoose.New(ctx, metachoose.Config{Name: o.metadata, File: o.metadataFile, URL: o.metadataURL, APIURL: o.metadataAPI})
	if err != nil {
		return d, err
	}
	d.Metadata = meta
	switch o.attestation {
	case "tpm":
		open, err := vtpm.OpenerFromSpec(o.tpm)
		if err != nil {
			return d, fmt.Errorf("--tpm: %w", err)
		}
		issuer := vtpm.NewIssuer(open, log.Named("tpm"))
		d.Issuer, d.Identity = issuer, issuer.MachineIdentity
	case "tdx":
		open, err := tdxOpener(o.tdxRoot)
		if err != nil {
			return d, err
		}
		d.Issuer = tdx.NewIssuer(open, log.Named("tdx"))
	}
	restCfg, err := kubeclient.InClusterOrFile(o.kubeconfig)
	if err != nil {
		return d, err
	}
	if d.Client, err = kubeclient.Clientset(restCfg); err != nil {
		return d, err
	}
	if d.Dynamic, err = dynamic.NewForConfig(restCfg); err != nil {
		return d, fmt.Errorf("creating Kubernetes client: %w", err)
	}
	if d.Records, err = clientset.NewForConfig(restCfg); err != nil {
		return d, fmt.Errorf("creating the record API's client: %w", err)
	}
	if d.Replica == "" {
		if d.Replica, err = os.Hostname(); err != nil {
			return d, fmt.Errorf("naming this replica: %w", err)
		}
	}
	return d, nil
}

// tdxOpener returns the opener of the TD guest interface under root, after checking that one is there:
// without it this node cannot attest, and no node could join through it.
func tdxOpener(root string) (tdx.OpenFunc, error) {
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("--tdx-root %q: want an absolute path", root)
	}
	open := tdx.OpenAutoUnder(root)
	dev, err := open()
	if err != nil {
		return nil, fmt.Errorf("--attestation=tdx: %w", err)
	}
	if err := dev.Close(); err != nil {
		return nil, fmt.Errorf("--attestation=tdx: closing the TD guest interface: %w", err)
	}
	return open, nil
}
