// Package certsign creates X.509 certificates like x509.CreateCertificate, minus the check that
// re-verifies the signature just made. That check guards against a crypto.Signer that misbehaves
// (a remote or hardware signer); for an in-memory key of crypto/ecdsa, crypto/ed25519 or crypto/rsa
// it costs a full verification per certificate (for P-256 about three times the signature itself)
// and finds nothing: crypto/rsa already checks its own CRT signatures against faults.
//
// Create lets x509.CreateCertificate build and encode the certificate's TBS part from the template
// as always, captures it at the signer, signs it once with the real key and assembles the
// certificate from the TBS, the algorithm identifier the TBS names and the signature.
package certsign

import (
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"io"

	"golang.org/x/crypto/cryptobyte"
	cbasn1 "golang.org/x/crypto/cryptobyte/asn1"
)

// errCaptured stops x509.CreateCertificate once the signer has the TBS.
var errCaptured = errors.New("certsign: TBS captured")

// capture is a crypto.MessageSigner that records the message (the DER TBSCertificate) and the
// options x509.CreateCertificate asks it to sign, and refuses to sign.
type capture struct {
	pub  crypto.PublicKey
	tbs  []byte
	opts crypto.SignerOpts
}

func (c *capture) Public() crypto.PublicKey { return c.pub }

func (c *capture) Sign(io.Reader, []byte, crypto.SignerOpts) ([]byte, error) {
	// x509 hands a crypto.MessageSigner the message, never a digest.
	return nil, errors.New("certsign: signing a digest")
}

func (c *capture) SignMessage(_ io.Reader, msg []byte, opts crypto.SignerOpts) ([]byte, error) {
	c.tbs = append([]byte(nil), msg...)
	c.opts = opts
	return nil, errCaptured
}

// Create returns the DER certificate x509.CreateCertificate(rand, template, parent, pub, key)
// returns, without verifying its signature after signing. Only for keys this process holds in
// memory (see the package doc).
func Create(rand io.Reader, template, parent *x509.Certificate, pub any, key crypto.Signer) ([]byte, error) {
	c := &capture{pub: key.Public()}
	_, err := x509.CreateCertificate(rand, template, parent, pub, c)
	if !errors.Is(err, errCaptured) {
		if err == nil {
			err = errors.New("the signer was not asked to sign")
		}
		return nil, fmt.Errorf("creating certificate: %w", err)
	}
	algID, err := signatureAlgorithm(c.tbs)
	if err != nil {
		return nil, fmt.Errorf("creating certificate: %w", err)
	}
	sig, err := crypto.SignMessage(key, rand, c.tbs, c.opts)
	if err != nil {
		return nil, fmt.Errorf("signing certificate: %w", err)
	}
	var b cryptobyte.Builder
	b.AddASN1(cbasn1.SEQUENCE, func(b *cryptobyte.Builder) {
		b.AddBytes(c.tbs)
		b.AddBytes(algID)
		b.AddASN1BitString(sig)
	})
	der, err := b.Bytes()
	if err != nil {
		return nil, fmt.Errorf("encoding certificate: %w", err)
	}
	return der, nil
}

// signatureAlgorithm returns the signature AlgorithmIdentifier (its full DER element) of a DER
// TBSCertificate: the element after the optional version and the serial number. RFC 5280 has the
// certificate repeat it outside the TBS, as x509.CreateCertificate does.
func signatureAlgorithm(tbs []byte) ([]byte, error) {
	in := cryptobyte.String(tbs)
	var body cryptobyte.String
	if !in.ReadASN1(&body, cbasn1.SEQUENCE) || !in.Empty() {
		return nil, errors.New("malformed TBS certificate")
	}
	var alg cryptobyte.String
	if !body.SkipOptionalASN1(cbasn1.Tag(0).Constructed().ContextSpecific()) ||
		!body.SkipASN1(cbasn1.INTEGER) ||
		!body.ReadASN1Element(&alg, cbasn1.SEQUENCE) {
		return nil, errors.New("malformed TBS certificate: no signature algorithm")
	}
	return alg, nil
}
