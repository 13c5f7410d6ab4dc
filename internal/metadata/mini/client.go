package mini

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/berth-k8s/berth/internal/metadata"
)

// ErrForbidden is returned when the server does not know the caller's address.
var ErrForbidden = errors.New("metadata server does not know this instance")

// Client reads the mini metadata API.
type Client struct {
	base string
	http *http.Client
}

// NewClient returns a client for the server at baseURL (e.g. "http://198.51.100.1:8080").
func NewClient(baseURL string) *Client {
	return &Client{
		base: strings.TrimRight(baseURL, "/"),
		http: &http.Client{Timeout: 5 * time.Second},
	}
}

func (c *Client) get(ctx context.Context, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+path, nil)
	if err != nil {
		return fmt.Errorf("building metadata request: %w", err)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("querying metadata %s: %w", path, err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		return fmt.Errorf("querying metadata %s: %w", path, metadata.ErrNotFound)
	case http.StatusForbidden:
		return fmt.Errorf("querying metadata %s: %w", path, ErrForbidden)
	default:
		return fmt.Errorf("querying metadata %s: HTTP %d", path, resp.StatusCode)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(out); err != nil {
		return fmt.Errorf("decoding metadata %s: %w", path, err)
	}
	return nil
}

// Self returns the calling instance.
func (c *Client) Self(ctx context.Context) (metadata.Instance, error) {
	var inst metadata.Instance
	if err := c.get(ctx, PathSelf, &inst); err != nil {
		return metadata.Instance{}, err
	}
	if err := inst.Validate(); err != nil {
		return metadata.Instance{}, fmt.Errorf("metadata self: %w", err)
	}
	return inst, nil
}

// Peers returns every instance of the cluster.
func (c *Client) Peers(ctx context.Context) ([]metadata.Instance, error) {
	var peers []metadata.Instance
	if err := c.get(ctx, PathPeers, &peers); err != nil {
		return nil, err
	}
	return peers, nil
}

// ControlPlaneEndpoint returns HOST:PORT of the API server, or an error wrapping ErrNotFound.
func (c *Client) ControlPlaneEndpoint(ctx context.Context) (string, error) {
	var r endpointResponse
	if err := c.get(ctx, PathControlPlaneEndpoint, &r); err != nil {
		return "", err
	}
	return r.Endpoint, nil
}

// InitSecretHash returns the SHA-256 of the init secret.
func (c *Client) InitSecretHash(ctx context.Context) ([]byte, error) {
	var r hashResponse
	if err := c.get(ctx, PathInitSecretHash, &r); err != nil {
		return nil, err
	}
	h, err := hex.DecodeString(r.SHA256)
	if err != nil || len(h) != 32 {
		return nil, errors.New("metadata init secret hash is not 64 hex digits")
	}
	return h, nil
}
