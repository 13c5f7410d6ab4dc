// Package policy reads a cluster's attestation policy file and judges measurements against it.
//
// A policy is one YAML document:
//
//	apiVersion: config.berth.dev/v1alpha1  # with kind, the file's version; a file without both
//	kind: AttestationPolicy                # is the unversioned form, read with a warning
//	variant: tpm                  # which attestation variant a peer must use (tpm, tdx, ...)
//	measurements:
//	  4:                          # index: a TPM PCR, or for TDX 0 = MRTD and 1..4 = RTMR0..3
//	    expected: 3d45...         # hex; or anyOf: [hex, hex]; or nonZero: true
//	    mode: enforce             # enforce (default) or warn
//	    source: image 1.2 build   # free text: where the expected value came from
//	trustRoots:                   # CA certificates the variant roots its keys in (TPM: EK CAs,
//	  - file: ek-ca.pem           # TDX: Intel's SGX root, the default); files relative to the policy
//	  - pem: |
//	      -----BEGIN CERTIFICATE-----
//	akRoots:                      # TPM only, optional: CAs that certify attestation keys they saw
//	  - file: cluster-ak-ca.pem   # activated (vtpm.AKCA, a cluster's); a key they certified needs no
//	                              # activation in the handshake (file or pem, like trustRoots)
//	tpm:                          # TPM only, optional
//	  ekTrust: pinned             # how an EK is trusted: certificate (the default: its certificate
//	                              # chains to trustRoots) or pinned (its public area is listed below,
//	                              # with or without a certificate; for platforms that publish EK public
//	                              # keys and no EK CA, such as AWS NitroTPM). pinned takes no trustRoots.
//	  ekPublicSHA256:             # pinned: SHA-256 (hex) of each trusted EK's public area (TPMT_PUBLIC)
//	    - 9f86d081...
//	tdx:                          # TDX only, all optional
//	  collateralBundle:           # collateral the operator ships (tdx.ParseCollateralBundle); never fetched
//	    file: collateral.json     # relative to the policy; or json: | with the bundle inline
//	  collateralDir: collateral   # or: pre-fetched PCK CRL, TCB info, QE identity (relative to the policy)
//	  pcsURL: https://pccs:8081   # or: where to fetch collateral (Intel's PCS API v4); default Intel's PCS
//	  acceptedTCBStatuses: [UpToDate, SWHardeningNeeded]
//	  allowDebugTD: false
//
// A TDX verifier gets its collateral from exactly one source: the bundle, the directory, or a PCS (Intel's
// unless pcsURL names another, such as a caching service the operator runs). Only the PCS is ever reached
// over the network, and only when neither offline source is set.
//
// A TPM's EK is trusted either way tpm.ekTrust names, never both: by a certificate chaining to
// trustRoots, or by its pin. Either way the attestation key must still prove that it lives with that
// EK (credential activation in the handshake, or an akRoots certificate).
//
// Evaluate compares actual measurements with the expectations. An enforced deviation fails with a
// *MismatchError (errors.Is attestation.ErrMeasurementMismatch) that names every deviating index, the
// expected and actual values and where the expectation came from (the source text and file:line);
// a warn-only deviation becomes a warning string in the result, never silently dropped.
package policy

import (
	"bytes"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/pemcerts"
)

// MaxFileSize bounds the size of a policy file; larger inputs are rejected before parsing.
const MaxFileSize = 1 << 20

// maxIndex bounds measurement indices: TPM PCRs are 0..23, TDX indices 0..4.
const maxIndex = 63

// ErrInvalid is returned for a policy file that cannot be used.
var ErrInvalid = errors.New("invalid attestation policy")

// Mode says what a deviation from an expectation does.
type Mode int

const (
	// Enforce rejects the peer on a deviation.
	Enforce Mode = iota
	// Warn accepts the peer and reports the deviation as a warning.
	Warn
)

// String returns the mode's name as written in a policy file.
func (m Mode) String() string {
	if m == Warn {
		return "warn"
	}
	return "enforce"
}

// Expectation is what one measurement index must hold.
type Expectation struct {
	// Index is the measurement index.
	Index uint32
	// AnyOf lists the accepted values; empty when NonZero is set.
	AnyOf [][]byte
	// NonZero accepts any value that is not all zero bytes (for example a lock register that must be taken).
	NonZero bool
	// Mode is enforce or warn.
	Mode Mode
	// Source says where the expectation came from: the author's source text and the file position.
	Source string
}

