package tdx

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Layout of an Intel TDX quote, version 4, with an ECDSA P-256 attestation key. Offsets and sizes are those of
// Intel's DCAP quote format specification; all integers are little endian.
const (
	quoteHeaderSize   = 48
	tdQuoteBodySize   = 584
	signedQuoteSize   = quoteHeaderSize + tdQuoteBodySize // header and TD quote body, covered by the quote signature
	sigDataLenSize    = 4
	ecdsaSigSize      = 64
	ecdsaPubKeySize   = 64
	enclaveReportSize = 384
	// maxQuoteSize bounds what the parser accepts; real quotes are about 5 KiB.
	maxQuoteSize = 64 << 10

	quoteVersion4       = 4
	attestKeyECDSAP256  = 2
	teeTypeTDX          = 0x81
	certDataQEReport    = 6
	certDataPCKChainPEM = 5
)

// Measurement register size (SHA-384) and the report data size of a TD report.
const (
	MeasurementSize = 48
	ReportDataSize  = 64
)

// QuoteHeader is the fixed header of a version 4 quote.
type QuoteHeader struct {
	Version            uint16
	AttestationKeyType uint16
	TEEType            uint32
	QEVendorID         [16]byte
	UserData           [20]byte
}

// TDQuoteBody is the TD report as it appears in a quote (TDX 1.0 layout).
type TDQuoteBody struct {
	TEETCBSVN      [16]byte
	MRSEAM         [MeasurementSize]byte
	MRSIGNERSEAM   [MeasurementSize]byte
	SEAMAttributes [8]byte
	TDAttributes   [8]byte
	XFAM           [8]byte
	MRTD           [MeasurementSize]byte
	MRCONFIGID     [MeasurementSize]byte
	MROWNER        [MeasurementSize]byte
	MROWNERCONFIG  [MeasurementSize]byte
	RTMR           [4][MeasurementSize]byte
	ReportData     [ReportDataSize]byte
}

// EnclaveReport is the SGX report body of the quoting enclave (QE report).
type EnclaveReport struct {
	CPUSVN     [16]byte
	MiscSelect uint32
	Attributes [16]byte
	MRENCLAVE  [32]byte
	MRSIGNER   [32]byte
	ISVProdID  uint16
	ISVSVN     uint16
	ReportData [64]byte
}

// Quote is a parsed TDX quote. Raw keeps the bytes the parsed values came from, so that signatures are checked
// over exactly what was received.
type Quote struct {
	Header QuoteHeader
	Body   TDQuoteBody

	// Signature is the ECDSA P-256 signature (r||s) of the attestation key over header and body.
	Signature [ecdsaSigSize]byte
	// AttestationKey is the attestation public key (x||y) that signed the quote.
	AttestationKey [ecdsaPubKeySize]byte
	// QEReport is the quoting enclave's report, which binds the attestation key.
	QEReport EnclaveReport
	// QEReportSignature is the PCK key's ECDSA signature (r||s) over the raw QE report.
	QEReportSignature [ecdsaSigSize]byte
	// QEAuthData is the QE authentication data hashed into the QE report data together with the attestation key.
	QEAuthData []byte
	// PCKChainPEM is the PCK certificate chain in PEM (leaf first).
	PCKChainPEM []byte

	// Raw is the complete quote.
	Raw []byte
	// SignedBytes are the bytes covered by Signature (header and TD quote body).
	SignedBytes []byte
	// RawQEReport are the bytes covered by QEReportSignature.
	RawQEReport []byte
}

// errShortQuote is returned when the quote ends before a field does.
var errShortQuote = errors.New("quote truncated")

// quoteReader reads fields from a byte slice and remembers the first error.
type quoteReader struct {
	b   []byte
	off int
	err error
}

func (r *quoteReader) take(n int, field string) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || len(r.b)-r.off < n {
		r.err = fmt.Errorf("reading %s at offset %d: %w", field, r.off, errShortQuote)
		return nil
	}
	out := r.b[r.off : r.off+n]
	r.off += n
	return out
}

func (r *quoteReader) u16(field string) uint16 {
	b := r.take(2, field)
	if b == nil {
		return 0
	}
	return binary.LittleEndian.Uint16(b)
}

func (r *quoteReader) u32(field string) uint32 {
	b := r.take(4, field)
	if b == nil {
		return 0
	}
	return binary.LittleEndian.Uint32(b)
}

func (r *quoteReader) copyInto(dst []byte, field string) {
	if b := r.take(len(dst), field); b != nil {
		copy(dst, b)
	}
}

