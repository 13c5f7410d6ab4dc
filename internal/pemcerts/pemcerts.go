// Package pemcerts decodes X.509 certificates from PEM text: trust roots in a policy, the PCK chain
// in a TDX quote, CA bundles.
package pemcerts

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
)

// ErrNoCertificate means the text held no CERTIFICATE block.
var ErrNoCertificate = errors.New("no PEM certificate found")

// Parse returns every CERTIFICATE block in data, in order. Other blocks and text between blocks
// (comments, the NUL padding quote generators add) are skipped; a CERTIFICATE block that does not
// parse is an error naming its position.
func Parse(data []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parsing certificate %d: %w", len(certs), err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, ErrNoCertificate
	}
	return certs, nil
}