// describe renders the expected value for messages.
func (e Expectation) describe() string {
	if e.NonZero {
		return "any non-zero value"
	}
	parts := make([]string, len(e.AnyOf))
	for i, v := range e.AnyOf {
		parts[i] = hex.EncodeToString(v)
	}
	if len(parts) == 1 {
		return parts[0]
	}
	return "one of [" + strings.Join(parts, ", ") + "]"
}

// matches reports whether actual satisfies the expectation.
func (e Expectation) matches(actual []byte) bool {
	if actual == nil {
		return false
	}
	if e.NonZero {
		return len(actual) > 0 && !bytes.Equal(actual, make([]byte, len(actual)))
	}
	for _, v := range e.AnyOf {
		if bytes.Equal(v, actual) {
			return true
		}
	}
	return false
}

// Policy is a parsed attestation policy.
type Policy struct {
	// Variant names the attestation variant a peer must use.
	Variant string
	// Expectations are sorted by index.
	Expectations []Expectation
	// TrustRoots are the CA certificates the variant roots attestation keys in.
	TrustRoots []*x509.Certificate
	// AKRoots are the CAs whose certificate for a TPM attestation key proves that the key lives with
	// the certified EK (it was activated when the CA certified it); empty: keys are activated in the
	// handshake.
	AKRoots []*x509.Certificate
	// Origin names where the policy was read from (a file path), for messages.
	Origin string
	// TDX holds the TDX variant's options; nil when the file has no tdx section.
	TDX *TDXOptions
	// TPM holds the TPM variant's options; nil when the file has no tpm section (EKs are then
	// trusted by their certificate).
	TPM *TPMOptions
	// Warnings say what the operator should change in the file (an unversioned file).
	Warnings []string
}

// The policy file's version.
const (
	// APIVersion is the apiVersion of a versioned policy file.
	APIVersion = "config.berth.dev/v1alpha1"
	// Kind is the kind of a versioned policy file.
	Kind = "AttestationPolicy"
)

// EK trust choices of TPMOptions.EKTrust.
const (
	// EKTrustCertificate trusts an EK whose certificate chains to the policy's trustRoots.
	EKTrustCertificate = "certificate"
	// EKTrustPinned trusts an EK whose public area's SHA-256 the policy lists, whatever certificate
	// the document carries (none, on platforms without an EK CA).
	EKTrustPinned = "pinned"
)

// TPMOptions are the TPM variant's options.
type TPMOptions struct {
	// EKTrust is EKTrustCertificate or EKTrustPinned.
	EKTrust string
	// EKPublicSHA256 are the pinned EKs: SHA-256 of each one's public area (TPMT_PUBLIC); set only
	// with EKTrustPinned.
	EKPublicSHA256 [][]byte
}

// PinsEK reports whether the options pin the EK whose public area has the SHA-256 digest.
func (o *TPMOptions) PinsEK(digest []byte) bool {
	if o == nil || o.EKTrust != EKTrustPinned {
		return false
	}
	for _, d := range o.EKPublicSHA256 {
		if bytes.Equal(d, digest) {
			return true
		}
	}
	return false
}

// fileTPM is the on-disk shape of the tpm section.
type fileTPM struct {
	EKTrust        string   `yaml:"ekTrust"`
	EKPublicSHA256 []string `yaml:"ekPublicSHA256"`
}

// load checks the tpm section.
func (f *fileTPM) load() (*TPMOptions, error) {
	o := &TPMOptions{EKTrust: f.EKTrust}
	switch f.EKTrust {
	case "", EKTrustCertificate:
		o.EKTrust = EKTrustCertificate
		if len(f.EKPublicSHA256) > 0 {
			return nil, errors.New("ekPublicSHA256 lists pinned EKs, which only ekTrust: pinned trusts; set it or remove the list")
		}
	case EKTrustPinned:
		if len(f.EKPublicSHA256) == 0 {
			return nil, errors.New("ekTrust: pinned needs at least one digest in ekPublicSHA256")
		}
	default:
		return nil, fmt.Errorf("ekTrust %q is neither %s nor %s", f.EKTrust, EKTrustCertificate, EKTrustPinned)
	}
	for i, h := range f.EKPublicSHA256 {
		d, err := hex.DecodeString(strings.TrimPrefix(h, "0x"))
		if err != nil || len(d) != 32 {
			return nil, fmt.Errorf("ekPublicSHA256[%d]: %q is not a hex SHA-256 digest", i, h)
		}
		o.EKPublicSHA256 = append(o.EKPublicSHA256, d)
	}
	return o, nil
}

