// Package choose builds the metadata provider a daemon's configuration names, so that --metadata and
// its URLs mean the same in the bootstrapper and in the joinservice:
//
//	static  a file (--metadata-file)
//	mini    the API `berth mini up` serves to its namespace nodes (--metadata-url)
//	qemu    the same API served on the host for QEMU VMs by `berth metadata serve` (--metadata-url)
//	gcp     Compute Engine: metadata server (--metadata-url, default the well-known address) and Compute API (--metadata-api-url)
//	aws     EC2: IMDSv2 (--metadata-url, default the well-known address) and the EC2 API (--metadata-api-url, default the region's)
//	azure   Azure: IMDS (--metadata-url, default the well-known address) and Resource Manager (--metadata-api-url, https)
package choose

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/metadata/aws"
	"github.com/berth-k8s/berth/internal/metadata/azure"
	"github.com/berth-k8s/berth/internal/metadata/gcp"
	"github.com/berth-k8s/berth/internal/metadata/mini"
	"github.com/berth-k8s/berth/internal/metadata/static"
)

// Provider names.
const (
	Static = "static"
	Mini   = "mini"
	QEMU   = "qemu"
	GCP    = "gcp"
	AWS    = "aws"
	Azure  = "azure"
)

// Names lists the providers, for flag help and errors.
var Names = []string{Static, Mini, QEMU, GCP, AWS, Azure}

// Provider answers everything the daemons ask the platform.
type Provider interface {
	Self(ctx context.Context) (metadata.Instance, error)
	Peers(ctx context.Context) ([]metadata.Instance, error)
	ControlPlaneEndpoint(ctx context.Context) (string, error)
	InitSecretHash(ctx context.Context) ([]byte, error)
}

// Config names a provider and where it reads from.
type Config struct {
	// Name is one of Names.
	Name string
	// File is the metadata file of static.
	File string
	// URL is the metadata API of mini and qemu (required), or the instance metadata service of a cloud
	// (empty: the cloud's well-known address).
	URL string
	// APIURL is a cloud's compute API (empty: the cloud's own endpoint).
	APIURL string
	// HTTPClient, when set, carries the aws and azure providers' requests (tests: a fake's certificate).
	HTTPClient *http.Client
	// FS reads static's file; nil means the OS's.
	FS afero.Fs
}

// Validate reports what is missing or malformed in c, naming the flags.
func (c Config) Validate() error {
	switch c.Name {
	case Static:
		if c.File == "" {
			return fmt.Errorf("--metadata=%s needs --metadata-file", c.Name)
		}
	case Mini, QEMU:
		if c.URL == "" {
			return fmt.Errorf("--metadata=%s needs --metadata-url", c.Name)
		}
	case GCP, AWS, Azure:
	case "":
		return fmt.Errorf("--metadata is required (%s)", strings.Join(Names, ", "))
	default:
		return fmt.Errorf("--metadata %q: want one of %s", c.Name, strings.Join(Names, ", "))
	}
	for flag, v := range map[string]string{"--metadata-url": c.URL, "--metadata-api-url": c.APIURL} {
		if v == "" {
			continue
		}
		if u, err := url.Parse(v); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s %q: want http(s)://HOST[:PORT][/PATH]", flag, v)
		}
	}
	if c.APIURL != "" && (c.Name == Static || c.Name == Mini || c.Name == QEMU) {
		return fmt.Errorf("--metadata-api-url is for gcp, aws and azure, not %s", c.Name)
	}
	return nil
}

// New builds the provider c names. It makes no request yet.
func New(ctx context.Context, c Config) (Provider, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	switch c.Name {
	case Static:
		fs := c.FS
		if fs == nil {
			fs = afero.NewOsFs()
		}
		return static.New(fs, c.File), nil
	case Mini, QEMU:
		return mini.NewClient(c.URL), nil
	case GCP:
		cfg := gcp.Config{MetadataURL: c.URL, ComputeEndpoint: c.APIURL}
		if cfg.ComputeEndpoint != "" && !strings.HasSuffix(cfg.ComputeEndpoint, "/") {
			cfg.ComputeEndpoint += "/"
		}
		return gcp.New(ctx, cfg)
	case AWS:
		return aws.New(aws.Config{IMDSEndpoint: c.URL, EC2Endpoint: c.APIURL, HTTPClient: c.HTTPClient}), nil
	default: // Azure; Validate refused every other name
		return azure.New(azure.Config{IMDSURL: c.URL, ARMEndpoint: c.APIURL, HTTPClient: c.HTTPClient})
	}
}
