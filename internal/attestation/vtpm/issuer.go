package vtpm

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"go.uber.org/zap"
)

// RSAEKCertIndex is the NV index of the RSA-2048 EK certificate (TCG EK Credential Profile); swtpm_setup
// --create-ek-cert writes it there.
const RSAEKCertIndex = 0x01c00002

// DefaultAKHandle is the persistent handle the Issuer keeps its AK at, so that a quote needs neither
// the EK (an RSA key the TPM re-derives at some cost) nor a policy session.
const DefaultAKHandle = 0x81000b01

// DefaultPCRs is the selection the Issuer quotes unless configured otherwise: all 24 PC Client PCRs.
var DefaultPCRs = []uint{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}

// ErrNoEKCertificate means the TPM holds no EK certificate at the configured NV index. The Issuer
// then issues documents without one, which only a policy pinning the EK accepts.
var ErrNoEKCertificate = errors.New("TPM has no EK certificate")

// akTemplate is a restricted ECDSA P-256 signing key that never leaves the TPM.
var akTemplate = tpm2.TPMTPublic{
	Type:    tpm2.TPMAlgECC,
	NameAlg: tpm2.TPMAlgSHA256,
	ObjectAttributes: tpm2.TPMAObject{
		FixedTPM:            true,
		FixedParent:         true,
		SensitiveDataOrigin: true,
		UserWithAuth:        true,
		NoDA:                true,
		Restricted:          true,
		SignEncrypt:         true,
	},
	Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
		Scheme: tpm2.TPMTECCScheme{
			Scheme:  tpm2.TPMAlgECDSA,
			Details: tpm2.NewTPMUAsymScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSigSchemeECDSA{HashAlg: tpm2.TPMAlgSHA256}),
		},
		CurveID: tpm2.TPMECCNistP256,
	}),
}

// AKTemplate returns the template of the attestation key the Issuer creates (without its unique
// point); the validator requires the attributes it sets.
func AKTemplate() tpm2.TPMTPublic { return akTemplate }

// IssuerOption configures an Issuer.
type IssuerOption func(*Issuer)

// WithPCRs sets the quoted PCR selection (SHA-256 bank).
func WithPCRs(pcrs []uint) IssuerOption {
	return func(i *Issuer) { i.pcrs = append([]uint(nil), pcrs...) }
}

// WithAKHandle sets the persistent handle of the AK. The Issuer replaces whatever is there when it
// creates its AK (once per process).
func WithAKHandle(h uint32) IssuerOption { return func(i *Issuer) { i.akHandle = h } }

// WithEventLog makes the Issuer attach the event log that read returns (nil: none) to every document;
// use ReadSystemEventLog on machines whose firmware keeps one.
func WithEventLog(read func() ([]byte, error)) IssuerOption {
	return func(i *Issuer) { i.eventLog = read }
}

// WithEKCertIndex sets the NV index the EK certificate is read from.
func WithEKCertIndex(idx uint32) IssuerOption { return func(i *Issuer) { i.ekCertIndex = idx } }

// Issuer produces TPM attestation documents. It is safe for concurrent use; TPM access is serialized.
type Issuer struct {
	open        OpenFunc
	log         *zap.Logger
	pcrs        []uint
	ekCertIndex uint32
	akHandle    uint32
	eventLog    func() ([]byte, error)

	mu sync.Mutex // serializes TPM use and guards ak and claimed
	ak *akRecord
	// claimed are the PCR values Claims read last, for the next quote to use instead of reading them
	// again (a dial claims, then quotes); the quote's digest shows whether they are still current.
	claimed map[uint32][]byte

	batchMu sync.Mutex // guards pending and quoting
	pending []*quoteRequest
	quoting bool          // a caller holds the turn to quote (running, or handed over in turn)
	turn    chan struct{} // the turn, handed to a waiting caller
}

// akRecord is the AK as created under the EK; the key itself stays persistent in the TPM.
type akRecord struct {
	name         tpm2.TPM2BName
	ekName       tpm2.TPM2BName
	public       tpm2.TPM2BPublic
	creationData []byte
	certifyInfo  []byte
	certifySig   []byte
	ekPublic     []byte
	ekCert       []byte
	akCert       []byte // from CertifyAK; nil until then
}

