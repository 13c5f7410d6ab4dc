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
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/bootstrapper/components"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/mini"
	"github.com/berth-k8s/berth/internal/metadata/static"
	"github.com/berth-k8s/berth/internal/version"
	"github.com/berth-k8s/berth/joinproto"
	"github.com/berth-k8s/berth/joinservice/ca"
	"github.com/berth-k8s/berth/joinservice/server"
	"github.com/berth-k8s/berth/joinservice/tokens"
)

type options struct {
	listen       string
	pkiDir       string
	kubeconfig   string
	namespace    string
	metadata     string
	metadataURL  string
	metadataFile string
	attestation  string
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	o := options{listen: ":30090", pkiDir: "/etc/kubernetes/pki", namespace: components.Namespace}
	cmd := &cobra.Command{
		Use:   "joinservice",
		Short: "Issue join tickets to nodes that may join the cluster",
		Long: `joinservice runs on the control-plane nodes and answers IssueJoinTicket and IssueRejoinTicket.
It reads the cluster's master secret and join configuration from the berth-system namespace, the
cluster CA from kubeadm's PKI directory, and which address belongs to which instance from the
platform's metadata. --metadata, --metadata-url, --metadata-file and --attestation default to
BERTH_METADATA, BERTH_METADATA_URL, BERTH_METADATA_FILE and BERTH_ATTESTATION.`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return run(cmd.Context(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.listen, "listen", o.listen, "address to serve on")
	f.StringVar(&o.pkiDir, "pki-dir", o.pkiDir, "kubeadm's PKI directory")
	f.StringVar(&o.kubeconfig, "kubeconfig", o.kubeconfig, "kubeconfig; empty means in-cluster")
	f.StringVar(&o.namespace, "namespace", o.namespace, "namespace of Berth's configuration")
	f.StringVar(&o.metadata, "metadata", envOr("BERTH_METADATA", ""), "metadata provider: static or mini")
	f.StringVar(&o.metadataURL, "metadata-url", envOr("BERTH_METADATA_URL", ""), "metadata API for --metadata=mini")
	f.StringVar(&o.metadataFile, "metadata-file", envOr("BERTH_METADATA_FILE", ""), "metadata file for --metadata=static")
	f.StringVar(&o.attestation, "attestation", envOr("BERTH_ATTESTATION", ""), "attestation variant; only insecure-none is wired so far")
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
	if o.attestation != "insecure-none" {
		return fmt.Errorf("--attestation %q: only insecure-none is wired so far, and it must be chosen explicitly", o.attestation)
	}
	log.Warn("attestation is disabled: tickets go to any node metadata knows, over plaintext gRPC; development only")
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
	keys, salt, err := loadKeys(ctx, client, o.namespace)
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
	srv := server.New(server.Config{
		APIServerEndpoint: cm.Data["apiServerEndpoint"],
		KubernetesVersion: cm.Data["kubernetesVersion"],
		PKIDir:            o.pkiDir,
	}, log.Named("joinservice"), keys, salt, authority, tokens.New(client), meta)

	lis, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listening: %w", err)
	}
	g := grpc.NewServer(grpc.Creds(insecure.NewCredentials()))
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
