// Package vtpmtest provides TPMs with EK certificates for tests of the TPM variant: the reference
// simulator provisioned with an EK certificate from a throwaway CA, and swtpm processes whose EK
// certificates come from swtpm's local CA (as in the mini cluster).
package vtpmtest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"fmt"
	"math/big"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

// CA is a throwaway certificate authority for EK certificates.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
}

// NewCA creates a self-signed EK CA named name.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}

// PEM returns the CA certificate in PEM form, as a policy's trustRoots entry takes it.
func (ca *CA) PEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// oidTCGKpEKCertificate is the EK certificate extended key usage from the TCG EK Credential Profile.
var oidTCGKpEKCertificate = asn1.ObjectIdentifier{2, 23, 133, 8, 1}

// ProvisionEKCert creates the TPM's RSA EK, issues an EK certificate for it from ca and writes the
// certificate to vtpm.RSAEKCertIndex, replacing what is there.
func ProvisionEKCert(ctx context.Context, open vtpm.OpenFunc, ca *CA) error {
	rwc, err := open(ctx)
	if err != nil {
		return err
	}
	defer rwc.Close()
	tpm := transport.FromReadWriter(rwc)
	ek, err := tpm2.CreatePrimary{PrimaryHandle: tpm2.TPMRHEndorsement, InPublic: tpm2.New2B(tpm2.RSAEKTemplate)}.Execute(tpm)
	if err != nil {
		return fmt.Errorf("creating EK: %w", err)
	}
	defer func() { _, _ = tpm2.FlushContext{FlushHandle: ek.ObjectHandle}.Execute(tpm) }()
	pubArea, err := ek.OutPublic.Contents()
	if err != nil {
		return err
	}
	pub, err := tpm2.Pub(*pubArea)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageKeyEncipherment,
		UnknownExtKeyUsage:    []asn1.ObjectIdentifier{oidTCGKpEKCertificate},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, pub, ca.Key)
	if err != nil {
		return fmt.Errorf("issuing EK certificate: %w", err)
	}
	return writeNV(tpm, vtpm.RSAEKCertIndex, der)
}

// writeNV (re)defines an owner-authorized NV index holding data.
func writeNV(tpm transport.TPM, index uint32, data []byte) error {
	owner := tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)}
	if pub, err := (tpm2.NVReadPublic{NVIndex: tpm2.TPMHandle(index)}).Execute(tpm); err == nil {
		if _, err := (tpm2.NVUndefineSpace{AuthHandle: owner, NVIndex: tpm2.NamedHandle{Handle: tpm2.TPMHandle(index), Name: pub.NVName}}).Execute(tpm); err != nil {
			return fmt.Errorf("removing old NV index: %w", err)
		}
	}
	def := tpm2.TPMSNVPublic{
		NVIndex:    tpm2.TPMHandle(index),
		NameAlg:    tpm2.TPMAlgSHA256,
		Attributes: tpm2.TPMANV{OwnerWrite: true, OwnerRead: true, AuthRead: true, NoDA: true, NT: tpm2.TPMNTOrdinary},
		DataSize:   uint16(len(data)),
	}
	if _, err := (tpm2.NVDefineSpace{AuthHandle: owner, PublicInfo: tpm2.New2B(def)}).Execute(tpm); err != nil {
		return fmt.Errorf("defining NV index: %w", err)
	}
	name, err := tpm2.NVName(&def)
	if err != nil {
		return err
	}
	for off := 0; off < len(data); off += 512 {
		end := min(off+512, len(data))
		if _, err := (tpm2.NVWrite{
			AuthHandle: owner,
			NVIndex:    tpm2.NamedHandle{Handle: tpm2.TPMHandle(index), Name: *name},
			Data:       tpm2.TPM2BMaxNVBuffer{Buffer: data[off:end]},
			Offset:     uint16(off),
		}).Execute(tpm); err != nil {
			return fmt.Errorf("writing NV index: %w", err)
		}
	}
	return nil
}