// TDXOptions are the TDX variant's verification options.
type TDXOptions struct {
	// CollateralBundle names collateral the operator ships with the policy (a file or inline JSON). When set,
	// verification never fetches collateral.
	CollateralBundle *BundleSource `yaml:"collateralBundle"`
	// Bundle is the bundle's content, read at parse time from CollateralBundle.
	Bundle []byte `yaml:"-"`
	// CollateralDir holds pre-fetched collateral; relative paths are resolved against the policy file. When set,
	// verification never fetches collateral.
	CollateralDir string `yaml:"collateralDir"`
	// PCSURL is the base URL of the Intel PCS (API v4) compatible service collateral is fetched from when
	// neither CollateralBundle nor CollateralDir is set; empty means Intel's PCS. http is allowed for a caching
	// service on a trusted network: collateral is signed, so a party on the path cannot forge it, but it could
	// hold back newer collateral (a newer CRL) for as long as the older is current.
	PCSURL string `yaml:"pcsURL"`
	// AcceptedTCBStatuses lists the TCB statuses that pass (empty: only UpToDate).
	AcceptedTCBStatuses []string `yaml:"acceptedTCBStatuses"`
	// AllowDebugTD accepts debuggable TDs (development only).
	AllowDebugTD bool `yaml:"allowDebugTD"`
}

// BundleSource is where a TDX collateral bundle comes from: a file (relative to the policy) or inline JSON.
type BundleSource struct {
	File string `yaml:"file"`
	JSON string `yaml:"json"`
}

// Violation is one deviation from an expectation.
type Violation struct {
	Index    uint32
	Expected string
	Actual   string
	Mode     Mode
	Source   string
}

// String renders the violation for logs and the CLI.
func (v Violation) String() string {
	return fmt.Sprintf("index %d: expected %s, got %s (%s, from %s)", v.Index, v.Expected, v.Actual, v.Mode, v.Source)
}

// MismatchError lists the enforced deviations that rejected a peer.
type MismatchError struct {
	Violations []Violation
}

// Error names every deviating index with its expected and actual value.
func (e *MismatchError) Error() string {
	parts := make([]string, len(e.Violations))
	for i, v := range e.Violations {
		parts[i] = v.String()
	}
	return "measurement mismatch: " + strings.Join(parts, "; ")
}

// Unwrap lets callers test for attestation.ErrMeasurementMismatch.
func (e *MismatchError) Unwrap() error { return attestation.ErrMeasurementMismatch }

// Evaluate judges actual measurements. It returns the warn-only deviations as warnings, and a
// *MismatchError when any enforced expectation is not met. Indices without an expectation are ignored.
func (p *Policy) Evaluate(actual attestation.Measurements) (warnings []string, err error) {
	var enforced []Violation
	for _, e := range p.Expectations {
		got, ok := actual[e.Index]
		if ok && e.matches(got) {
			continue
		}
		v := Violation{Index: e.Index, Expected: e.describe(), Actual: "missing", Mode: e.Mode, Source: e.Source}
		if ok {
			v.Actual = hex.EncodeToString(got)
		}
		if e.Mode == Warn {
			warnings = append(warnings, v.String())
			continue
		}
		enforced = append(enforced, v)
	}
	if len(enforced) > 0 {
		return warnings, &MismatchError{Violations: enforced}
	}
	return warnings, nil
}

// Indices returns the measurement indices the policy has expectations for, sorted.
func (p *Policy) Indices() []uint32 {
	out := make([]uint32, len(p.Expectations))
	for i, e := range p.Expectations {
		out[i] = e.Index
	}
	return out
}

// CertPool returns the trust roots as a pool.
func (p *Policy) CertPool() *x509.CertPool {
	pool := x509.NewCertPool()
	for _, c := range p.TrustRoots {
		pool.AddCert(c)
	}
	return pool
}

// Load reads and parses the policy file at path; trust root files are resolved relative to its directory.
func Load(path string) (*Policy, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening policy: %w", err)
	}
	defer f.Close()
	data, err := readLimited(f)
	if err != nil {
		return nil, fmt.Errorf("reading policy %s: %w", path, err)
	}
	dir := filepath.Dir(path)
	p, err := Parse(data, path, func(name string) ([]byte, error) {
		if !filepath.IsAbs(name) {
			name = filepath.Join(dir, name)
		}
		return os.ReadFile(name)
	})
	if err != nil {
		return nil, err
	}
	if p.TDX != nil && p.TDX.CollateralDir != "" && !filepath.IsAbs(p.TDX.CollateralDir) {
		p.TDX.CollateralDir = filepath.Join(dir, p.TDX.CollateralDir)
	}
	return p, nil
}

