// Package tdx is Berth's Intel TDX attestation variant ("tdx"): quotes and RTMR extends on the guest, offline
// quote verification on the verifier, and the RTMR-backed node lock register.
//
// # Guest side
//
// A Device produces quotes, extends RTMRs and reads measurements. Two backends exist, chosen by OpenAuto:
//
//   - configfs-tsm (mainline kernels from 6.7): a report directory under /sys/kernel/config/tsm/report, the
//     report data written to inblob, the quote read from outblob, with the generation counter checked for
//     concurrent writers. RTMR extend and MR reads go through /sys/class/misc/tdx_guest/measurements
//     (kernels from 6.16); without those files, measurements come from a quote and RTMR extend fails.
//   - the legacy /dev/tdx-guest ioctl ABI of the pre-upstream driver, through github.com/edgelesssys/go-tdx-qpl's
//     device functions (quote through the quote generation service envelope, RTMR extend, TD report). That
//     extend ioctl carries no register index, so the backend reads the registers around it and fails unless the
//     requested RTMR took the event. go-tdx-qpl is AGPL-3.0, so this backend is built
//     only with the build tag berth_qpl; without it OpenAuto uses configfs-tsm alone. Only a TDX image's
//     bootstrapper is built with the tag; the joinservice and the CLI are not (see README.md). The mainline
//     /dev/tdx_guest device gives TD reports, not quotes, and is not used.
//
// OpenAutoUnder looks for both below another root, for a container that has them mounted elsewhere (the
// joinservice's --tdx-root) and for tests.
//
// Issuer.Issue binds user data and the verifier's nonce into the quote's REPORTDATA (see ReportData) and wraps
// the quote in a versioned document (see Document); it logs each quote's generation time (debug, quoteDuration),
// a phase of every handshake that on configfs-tsm depends on the host's quoting service and the kernel's polling. LockRegister extends the cluster ID into an RTMR.
//
// # Verifier side
//
// Verification runs offline. go-tdx-qpl's verifier always fetches collateral from Intel's service and keeps its
// client unexported, so it cannot be used. github.com/google/go-tdx-guest's verify package could run offline
// today: it takes trusted roots, the verification time (a TimeSet) and an injected getter, with a context when
// the getter implements its ContextHTTPSGetter. Berth keeps its own verifier all the same, because replacing it
// would lose checks and behaviour Berth needs:
//
//   - go-tdx-guest checks revocation only with both CRLs, the root CA CRL fetched from the root certificate's
//     distribution point; without it the PCK CRL goes unchecked too. Berth always checks the PCK CRL and the
//     root CA CRL where the collateral has one (it is optional in Collateral and in a bundle);
//   - it accepts only the TCB status UpToDate; Berth's policy may accept others as warnings
//     (acceptedTCBStatuses);
//   - its getter is keyed by Intel's PCS URLs with the issuer chains in HTTP headers, so Berth's collateral
//     sources (a bundle, a directory, another PCS) would have to be served as made-up HTTP responses;
//   - most of its failures are formatted strings, which cannot be mapped onto the named errors the join
//     ledger's reasons come from;
//   - Berth refuses three things it accepts: bytes after the quote's signature data, collateral used before
//     its issue time, and a PCK CRL whose named issuer chain is not the CRL's issuer.
//
// TestDifferentialGoTDXGuest holds the two verifiers to the same verdict on recorded quotes (go-tdx-qpl's and
// go-tdx-guest's samples) and the software TD, and on every tampered variant of them;
// TestDifferentialKnownDifferences pins the three differences above. This package therefore parses the quote
// itself and checks it with crypto/x509 and crypto/ecdsa:
//
//  1. the PCK certificate chain from the quote up to the configured roots (IntelSGXRootCA by default);
//  2. collateral from a CollateralGetter: the PCK CRL (signed by the PCK certificate's issuer, current, not
//     listing the PCK certificate), optionally the root CA CRL, TCB info and QE identity (each signed by a
//     certificate chaining to the roots, over the exact JSON text, and current);
//  3. the QE report signature by the PCK key, and the QE report data binding the attestation key;
//  4. the quote signature by the attestation key over header and TD quote body;
//  5. the quoting enclave against the QE identity, the TDX module and the platform's SVNs against TCB info; the
//     resulting TCB statuses must be in the accepted set (only UpToDate by default; others become warnings).
//
// PCK chains and collateral signatures are checked once per content and remembered for as long as the
// certificates involved are valid; each quote still gets its own QE report and quote signature checks, and its
// own checks of the collateral's update times and of revocation.
// Collateral is injected through CollateralGetter. CachingGetter keeps it in memory and, optionally, on disk, so
// that a verifier can run with pre-fetched collateral (StoreCollateral seeds a directory) and no upstream at all;
// PCSGetter fetches from an Intel PCS (API v4) compatible service where one is reachable; a CollateralBundle is
// collateral an operator ships in one file (the attestation policy's tdx.collateralBundle) and never fetches.
// Collateral that cannot be had fails a quote with ErrCollateralUnavailable (an ErrUntrustedRoot). Validator adds the report data
// binding and the measurement policy (indices: 0 = MRTD, 1..4 = RTMR0..3).
package tdx
