package tdx

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/edgelesssys/go-tdx-qpl/blobs"
)

// fakePCS serves the sample collateral the way Intel's PCS v4 does, on loopback.
func fakePCS(t *testing.T) (*httptest.Server, *[]string) {
	t.Helper()
	col := sampleCollateral()
	var paths []string
	mux := http.NewServeMux()
	chain := func(w http.ResponseWriter, name string, pemChain []byte) {
		// PCS percent-encodes the PEM chain, including spaces.
		w.Header().Set(name, strings.ReplaceAll(url.QueryEscape(string(pemChain)), "+", "%20"))
	}
	mux.HandleFunc("GET /sgx/certification/v4/pckcrl", func(w http.ResponseWriter, r *http.Request) {
		paths = append(paths, r.URL.String())
		if r.URL.Query().Get("ca") != PCKCAPlatform || r.URL.Query().Get("encoding") != "der" {
			http.Error(w, "bad query", http.StatusBadRequest)
			return
		}
		chain(w, headerPCKCRLChain, col.PCKCRLIssuerChain)
		_, _ = w.Write(col.PCKCRL)
	})
	mux.HandleFunc("GET /tdx/certification/v4/tcb", func(w http.ResponseWriter, r *http.Request) {
		paths = append(paths, r.URL.String())
		if r.URL.Query().Get("fmspc") != "00806f050000" {
			http.NotFound(w, r)
			return
		}
		chain(w, headerTCBInfoChain, col.TCBInfoIssuerChain)
		_, _ = w.Write(col.TCBInfo)
	})
	mux.HandleFunc("GET /tdx/certification/v4/qe/identity", func(w http.ResponseWriter, r *http.Request) {
		paths = append(paths, r.URL.String())
		chain(w, headerQEIdentityChain, col.QEIdentityIssuerChain)
		_, _ = w.Write(col.QEIdentity)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, &paths
}

func TestPCSGetter(t *testing.T) {
	srv, paths := fakePCS(t)
	ctx := context.Background()
	pcs := &PCSGetter{BaseURL: srv.URL, Client: srv.Client()}

	// Through a cache, a quote verifies with collateral fetched once.
	cache := NewCachingGetter(CachingGetterConfig{Upstream: pcs, Dir: t.TempDir(), Now: func() time.Time { return sampleNow }})
	v, err := NewVerifier(VerifierConfig{Roots: IntelSGXRootCA(), Collateral: cache, Now: func() time.Time { return sampleNow }})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := v.VerifyQuote(ctx, blobs.TDXQuote()); err != nil {
			t.Fatalf("VerifyQuote() with PCS collateral = %v", err)
		}
	}
	if len(*paths) != 3 {
		t.Errorf("PCS requests = %q, want 3 (one per kind of collateral)", *paths)
	}

	if _, err := pcs.GetCollateral(ctx, CollateralRequest{CA: PCKCAPlatform, FMSPC: "000000000000"}); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("GetCollateral(unknown FMSPC) = %v, want a 404 error", err)
	}
	if _, err := pcs.GetCollateral(ctx, CollateralRequest{CA: PCKCAProcessor, FMSPC: "00806f050000"}); err == nil {
		t.Error("GetCollateral(bad query) = nil error")
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := pcs.GetCollateral(cancelled, sampleRequest); err == nil {
		t.Error("GetCollateral(cancelled) = nil error")
	}
}
