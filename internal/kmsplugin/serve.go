package kmsplugin

import (
	"context"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	kmsapi "k8s.io/kms/apis/v2"
	kmsservice "k8s.io/kms/pkg/service"

	"github.com/berth-k8s/berth/internal/serve"
)

// DefaultSocket is where a control plane's plugin listens and its API server connects (the API
// server's static pod mounts the directory).
const DefaultSocket = "/run/berth/kms/kms.sock"

// ProviderName is the name of the KMS provider in the API server's EncryptionConfiguration. It is
// part of every stored value's prefix ("k8s:enc:kms:v2:berth:"), so it never changes.
const ProviderName = "berth"

// StoragePrefix starts every value the API server stores encrypted through this plugin.
const StoragePrefix = "k8s:enc:kms:v2:" + ProviderName + ":"

// shutdownGrace bounds how long Serve waits for calls in flight when ctx ends.
const shutdownGrace = 5 * time.Second

// connectionTimeout bounds a client's connection setup.
const connectionTimeout = 10 * time.Second

// Listen creates the socket at path for Serve: its directory owner-only (0700), a socket left over by
// an earlier run removed, the socket itself 0600. Only root (the API server runs as root on a
// control plane) can connect.
func Listen(ctx context.Context, path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("creating the socket's directory: %w", err)
	}
	if err := os.Chmod(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("restricting the socket's directory: %w", err)
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket: not removing it", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing the old socket: %w", err)
		}
	}
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		lis.Close()
		return nil, fmt.Errorf("restricting the socket: %w", err)
	}
	return lis, nil
}

// Serve answers the KMS v2 API for svc on lis until ctx ends, then stops (calls in flight get
// shutdownGrace to finish) and closes lis. It returns nil when ctx ended.
func Serve(ctx context.Context, lis net.Listener, svc kmsservice.Service) error {
	gs := grpc.NewServer(grpc.ConnectionTimeout(connectionTimeout))
	kmsapi.RegisterKeyManagementServiceServer(gs, kmsservice.NewGRPCService(lis.Addr().String(), connectionTimeout, svc))
	if err := serve.GRPC(ctx, gs, lis, shutdownGrace); err != nil {
		return fmt.Errorf("serving the KMS API: %w", err)
	}
	return nil
}

// Client is a connection to a plugin's socket, as the API server has one: the keeper asks it for the
// plugin's status.
type Client struct {
	conn *grpc.ClientConn
	api  kmsapi.KeyManagementServiceClient
}

// NewClient connects lazily to the plugin at socket path.
func NewClient(path string) (*Client, error) {
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("connecting to the KMS plugin: %w", err)
	}
	return &Client{conn: conn, api: kmsapi.NewKeyManagementServiceClient(conn)}, nil
}

// Status calls the plugin's Status.
func (c *Client) Status(ctx context.Context) (*kmsapi.StatusResponse, error) {
	return c.api.Status(ctx, &kmsapi.StatusRequest{})
}

// Encrypt calls the plugin's Encrypt.
func (c *Client) Encrypt(ctx context.Context, plain []byte) (*kmsapi.EncryptResponse, error) {
	return c.api.Encrypt(ctx, &kmsapi.EncryptRequest{Plaintext: plain, Uid: "berth"})
}

// Decrypt calls the plugin's Decrypt.
func (c *Client) Decrypt(ctx context.Context, ciphertext []byte, keyID string) ([]byte, error) {
	resp, err := c.api.Decrypt(ctx, &kmsapi.DecryptRequest{Ciphertext: ciphertext, KeyId: keyID, Uid: "berth"})
	if err != nil {
		return nil, err
	}
	return resp.GetPlaintext(), nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }
