package cli

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/metadata"
	metamini "github.com/berth-k8s/berth/internal/metadata/mini"
	"github.com/berth-k8s/berth/internal/serve"
)

// ClusterFile is the file `berth metadata serve` reads: every VM of the cluster with its addresses
// as the host sees them, and what the platform publishes for them.
type ClusterFile struct {
	Instances            []metadata.Instance `json:"instances"`
	ControlPlaneEndpoint string              `json:"controlPlaneEndpoint,omitempty"`
	// InitSecretHash is the hex SHA-256 of the init secret.
	InitSecretHash string `json:"initSecretHash,omitempty"`
}

// metadataShutdownGrace bounds how long serve waits for open requests when it stops.
const metadataShutdownGrace = 5 * time.Second

func newMetadataCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "metadata",
		Short:   "Serve instance metadata to self-hosted VMs",
		Example: `  berth metadata serve --file cluster.yaml --listen 198.51.100.1:8080`,
		Args:    cobra.NoArgs,
		RunE:    groupHelp,
	}
	cmd.AddCommand(newMetadataServeCmd())
	return cmd
}

func loadClusterFile(path string) (*metamini.Server, ClusterFile, error) {
	var f ClusterFile
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, f, fmt.Errorf("reading cluster file: %w", err)
	}
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, f, fmt.Errorf("parsing cluster file %s: %w", path, err)
	}
	if len(f.Instances) == 0 {
		return nil, f, fmt.Errorf("cluster file %s lists no instances", path)
	}
	for _, in := range f.Instances {
		if err := in.Validate(); err != nil {
			return nil, f, fmt.Errorf("cluster file %s: %w", path, err)
		}
	}
	srv := metamini.NewServer()
	srv.SetInstances(f.Instances)
	if f.ControlPlaneEndpoint != "" {
		ep, err := metadata.CheckEndpoint(f.ControlPlaneEndpoint)
		if err != nil {
			return nil, f, fmt.Errorf("cluster file %s: %w", path, err)
		}
		srv.SetControlPlaneEndpoint(ep)
	}
	if f.InitSecretHash != "" {
		h, err := metadata.ParseInitSecretHash(f.InitSecretHash)
		if err != nil {
			return nil, f, fmt.Errorf("cluster file %s: %w", path, err)
		}
		srv.SetInitSecretHash(h)
	}
	return srv, f, nil
}

func newMetadataServeCmd() *cobra.Command {
	var file, listen string
	cmd := &cobra.Command{
		Use:   "serve --file FILE --listen ADDR",
		Short: "Serve the metadata API of --metadata=qemu to VMs on this host",
		Long: `berth metadata serve is the host-side metadata service of self-hosted VMs (QEMU, libvirt):
it serves the API the bootstrapper and the joinservice read with --metadata=qemu (the same API
'berth mini up' serves its namespace nodes) and tells each caller who it is by its source address,
as a cloud's metadata service does. A caller whose address is none of the file's instances gets 403.

The file (YAML or JSON) lists every VM with the addresses the host sees it with, and optionally the
control-plane endpoint and the hex SHA-256 of the init secret:

  instances:
    - {name: cp-0, role: control-plane, ips: [198.51.100.10]}
    - {name: w-0, role: worker, ips: [198.51.100.20]}
  controlPlaneEndpoint: 198.51.100.10:6443
  initSecretHash: 9f86d0...

The VMs need addresses of their own on the host (a bridge or tap network); behind QEMU's user
network every guest reaches the host from one address. Boot them with
berth.metadata=qemu berth.metadata_url=http://ADDR on the kernel command line. The file is read
once at the start; serve runs until interrupted.`,
		Example: `  berth metadata serve --file cluster.yaml --listen 198.51.100.1:8080`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" || listen == "" {
				return usageErr("metadata serve needs --file and --listen")
			}
			srv, f, err := loadClusterFile(file)
			if err != nil {
				return &exitError{code: exitUsage, err: err}
			}
			var lc net.ListenConfig
			lis, err := lc.Listen(cmd.Context(), "tcp", listen)
			if err != nil {
				return fmt.Errorf("listening on %s: %w", listen, err)
			}
			_, _ = fmt.Fprintf(cmd.ErrOrStderr(), "serving metadata for %d instances on http://%s\n", len(f.Instances), lis.Addr())
			return serveMetadata(cmd.Context(), lis, srv)
		},
	}
	f := cmd.Flags()
	f.StringVar(&file, "file", "", "cluster file (YAML or JSON): instances, controlPlaneEndpoint, initSecretHash")
	f.StringVar(&listen, "listen", "", "address to serve on (HOST:PORT, reachable from the VMs)")
	return cmd
}

// serveMetadata serves h on lis until ctx ends; open requests get metadataShutdownGrace to finish.
func serveMetadata(ctx context.Context, lis net.Listener, h http.Handler) error {
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	if err := serve.HTTP(ctx, hs, lis, metadataShutdownGrace); err != nil {
		return fmt.Errorf("serving metadata: %w", err)
	}
	return nil
}