// NewIssuer returns an Issuer that reaches the TPM through open.
func NewIssuer(open OpenFunc, log *zap.Logger, opts ...IssuerOption) *Issuer {
	i := &Issuer{open: open, log: log, pcrs: append([]uint(nil), DefaultPCRs...), ekCertIndex: RSAEKCertIndex, akHandle: DefaultAKHandle,
		turn: make(chan struct{}, 1)}
	if i.log == nil {
		i.log = zap.NewNop()
	}
	for _, o := range opts {
		o(i)
	}
	sort.Slice(i.pcrs, func(a, b int) bool { return i.pcrs[a] < i.pcrs[b] })
	return i
}

// Variant returns "tpm".
func (i *Issuer) Variant() string { return Variant }

// Issue quotes the configured PCRs with qualifying data bound to userData and nonce and returns the
// JSON attestation document. Concurrent calls share quotes (batch.go): a call alone gets a quote of
// its own; calls that arrive while the TPM is quoting are quoted together next.
func (i *Issuer) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	res, err := i.batched(ctx, extraData(userData, nonce))
	if err != nil {
		return nil, err
	}
	doc := res.doc
	doc.UserData = userData
	doc.Batch = res.batch
	out, err := json.Marshal(doc)
	if err != nil {
		return nil, fmt.Errorf("encoding attestation document: %w", err)
	}
	return out, nil
}

// quote makes one quote over qualifying data and returns the document without user data.
func (i *Issuer) quote(ctx context.Context, qualifying []byte) (Document, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	c, err := openTPM(ctx, i.open)
	if err != nil {
		return Document{}, err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered

	if err := i.ensureAK(c); err != nil {
		return Document{}, err
	}
	ak := tpm2.NamedHandle{Handle: tpm2.TPMHandle(i.akHandle), Name: i.ak.name}

	doc := Document{
		Variant:            Variant,
		EKCert:             i.ak.ekCert,
		EKPublic:           i.ak.ekPublic,
		AKPublic:           i.ak.public.Bytes(),
		AKCreationData:     i.ak.creationData,
		AKCertifyInfo:      i.ak.certifyInfo,
		AKCertifySignature: i.ak.certifySig,
		AKCert:             i.ak.akCert,
	}
	if i.eventLog != nil {
		// Read before the quote: an event appended in between shows as a PCR the log does not explain.
		if doc.EventLog, err = i.eventLog(); err != nil {
			return Document{}, fmt.Errorf("reading event log: %w", err)
		}
	}
	// The PCRs are read separately from the quote; retry when one changed in between.
	for attempt := 0; ; attempt++ {
		pcrs := i.claimed
		i.claimed = nil
		if pcrs == nil {
			if pcrs, err = readPCRs(c, i.pcrs); err != nil {
				return Document{}, err
			}
		}
		q, err := tpm2.Quote{
			SignHandle:     tpm2.AuthHandle{Handle: ak.Handle, Name: ak.Name, Auth: tpm2.PasswordAuth(nil)},
			QualifyingData: tpm2.TPM2BData{Buffer: qualifying},
			InScheme:       tpm2.TPMTSigScheme{Scheme: tpm2.TPMAlgNull},
			PCRSelect:      sha256Selection(i.pcrs),
		}.Execute(c)
		if err != nil {
			return Document{}, fmt.Errorf("quoting PCRs: %w", err)
		}
		info, err := decodeAttest(q.Quoted.Bytes())
		if err != nil {
			return Document{}, fmt.Errorf("decoding quote: %w", err)
		}
		if string(info.pcrDigest) != string(pcrDigest(pcrs, i.pcrs)) {
			// Claimed values may predate an extension: read them again for this quote.
			if pcrs, err = readPCRs(c, i.pcrs); err != nil {
				return Document{}, err
			}
		}
		if string(info.pcrDigest) != string(pcrDigest(pcrs, i.pcrs)) {
			if attempt < 3 {
				continue
			}
			return Document{}, errors.New("quoting PCRs: PCR values kept changing during the quote")
		}
		doc.Quote = q.Quoted.Bytes()
		doc.QuoteSignature = tpm2.Marshal(q.Signature)
		doc.PCRs = pcrs
		return doc, nil
	}
}

// createAK creates the AK under the EK, records its creation with TPM2_CertifyCreation and reads the
// EK certificate.
func (i *Issuer) createAK(c transport.TPM) (*akRecord, error) {
	ekCert, err := readNV(c, i.ekCertIndex)
	switch {
	case errors.Is(err, ErrNoEKCertificate):
		// Platforms without an EK CA (AWS NitroTPM) provision none: a validator must pin this EK.
		i.log.Info("the TPM holds no EK certificate: validators must pin its EK (policy tpm.ekTrust: pinned)", zap.Uint32("nvIndex", i.ekCertIndex))
		ekCert = nil
	case err != nil:
		return nil, err
	}
	ek, err := createEK(c)
	if err != nil {
		return nil, err
	}
	defer flush(c, ek.ObjectHandle)
	created, err := tpm2.Create{
		ParentHandle: tpm2.AuthHandle{Handle: ek.ObjectHandle, Name: ek.Name, Auth: endorsementPolicy()},
		InPublic:     tpm2.New2B(akTemplate),
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("creating attestation key: %w", err)
	}
	load, err := tpm2.Load{
		ParentHandle: tpm2.AuthHandle{Handle: ek.ObjectHandle, Name: ek.Name, Auth: endorsementPolicy()},
		InPrivate:    created.OutPrivate,
		InPublic:     created.OutPublic,
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("loading attestation key: %w", err)
	}
	defer flush(c, load.ObjectHandle)
	cert, err := tpm2.CertifyCreation{
		SignHandle:     tpm2.AuthHandle{Handle: load.ObjectHandle, Name: load.Name, Auth: tpm2.PasswordAuth(nil)},
		ObjectHandle:   tpm2.NamedHandle{Handle: load.ObjectHandle, Name: load.Name},
		CreationHash:   created.CreationHash,
		InScheme:       tpm2.TPMTSigScheme{Scheme: tpm2.TPMAlgNull},
		CreationTicket: created.CreationTicket,
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("certifying attestation key creation: %w", err)
	}
	if err := persist(c, load.ObjectHandle, load.Name, tpm2.TPMHandle(i.akHandle)); err != nil {
		return nil, err
	}
	if err := persist(c, ek.ObjectHandle, ek.Name, tpm2.TPMHandle(DefaultEKHandle)); err != nil {
		return nil, err
	}
	return &akRecord{
		name:         load.Name,
		ekName:       ek.Name,
		public:       created.OutPublic,
		creationData: created.CreationData.Bytes(),
		certifyInfo:  cert.CertifyInfo.Bytes(),
		certifySig:   tpm2.Marshal(cert.Signature),
		ekPublic:     ek.OutPublic.Bytes(),
		ekCert:       ekCert,
	}, nil
}

// persist makes the loaded object h persistent at handle, evicting what was there before.
func persist(c transport.TPM, h tpm2.TPMHandle, name tpm2.TPM2BName, handle tpm2.TPMHandle) error {
	owner := tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)}
	if old, err := (tpm2.ReadPublic{ObjectHandle: handle}).Execute(c); err == nil {
		if _, err := (tpm2.EvictControl{
			Auth:             owner,
			ObjectHandle:     tpm2.NamedHandle{Handle: handle, Name: old.Name},
			PersistentHandle: handle,
		}).Execute(c); err != nil {
			return fmt.Errorf("evicting old attestation key at %#x: %w", uint32(handle), err)
		}
	}
	if _, err := (tpm2.EvictControl{
		Auth:             owner,
		ObjectHandle:     tpm2.NamedHandle{Handle: h, Name: name},
		PersistentHandle: handle,
	}).Execute(c); err != nil {
		return fmt.Errorf("persisting attestation key at %#x: %w", uint32(handle), err)
	}
	return nil
}

// createEK creates the RSA-2048 EK from the TCG default template; the same template always yields
// the same key, the one the EK certificate is for.
func createEK(c transport.TPM) (*tpm2.CreatePrimaryResponse, error) {
	ek, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.TPMRHEndorsement,
		InPublic:      tpm2.New2B(tpm2.RSAEKTemplate),
	}.Execute(c)
	if err != nil {
		return nil, fmt.Errorf("creating endorsement key: %w", err)
	}
	return ek, nil
}

// endorsementPolicy satisfies the EK's authorization policy, PolicySecret(TPM_RH_ENDORSEMENT).
func endorsementPolicy() tpm2.Session {
	return tpm2.Policy(tpm2.TPMAlgSHA256, 16, func(tpm transport.TPM, handle tpm2.TPMISHPolicy, nonceTPM tpm2.TPM2BNonce) error {
		_, err := tpm2.PolicySecret{
			AuthHandle:    tpm2.AuthHandle{Handle: tpm2.TPMRHEndorsement, Auth: tpm2.PasswordAuth(nil)},
			PolicySession: handle,
			NonceTPM:      nonceTPM,
		}.Execute(tpm)
		return err
	})
}