// Parse parses policy bytes. origin names the input in messages and sources; readFile resolves
// `file:` trust roots and may be nil, in which case such entries are an error.
func Parse(data []byte, origin string, readFile func(name string) ([]byte, error)) (*Policy, error) {
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("%w: %s is larger than %d bytes", ErrInvalid, origin, MaxFileSize)
	}
	var doc fileDoc
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("%w: parsing %s: %w", ErrInvalid, origin, err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		return nil, fmt.Errorf("%w: %s holds more than one YAML document", ErrInvalid, origin)
	}
	var warnings []string
	switch {
	case doc.APIVersion == "" && doc.Kind == "":
		warnings = append(warnings, fmt.Sprintf("%s has no apiVersion and kind: read as the unversioned policy of earlier releases; add apiVersion: %s and kind: %s", origin, APIVersion, Kind))
	case doc.APIVersion != APIVersion:
		return nil, fmt.Errorf("%w: %s: apiVersion %q is not %s", ErrInvalid, origin, doc.APIVersion, APIVersion)
	case doc.Kind != Kind:
		return nil, fmt.Errorf("%w: %s: kind %q is not %s", ErrInvalid, origin, doc.Kind, Kind)
	}
	if doc.Variant == "" {
		return nil, fmt.Errorf("%w: %s: variant is required", ErrInvalid, origin)
	}
	p := &Policy{Variant: doc.Variant, Origin: origin, TDX: doc.TDX, Warnings: warnings}

	if doc.Measurements.Kind != 0 && doc.Measurements.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%w: %s:%d: measurements must be a mapping from index to expectation", ErrInvalid, origin, doc.Measurements.Line)
	}
	seen := map[uint32]bool{}
	for i := 0; i+1 < len(doc.Measurements.Content); i += 2 {
		key, val := doc.Measurements.Content[i], doc.Measurements.Content[i+1]
		e, err := parseExpectation(key, val, origin)
		if err != nil {
			return nil, err
		}
		if seen[e.Index] {
			return nil, fmt.Errorf("%w: %s:%d: index %d listed twice", ErrInvalid, origin, key.Line, e.Index)
		}
		seen[e.Index] = true
		p.Expectations = append(p.Expectations, e)
	}
	sort.Slice(p.Expectations, func(i, j int) bool { return p.Expectations[i].Index < p.Expectations[j].Index })

	for i, r := range doc.TrustRoots {
		certs, err := r.load(readFile)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: trustRoots[%d]: %w", ErrInvalid, origin, i, err)
		}
		p.TrustRoots = append(p.TrustRoots, certs...)
	}
	for i, r := range doc.AKRoots {
		certs, err := r.load(readFile)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: akRoots[%d]: %w", ErrInvalid, origin, i, err)
		}
		p.AKRoots = append(p.AKRoots, certs...)
	}
	if p.TDX != nil {
		if err := p.TDX.load(readFile); err != nil {
			return nil, fmt.Errorf("%w: %s: tdx: %w", ErrInvalid, origin, err)
		}
	}
	if doc.TPM != nil {
		if doc.Variant != "tpm" {
			return nil, fmt.Errorf("%w: %s: a tpm section in a policy for variant %q", ErrInvalid, origin, doc.Variant)
		}
		var err error
		if p.TPM, err = doc.TPM.load(); err != nil {
			return nil, fmt.Errorf("%w: %s: tpm: %w", ErrInvalid, origin, err)
		}
	}
	return p, nil
}

// EKTrust returns how the policy trusts TPM endorsement keys: EKTrustCertificate or EKTrustPinned.
func (p *Policy) EKTrust() string {
	if p.TPM == nil {
		return EKTrustCertificate
	}
	return p.TPM.EKTrust
}

// load checks that at most one collateral source is set and reads the bundle.
func (o *TDXOptions) load(readFile func(string) ([]byte, error)) error {
	sources := 0
	for _, set := range []bool{o.CollateralBundle != nil, o.CollateralDir != "", o.PCSURL != ""} {
		if set {
			sources++
		}
	}
	if sources > 1 {
		return errors.New("set one of collateralBundle, collateralDir and pcsURL")
	}
	if o.PCSURL != "" {
		u, err := url.Parse(o.PCSURL)
		if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			return fmt.Errorf("pcsURL %q is not an http(s) base URL", o.PCSURL)
		}
	}
	if o.CollateralBundle == nil {
		return nil
	}
	b := o.CollateralBundle
	switch {
	case b.File != "" && b.JSON != "":
		return errors.New("collateralBundle: set file or json, not both")
	case b.File != "":
		if readFile == nil {
			return errors.New("collateralBundle: file references are not allowed here")
		}
		data, err := readFile(b.File)
		if err != nil {
			return fmt.Errorf("collateralBundle: reading %s: %w", b.File, err)
		}
		if len(data) > MaxFileSize {
			return fmt.Errorf("collateralBundle: %s is larger than %d bytes", b.File, MaxFileSize)
		}
		o.Bundle = data
	case b.JSON != "":
		o.Bundle = []byte(b.JSON)
	default:
		return errors.New("collateralBundle: empty entry")
	}
	return nil
}

