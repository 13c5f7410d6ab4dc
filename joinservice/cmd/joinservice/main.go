// Command joinservice runs on every control-plane node (DaemonSet berth-joinservice, host network)
// and issues join tickets to nodes that may join the cluster.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/afero"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/bootstrapper/components"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/mini"
	"github.com/berth-k8s/berth/internal/metadata/static"
	"github.com/berth-k8s/berth/internal/version"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/cplease"
	"github.com/berth-k8s/berth/joinservice/ledger"
	"github.com/berth-k8s/berth/joinservice/metrics"
	"github.com/berth-k8s/berth/joinservice/policywatch"
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
	attestation  string
	tpm          string
	replica      string
	limits       atls.Limits
	attestLimits atls.Limits
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	o := options{listen: ":30090", metricsAddr: ":30091", pkiDir: "/etc/kubernetes/pki", namespace: components.Namespace, limits: server.DefaultLimits, attestLimits: atls.DefaultLimits}
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

Every attempt goes to the join ledger (ConfigMap berth-join-ledger and Events on it; berth status
prints it). Calls are rate-limited per peer address and overall (--rate-*), and so are attested
handshakes, each of which costs this node's TPM a quote (--attest-rate-*); control-plane joins are
serialized across replicas with Lease berth-control-plane-join. Prometheus metrics and /healthz are
served on --metrics-listen.

