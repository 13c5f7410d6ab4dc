package vtpm

import (
	"context"
	"crypto/sha256"
	"fmt"

	"github.com/berth-k8s/berth/internal/attestation"
)

// MachineIdentity returns this TPM's machine identity: the bytes a Validator puts in
// attestation.Result.Identity for this TPM's documents, SHA-256 of the EK's public area. It is the
// same on every boot and differs between TPMs. Like Identity, it creates the AK if this Issuer has
// not yet.
func (i *Issuer) MachineIdentity(ctx context.Context) ([]byte, error) {
	raw, err := i.Identity(ctx)
	if err != nil {
		return nil, err
	}
	id, err := parseIdentity(raw)
	if err != nil {
		return nil, err
	}
	return ekIdentity(id.ekPublic), nil
}

// ekIdentity is the machine identity of the TPM whose EK has the public area ekPublic (TPMT_PUBLIC,
// as a Document carries it).
func ekIdentity(ekPublic []byte) []byte {
	sum := sha256.Sum256(ekPublic)
	return sum[:]
}

// EKPublicSHA256 returns the SHA-256 of the EK public area a document names, without trusting it:
// the value a policy's tpm.ekPublicSHA256 pins, for display (berth verify, berth policy check).
func EKPublicSHA256(raw []byte) ([]byte, error) {
	doc, err := ParseDocument(raw)
	if err != nil {
		return nil, err
	}
	if len(doc.EKPublic) == 0 {
		return nil, fmt.Errorf("%w: the document names no EK", attestation.ErrMalformed)
	}
	return ekIdentity(doc.EKPublic), nil
}