// fileDoc is the on-disk shape of a policy file.
type fileDoc struct {
	APIVersion   string      `yaml:"apiVersion"`
	Kind         string      `yaml:"kind"`
	Variant      string      `yaml:"variant"`
	Measurements yaml.Node   `yaml:"measurements"`
	TrustRoots   []trustRoot `yaml:"trustRoots"`
	AKRoots      []trustRoot `yaml:"akRoots"`
	TDX          *TDXOptions `yaml:"tdx"`
	TPM          *fileTPM    `yaml:"tpm"`
}

// fileExpectation is the on-disk shape of one measurement expectation.
type fileExpectation struct {
	Expected string   `yaml:"expected"`
	AnyOf    []string `yaml:"anyOf"`
	NonZero  bool     `yaml:"nonZero"`
	Mode     string   `yaml:"mode"`
	Source   string   `yaml:"source"`
}

func parseExpectation(key, val *yaml.Node, origin string) (Expectation, error) {
	pos := fmt.Sprintf("%s:%d", origin, key.Line)
	idx, err := strconv.ParseUint(key.Value, 10, 32)
	if key.Kind != yaml.ScalarNode || err != nil || idx > maxIndex {
		return Expectation{}, fmt.Errorf("%w: %s: measurement index %q is not a number in 0..%d", ErrInvalid, pos, key.Value, maxIndex)
	}
	var fe fileExpectation
	if err := decodeStrict(val, &fe); err != nil {
		return Expectation{}, fmt.Errorf("%w: %s: index %d: %w", ErrInvalid, pos, idx, err)
	}
	e := Expectation{Index: uint32(idx), NonZero: fe.NonZero, Source: pos}
	if fe.Source != "" {
		e.Source = fe.Source + " (" + pos + ")"
	}
	switch fe.Mode {
	case "", "enforce":
		e.Mode = Enforce
	case "warn":
		e.Mode = Warn
	default:
		return Expectation{}, fmt.Errorf("%w: %s: index %d: mode %q is neither enforce nor warn", ErrInvalid, pos, idx, fe.Mode)
	}
	values := fe.AnyOf
	if fe.Expected != "" {
		values = append([]string{fe.Expected}, values...)
	}
	if fe.NonZero == (len(values) > 0) {
		return Expectation{}, fmt.Errorf("%w: %s: index %d needs exactly one of expected/anyOf or nonZero", ErrInvalid, pos, idx)
	}
	for _, v := range values {
		b, err := hex.DecodeString(strings.TrimPrefix(v, "0x"))
		if err != nil || len(b) == 0 || len(b) > 64 {
			return Expectation{}, fmt.Errorf("%w: %s: index %d: %q is not a hex digest", ErrInvalid, pos, idx, v)
		}
		e.AnyOf = append(e.AnyOf, b)
	}
	return e, nil
}

// decodeStrict decodes a node into v, rejecting unknown fields.
func decodeStrict(n *yaml.Node, v any) error {
	out, err := yaml.Marshal(n)
	if err != nil {
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(out))
	dec.KnownFields(true)
	return dec.Decode(v)
}

// trustRoot is one entry of trustRoots: a PEM file or inline PEM.
type trustRoot struct {
	File string `yaml:"file"`
	PEM  string `yaml:"pem"`
}

func (r trustRoot) load(readFile func(string) ([]byte, error)) ([]*x509.Certificate, error) {
	data := []byte(r.PEM)
	switch {
	case r.File != "" && r.PEM != "":
		return nil, errors.New("set file or pem, not both")
	case r.File != "":
		if readFile == nil {
			return nil, errors.New("file references are not allowed here")
		}
		var err error
		if data, err = readFile(r.File); err != nil {
			return nil, fmt.Errorf("reading %s: %w", r.File, err)
		}
	case r.PEM == "":
		return nil, errors.New("empty entry")
	}
	return pemcerts.Parse(data)
}

func readLimited(r io.Reader) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxFileSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("larger than %d bytes", MaxFileSize)
	}
	return data, nil
}
