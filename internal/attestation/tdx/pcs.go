package tdx

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"
)

// DefaultPCSBaseURL is Intel's provisioning certification service.
const DefaultPCSBaseURL = "https://api.trustedservices.intel.com"

// maxPCSResponse bounds a collateral response; real ones are a few KiB.
const maxPCSResponse = 1 << 20

// PCSGetter fetches collateral from an Intel PCS compatible service (API version 4): the PCK CRL, TCB info and
// QE identity, with their issuer chains from the response headers. Put a CachingGetter in front of it: the
// verifier asks for collateral on every quote.
type PCSGetter struct {
	// BaseURL is the service's base URL; empty means DefaultPCSBaseURL.
	BaseURL string
	// RootCACRLURL, when set, is fetched for the root CA CRL (Intel lists it in the root certificate's CRL
	// distribution point).
	RootCACRLURL string
	// Client makes the requests; nil means a client with a 30 s timeout.
	Client *http.Client
}

// PCS response headers that carry issuer chains (URL-encoded PEM).
const (
	headerPCKCRLChain     = "SGX-PCK-CRL-Issuer-Chain"
	headerTCBInfoChain    = "TCB-Info-Issuer-Chain"
	headerQEIdentityChain = "SGX-Enclave-Identity-Issuer-Chain"
)

// GetCollateral implements CollateralGetter.
func (p *PCSGetter) GetCollateral(ctx context.Context, req CollateralRequest) (*Collateral, error) {
	base := p.BaseURL
	if base == "" {
		base = DefaultPCSBaseURL
	}
	col := &Collateral{}
	var err error
	q := url.Values{"ca": {req.CA}, "encoding": {"der"}}
	if col.PCKCRL, col.PCKCRLIssuerChain, err = p.fetch(ctx, base+"/sgx/certification/v4/pckcrl?"+q.Encode(), headerPCKCRLChain); err != nil {
		return nil, fmt.Errorf("fetching PCK CRL: %w", err)
	}
	q = url.Values{"fmspc": {req.FMSPC}}
	if col.TCBInfo, col.TCBInfoIssuerChain, err = p.fetch(ctx, base+"/tdx/certification/v4/tcb?"+q.Encode(), headerTCBInfoChain); err != nil {
		return nil, fmt.Errorf("fetching TCB info: %w", err)
	}
	if col.QEIdentity, col.QEIdentityIssuerChain, err = p.fetch(ctx, base+"/tdx/certification/v4/qe/identity", headerQEIdentityChain); err != nil {
		return nil, fmt.Errorf("fetching QE identity: %w", err)
	}
	if p.RootCACRLURL != "" {
		if col.RootCACRL, _, err = p.fetch(ctx, p.RootCACRLURL, ""); err != nil {
			return nil, fmt.Errorf("fetching root CA CRL: %w", err)
		}
	}
	return col, nil
}

// fetch GETs target and returns the body and, when chainHeader is set, the decoded issuer chain.
func (p *PCSGetter) fetch(ctx context.Context, target, chainHeader string) (body, chain []byte, err error) {
	client := p.Client
	if client == nil {
		client = &http.Client{Timeout: 30 * time.Second}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("creating request: %w", err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, nil, fmt.Errorf("sending request: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, nil, fmt.Errorf("unexpected status %s", resp.Status)
	}
	body, err = io.ReadAll(io.LimitReader(resp.Body, maxPCSResponse+1))
	if err != nil {
		return nil, nil, fmt.Errorf("reading response: %w", err)
	}
	if len(body) > maxPCSResponse {
		return nil, nil, fmt.Errorf("response exceeds %d bytes", maxPCSResponse)
	}
	if chainHeader == "" {
		return body, nil, nil
	}
	enc := resp.Header.Get(chainHeader)
	if enc == "" {
		return nil, nil, errors.New("response lacks header " + chainHeader)
	}
	dec, err := url.QueryUnescape(enc)
	if err != nil {
		return nil, nil, fmt.Errorf("decoding header %s: %w", chainHeader, err)
	}
	return body, []byte(dec), nil
}
