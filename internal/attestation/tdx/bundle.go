package tdx

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"
)

// MaxBundleSize bounds a collateral bundle. One platform family's collateral is about 20 KB in a bundle, and the
// bundle travels inside the cluster's attestation policy, a ConfigMap value (at most 1 MiB).
const MaxBundleSize = 1 << 20

// ErrBadCollateralBundle: a collateral bundle cannot be used (not JSON, another version, a malformed entry).
var ErrBadCollateralBundle = errors.New("bad TDX collateral bundle")

// CollateralBundle is collateral an operator ships with the attestation policy, for verifiers that must not or
// cannot reach a PCS: one set of collateral per platform family (PCK CA and FMSPC). It serves only what it holds,
// never fetches; the verifier still rejects collateral past its nextUpdate, so a bundle must be renewed before
// Intel's next update of it (TCB info and QE identity are reissued about monthly).
//
// The file is JSON, version 1:
//
//	{"version": 1, "collateral": [
//	  {"ca": "platform", "fmspc": "00806f050000", "collateral": {"pckCrl": "<base64>", ...}}]}
//
// where "collateral" has the fields of Collateral (base64 of the bytes as Intel serves them).
type CollateralBundle struct {
	entries map[CollateralRequest]*Collateral
}

// bundleVersion is the bundle format this package reads and writes.
const bundleVersion = 1

type bundleFile struct {
	Version    int           `json:"version"`
	Collateral []bundleEntry `json:"collateral"`
}

type bundleEntry struct {
	CA         string      `json:"ca"`
	FMSPC      string      `json:"fmspc"`
	Collateral *Collateral `json:"collateral"`
}

// ParseCollateralBundle decodes a bundle and checks that every entry names a PCK CA and an FMSPC and holds
// collateral that parses. Signatures and validity are the verifier's to check, per quote. Errors wrap
// ErrBadCollateralBundle.
func ParseCollateralBundle(data []byte) (*CollateralBundle, error) {
	if len(data) > MaxBundleSize {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrBadCollateralBundle, len(data), MaxBundleSize)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var f bundleFile
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("%w: decoding: %w", ErrBadCollateralBundle, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: data after the bundle", ErrBadCollateralBundle)
	}
	if f.Version != bundleVersion {
		return nil, fmt.Errorf("%w: version %d, want %d", ErrBadCollateralBundle, f.Version, bundleVersion)
	}
	if len(f.Collateral) == 0 {
		return nil, fmt.Errorf("%w: no collateral", ErrBadCollateralBundle)
	}
	b := &CollateralBundle{entries: map[CollateralRequest]*Collateral{}}
	for i, e := range f.Collateral {
		req := CollateralRequest{CA: e.CA, FMSPC: e.FMSPC}
		if err := checkRequest(req); err != nil {
			return nil, fmt.Errorf("%w: entry %d: %w", ErrBadCollateralBundle, i, err)
		}
		if _, dup := b.entries[req]; dup {
			return nil, fmt.Errorf("%w: entry %d: %s/%s listed twice", ErrBadCollateralBundle, i, req.CA, req.FMSPC)
		}
		if _, err := e.Collateral.parse(); err != nil {
			return nil, fmt.Errorf("%w: entry %d (%s/%s): %w", ErrBadCollateralBundle, i, req.CA, req.FMSPC, err)
		}
		b.entries[req] = e.Collateral
	}
	return b, nil
}

// MarshalCollateralBundle encodes collateral per platform family as a bundle, entries sorted by CA and FMSPC.
func MarshalCollateralBundle(collateral map[CollateralRequest]*Collateral) ([]byte, error) {
	reqs := slices.SortedFunc(maps.Keys(collateral), func(a, b CollateralRequest) int {
		return cmp.Or(cmp.Compare(a.CA, b.CA), cmp.Compare(a.FMSPC, b.FMSPC))
	})
	f := bundleFile{Version: bundleVersion}
	for _, req := range reqs {
		if err := checkRequest(req); err != nil {
			return nil, fmt.Errorf("encoding collateral bundle: %w", err)
		}
		if _, err := collateral[req].parse(); err != nil {
			return nil, fmt.Errorf("encoding collateral bundle: %s/%s: %w", req.CA, req.FMSPC, err)
		}
		f.Collateral = append(f.Collateral, bundleEntry{CA: req.CA, FMSPC: req.FMSPC, Collateral: collateral[req]})
	}
	out, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encoding collateral bundle: %w", err)
	}
	return out, nil
}

// GetCollateral implements CollateralGetter: the bundle's collateral for req, or an error wrapping
// ErrCollateralUnavailable when the bundle has none for that platform family.
func (b *CollateralBundle) GetCollateral(_ context.Context, req CollateralRequest) (*Collateral, error) {
	if col, ok := b.entries[req]; ok {
		return col, nil
	}
	return nil, fmt.Errorf("the collateral bundle has nothing for PCK CA %q, FMSPC %q: %w", req.CA, req.FMSPC, ErrCollateralUnavailable)
}

// NextUpdate returns the earliest nextUpdate over the bundle's collateral: from then on, quotes of at least one
// platform family fail until the bundle is renewed.
func (b *CollateralBundle) NextUpdate() time.Time {
	var earliest time.Time
	for _, col := range b.entries {
		p, err := col.parse() // parsed once already in ParseCollateralBundle
		if err != nil {
			continue
		}
		if t := p.nextUpdate(); earliest.IsZero() || t.Before(earliest) {
			earliest = t
		}
	}
	return earliest
}

// checkRequest checks that req names a PCK CA and a 12-digit lower-case hex FMSPC.
func checkRequest(req CollateralRequest) error {
	if req.CA != PCKCAPlatform && req.CA != PCKCAProcessor {
		return fmt.Errorf("PCK CA %q is neither %q nor %q", req.CA, PCKCAPlatform, PCKCAProcessor)
	}
	if !fmspcPattern.MatchString(req.FMSPC) {
		return fmt.Errorf("FMSPC %q is not 12 lower-case hex digits", req.FMSPC)
	}
	return nil
}