// ParseQuote parses a version 4 TDX quote with an ECDSA P-256 attestation key and QE report certification data
// carrying a PEM PCK certificate chain. It checks structure only; VerifyQuote checks signatures and collateral.
func ParseQuote(raw []byte) (*Quote, error) {
	if len(raw) > maxQuoteSize {
		return nil, fmt.Errorf("parsing quote: %d bytes exceed the limit of %d", len(raw), maxQuoteSize)
	}
	q := &Quote{Raw: raw}
	r := &quoteReader{b: raw}

	q.Header.Version = r.u16("header version")
	q.Header.AttestationKeyType = r.u16("attestation key type")
	q.Header.TEEType = r.u32("TEE type")
	r.take(4, "reserved header bytes")
	r.copyInto(q.Header.QEVendorID[:], "QE vendor ID")
	r.copyInto(q.Header.UserData[:], "header user data")
	if r.err != nil {
		return nil, fmt.Errorf("parsing quote header: %w", r.err)
	}
	if q.Header.Version != quoteVersion4 {
		return nil, fmt.Errorf("parsing quote header: unsupported quote version %d", q.Header.Version)
	}
	if q.Header.AttestationKeyType != attestKeyECDSAP256 {
		return nil, fmt.Errorf("parsing quote header: unsupported attestation key type %d", q.Header.AttestationKeyType)
	}
	if q.Header.TEEType != teeTypeTDX {
		return nil, fmt.Errorf("parsing quote header: TEE type %#x is not TDX", q.Header.TEEType)
	}

	b := &q.Body
	r.copyInto(b.TEETCBSVN[:], "TEE TCB SVN")
	r.copyInto(b.MRSEAM[:], "MRSEAM")
	r.copyInto(b.MRSIGNERSEAM[:], "MRSIGNERSEAM")
	r.copyInto(b.SEAMAttributes[:], "SEAM attributes")
	r.copyInto(b.TDAttributes[:], "TD attributes")
	r.copyInto(b.XFAM[:], "XFAM")
	r.copyInto(b.MRTD[:], "MRTD")
	r.copyInto(b.MRCONFIGID[:], "MRCONFIGID")
	r.copyInto(b.MROWNER[:], "MROWNER")
	r.copyInto(b.MROWNERCONFIG[:], "MROWNERCONFIG")
	for i := range b.RTMR {
		r.copyInto(b.RTMR[i][:], "RTMR")
	}
	r.copyInto(b.ReportData[:], "report data")
	if r.err != nil {
		return nil, fmt.Errorf("parsing TD quote body: %w", r.err)
	}
	q.SignedBytes = raw[:signedQuoteSize]

	sigLen := r.u32("signature data length")
	if r.err == nil && int(sigLen) != len(raw)-r.off {
		return nil, fmt.Errorf("parsing quote: signature data length %d does not match the %d remaining bytes", sigLen, len(raw)-r.off)
	}
	r.copyInto(q.Signature[:], "quote signature")
	r.copyInto(q.AttestationKey[:], "attestation key")
	certType := r.u16("certification data type")
	certLen := r.u32("certification data size")
	if r.err != nil {
		return nil, fmt.Errorf("parsing quote signature data: %w", r.err)
	}
	if certType != certDataQEReport {
		return nil, fmt.Errorf("parsing quote signature data: certification data type %d, want QE report certification data (%d)", certType, certDataQEReport)
	}
	if int(certLen) != len(raw)-r.off {
		return nil, fmt.Errorf("parsing quote signature data: certification data size %d does not match the %d remaining bytes", certLen, len(raw)-r.off)
	}

	q.RawQEReport = r.take(enclaveReportSize, "QE report")
	if r.err == nil {
		q.QEReport = parseEnclaveReport(q.RawQEReport)
	}
	r.copyInto(q.QEReportSignature[:], "QE report signature")
	authLen := r.u16("QE authentication data size")
	q.QEAuthData = r.take(int(authLen), "QE authentication data")
	innerType := r.u16("PCK certification data type")
	innerLen := r.u32("PCK certification data size")
	if r.err != nil {
		return nil, fmt.Errorf("parsing QE report certification data: %w", r.err)
	}
	if innerType != certDataPCKChainPEM {
		return nil, fmt.Errorf("parsing QE report certification data: certification data type %d, want PCK certificate chain (%d)", innerType, certDataPCKChainPEM)
	}
	if int(innerLen) != len(raw)-r.off {
		return nil, fmt.Errorf("parsing QE report certification data: PCK chain size %d does not match the %d remaining bytes", innerLen, len(raw)-r.off)
	}
	q.PCKChainPEM = r.take(int(innerLen), "PCK certificate chain")
	if r.err != nil {
		return nil, fmt.Errorf("parsing QE report certification data: %w", r.err)
	}
	return q, nil
}

// parseEnclaveReport decodes a 384-byte SGX report body.
func parseEnclaveReport(b []byte) EnclaveReport {
	var e EnclaveReport
	copy(e.CPUSVN[:], b[0:16])
	e.MiscSelect = binary.LittleEndian.Uint32(b[16:20])
	copy(e.Attributes[:], b[48:64])
	copy(e.MRENCLAVE[:], b[64:96])
	copy(e.MRSIGNER[:], b[128:160])
	e.ISVProdID = binary.LittleEndian.Uint16(b[256:258])
	e.ISVSVN = binary.LittleEndian.Uint16(b[258:260])
	copy(e.ReportData[:], b[320:384])
	return e
}

// Measurements returns the quote's MRTD and RTMR0..3 as [MRTD, RTMR0, RTMR1, RTMR2, RTMR3].
func (q *Quote) Measurements() [5][MeasurementSize]byte {
	return [5][MeasurementSize]byte{q.Body.MRTD, q.Body.RTMR[0], q.Body.RTMR[1], q.Body.RTMR[2], q.Body.RTMR[3]}
}