--metadata, --metadata-url, --metadata-file, --attestation and --tpm default to BERTH_METADATA,
BERTH_METADATA_URL, BERTH_METADATA_FILE, BERTH_ATTESTATION and BERTH_TPM.`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd.Context(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.listen, "listen", o.listen, "address to serve on")
	f.StringVar(&o.metricsAddr, "metrics-listen", o.metricsAddr, "address to serve Prometheus metrics (/metrics) and /healthz on; empty disables")
	f.StringVar(&o.pkiDir, "pki-dir", o.pkiDir, "kubeadm's PKI directory")
	f.StringVar(&o.kubeconfig, "kubeconfig", o.kubeconfig, "kubeconfig; empty means in-cluster")
	f.StringVar(&o.namespace, "namespace", o.namespace, "namespace of Berth's configuration")
	f.StringVar(&o.metadata, "metadata", envOr("BERTH_METADATA", ""), "metadata provider: static or mini")
	f.StringVar(&o.metadataURL, "metadata-url", envOr("BERTH_METADATA_URL", ""), "metadata API for --metadata=mini")
	f.StringVar(&o.metadataFile, "metadata-file", envOr("BERTH_METADATA_FILE", ""), "metadata file for --metadata=static")
	f.StringVar(&o.attestation, "attestation", envOr("BERTH_ATTESTATION", ""), "attestation variant: tpm, tdx, or insecure-none (development only)")
	f.StringVar(&o.tpm, "tpm", envOr("BERTH_TPM", ""), "TPM of this node for --attestation=tpm (device path, tcp:HOST:PORT or unix:PATH)")
	f.StringVar(&o.replica, "replica", envOr("NODE_NAME", ""), "name of this replica in the join ledger and the control-plane Lease (default: NODE_NAME, else the host name)")
	f.Float64Var((*float64)(&o.limits.PerPeer), "rate-per-peer", float64(o.limits.PerPeer), "join tickets per second per peer address")
	f.IntVar(&o.limits.PerPeerBurst, "rate-per-peer-burst", o.limits.PerPeerBurst, "burst of --rate-per-peer")
	f.Float64Var((*float64)(&o.limits.Global), "rate-global", float64(o.limits.Global), "join tickets per second over all peers")
	f.IntVar(&o.limits.GlobalBurst, "rate-global-burst", o.limits.GlobalBurst, "burst of --rate-global")
	f.Float64Var((*float64)(&o.attestLimits.PerPeer), "attest-rate-per-peer", float64(o.attestLimits.PerPeer), "attested handshakes and identity probes per second per peer address (a join makes one of each; a handshake costs this node's TPM a quote)")
	f.IntVar(&o.attestLimits.PerPeerBurst, "attest-rate-per-peer-burst", o.attestLimits.PerPeerBurst, "burst of --attest-rate-per-peer")
	f.Float64Var((*float64)(&o.attestLimits.Global), "attest-rate-global", float64(o.attestLimits.Global), "attested handshakes and identity probes per second over all peers (two per join); size it to this node's TPM")
	f.IntVar(&o.attestLimits.GlobalBurst, "attest-rate-global-burst", o.attestLimits.GlobalBurst, "burst of --attest-rate-global")
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

func run(ctx context.Context, o options) error {
	log, err := zap.NewProduction()
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	switch o.attestation {
	case "insecure-none", "tpm", "tdx":
	default:
		return fmt.Errorf("--attestation %q: want tpm, tdx, or insecure-none", o.attestation)
	}
	var meta interface {
		Peers(ctx context.Context) ([]metadata.Instance, error)
	}
	switch o.metadata {
	case "mini":
		meta = mini.NewClient(o.metadataURL)
	case "static":
		meta = static.New(afero.NewOsFs(), o.metadataFile)
	default:
		return fmt.Errorf("--metadata %q: want static or mini", o.metadata)
	}
	restCfg, err := restConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("creating Kubernetes client: %w", err)
	}
	keys, salt, err := loadKeysPatiently(ctx, client, o.namespace, startupPatience, log)
	if err != nil {
		return err
	}
	cm, err := client.CoreV1().ConfigMaps(o.namespace).Get(ctx, components.JoinConfigName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading join configuration: %w", err)
	}
	authority, err := ca.Load(o.pkiDir)
	if err != nil {
		return err
	}
	if o.replica == "" {
		if o.replica, err = os.Hostname(); err != nil {
			return fmt.Errorf("naming this replica: %w", err)
		}
	}
	journal := ledger.NewWriter(client, o.namespace, o.replica, log.Named("ledger"))
	m := metrics.New(journal)
	creds, holder, err := attestationFor(o, cm.Data[policywatch.PolicyKey], journal, m, log)
	if err != nil {
		return err
	}
	var check server.AttestationCheck
	if holder != nil {
		check = holder.Check
	}
	if holder != nil {
		creds = server.RecordHandshakes(creds, journal, m)
	}
	srv := server.New(server.Config{
		APIServerEndpoint: cm.Data["apiServerEndpoint"],
		KubernetesVersion: cm.Data["kubernetesVersion"],
		PKIDir:            o.pkiDir,
	}, log.Named("joinservice"), keys, salt, authority, meta, check,
		server.WithJournal(journal), server.WithLimits(o.limits), server.WithObserver(m),
		server.WithControlPlaneLock(cplease.New(client, o.namespace, o.replica, log.Named("lease"))))

	// The ledger writer outlives the gRPC server by its final flush: it stops after GracefulStop.
	ledgerCtx, stopLedger := context.WithCancel(context.WithoutCancel(ctx))
	ledgerDone := make(chan struct{})
	go func() { defer close(ledgerDone); _ = journal.Run(ledgerCtx) }()
	defer func() { stopLedger(); <-ledgerDone }()

	if holder != nil {
		w := policywatch.NewWatcher(client, o.namespace, components.JoinConfigName, o.replica, holder, m, log.Named("policy"))
		watchCtx, stopWatch := context.WithCancel(ctx)
		watchDone := make(chan struct{})
		go func() { defer close(watchDone); _ = w.Run(watchCtx) }()
		defer func() { stopWatch(); <-watchDone }()
	}

	if o.metricsAddr != "" {
		mlis, err := net.Listen("tcp", o.metricsAddr)
		if err != nil {
			return fmt.Errorf("listening for metrics: %w", err)
		}
		metricsCtx, stopMetrics := context.WithCancel(ctx)
		metricsDone := make(chan struct{})
		go func() {
			defer close(metricsDone)
			if err := m.Serve(metricsCtx, mlis, log.Named("metrics")); err != nil {
				log.Error("metrics server stopped", zap.Error(err))
			}
		}()
		defer func() { stopMetrics(); <-metricsDone }()
	}

	lis, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listening: %w", err)
	}
	g := grpc.NewServer(append(server.GRPCServerOptions(), grpc.Creds(creds))...)
	joinproto.RegisterJoinServiceServer(g, srv)
	errc := make(chan error, 1)
	go func() { errc <- g.Serve(lis) }()
	log.Info("joinservice serving", zap.String("address", lis.Addr().String()), zap.String("version", version.Version))
	select {
	case err := <-errc:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		g.Stop()
	}
	<-errc
	return nil
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("loading in-cluster config: %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading kubeconfig: %w", err)
	}
	return cfg, nil
}

// startupPatience is how long the joinservice keeps trying to reach the API server at start. Right
// after init its host-network pod can start before kube-proxy has programmed the API server's
// Service address; exiting would cost a kubelet restart back-off (10 s and more) on the first joins.
const startupPatience = 2 * time.Minute

// loadKeysPatiently retries loadKeys with a capped backoff until it succeeds or patience runs out,
// logging each new reason once.
func loadKeysPatiently(ctx context.Context, client kubernetes.Interface, ns string, patience time.Duration, log *zap.Logger) (*clusterkeys.Keys, []byte, error) {
	ctx, cancel := context.WithTimeout(ctx, patience)
	defer cancel()
	wait, last := 200*time.Millisecond, ""
	for {
		keys, salt, err := loadKeys(ctx, client, ns)
		if err == nil {
			return keys, salt, nil
		}
		if msg := err.Error(); msg != last {
			log.Warn("waiting for the cluster secrets", zap.Error(err))
			last = msg
		}
		select {
		case <-ctx.Done():
			return nil, nil, err
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

func loadKeys(ctx context.Context, client kubernetes.Interface, ns string) (*clusterkeys.Keys, []byte, error) {
	sec, err := client.CoreV1().Secrets(ns).Get(ctx, components.SecretName, metav1.GetOptions{})
	if err != nil {
		return nil, nil, fmt.Errorf("reading cluster secrets: %w", err)
	}
	master, salt := sec.Data["masterSecret"], sec.Data["salt"]
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster secrets: %w", err)
	}
	return keys, salt, nil
}

// attestationFor builds the server's transport credentials and the hot-reloadable policy from the
// cluster's attestation policy (self-contained YAML from the join config). The holder is nil without
// attestation.
func attestationFor(o options, policyYAML string, journal server.HandshakeJournal, obs server.Observer, log *zap.Logger) (credentials.TransportCredentials, *policywatch.Holder, error) {
	if o.attestation == "insecure-none" {
		log.Warn("attestation is disabled: tickets go to any node metadata knows, over plaintext gRPC; development only")
		return insecure.NewCredentials(), nil, nil
	}
	holder, err := policywatch.NewHolder(o.attestation, "ConfigMap "+components.Namespace+"/"+components.JoinConfigName, policyYAML,
		func(p *policy.Policy) (atls.Validator, error) {
			return server.NewHandshakeValidator(p, log.Named("validator"))
		})
	if err != nil {
		return nil, nil, fmt.Errorf("cluster attestation policy: %w", err)
	}
	var issuer atls.Issuer
	switch o.attestation {
	case "tpm":
		open, err := vtpm.OpenerFromSpec(o.tpm)
		if err != nil {
			return nil, nil, fmt.Errorf("--tpm: %w", err)
		}
		issuer = vtpm.NewIssuer(open, log.Named("tpm"))
	case "tdx":
		issuer = tdx.NewIssuer(tdx.OpenAuto(), log.Named("tdx"))
	}
	creds, err := atls.NewCredentials(issuer, holder.Validator(), atls.WithLimiter(atls.NewLimiter(o.attestLimits)),
		atls.WithClaimCheck(server.ClaimCheck(holder.Policy, journal, obs)), atls.WithLogger(log.Named("atls")))
	if err != nil {
		return nil, nil, fmt.Errorf("creating attested TLS credentials: %w", err)
	}
	return creds, holder, nil
}