func flush(c transport.TPM, h tpm2.TPMHandle) {
	_, _ = tpm2.FlushContext{FlushHandle: h}.Execute(c)
}

// readNV reads a whole NV index with owner authorization.
func readNV(c transport.TPM, index uint32) ([]byte, error) {
	pub, err := tpm2.NVReadPublic{NVIndex: tpm2.TPMHandle(index)}.Execute(c)
	if errors.Is(err, tpm2.TPMRCHandle) {
		return nil, fmt.Errorf("%w at NV index %#x: %w", ErrNoEKCertificate, index, err)
	}
	if err != nil {
		return nil, fmt.Errorf("reading NV index %#x: %w", index, err)
	}
	nvPub, err := pub.NVPublic.Contents()
	if err != nil {
		return nil, fmt.Errorf("decoding NV public area: %w", err)
	}
	const chunk = 512 // below every TPM's MAX_NV_BUFFER_SIZE
	out := make([]byte, 0, nvPub.DataSize)
	for off := uint16(0); off < nvPub.DataSize; {
		n := min(chunk, nvPub.DataSize-off)
		rsp, err := tpm2.NVRead{
			AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
			NVIndex:    tpm2.NamedHandle{Handle: tpm2.TPMHandle(index), Name: pub.NVName},
			Size:       n,
			Offset:     off,
		}.Execute(c)
		if err != nil {
			return nil, fmt.Errorf("reading NV index %#x: %w", index, err)
		}
		out = append(out, rsp.Data.Buffer...)
		off += n
	}
	return trimDER(out), nil
}

// trimDER drops NV padding after a DER SEQUENCE.
func trimDER(b []byte) []byte {
	if len(b) < 4 || b[0] != 0x30 {
		return b
	}
	var l, hdr int
	switch {
	case b[1] < 0x80:
		l, hdr = int(b[1]), 2
	case b[1] == 0x81:
		l, hdr = int(b[2]), 3
	case b[1] == 0x82:
		l, hdr = int(b[2])<<8|int(b[3]), 4
	default:
		return b
	}
	if hdr+l <= len(b) {
		return b[:hdr+l]
	}
	return b
}

// sha256Selection selects pcrs in the SHA-256 bank.
func sha256Selection(pcrs []uint) tpm2.TPMLPCRSelection {
	return tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
		Hash:      tpm2.TPMAlgSHA256,
		PCRSelect: tpm2.PCClientCompatible.PCRs(pcrs...),
	}}}
}

// readPCRs reads the SHA-256 values of pcrs; TPM2_PCR_Read returns at most 8 values per call.
func readPCRs(c transport.TPM, pcrs []uint) (map[uint32][]byte, error) {
	out := map[uint32][]byte{}
	for _, p := range pcrs {
		if _, ok := out[uint32(p)]; ok {
			continue
		}
		var batch []uint
		for _, q := range pcrs {
			if _, ok := out[uint32(q)]; !ok && len(batch) < 8 {
				batch = append(batch, q)
			}
		}
		got, values, err := pcrReadBatch(c, batch)
		if err != nil {
			return nil, fmt.Errorf("reading PCRs: %w", err)
		}
		if len(got) == 0 || len(got) != len(values) {
			return nil, errors.New("reading PCRs: TPM returned no values")
		}
		for k, idx := range got {
			out[uint32(idx)] = values[k]
		}
	}
	return out, nil
}

// selectedPCRs lists the PCR indices selected in the SHA-256 bank, ascending.
func selectedPCRs(sel tpm2.TPMLPCRSelection) []uint {
	var out []uint
	for _, s := range sel.PCRSelections {
		if s.Hash != tpm2.TPMAlgSHA256 {
			continue
		}
		for byteIdx, b := range s.PCRSelect {
			for bit := 0; bit < 8; bit++ {
				if b&(1<<bit) != 0 {
					out = append(out, uint(byteIdx*8+bit))
				}
			}
		}
	}
	return out
}

// pcrDigest is the quote's PCR digest: SHA-256 over the selected values in ascending index order.
func pcrDigest(values map[uint32][]byte, pcrs []uint) []byte {
	h := sha256.New()
	for _, p := range pcrs {
		h.Write(values[uint32(p)])
	}
	return h.Sum(nil)
}
