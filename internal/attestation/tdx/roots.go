package tdx

import (
	"crypto/x509"
	"fmt"

	"github.com/berth-k8s/berth/internal/pemcerts"
)

// IntelSGXRootCAPEM is Intel's SGX Root CA certificate (CN "Intel SGX Root CA", P-256, valid 2018-05-21 to
// 2049-12-31), the root of every PCK certificate chain and of the collateral signing chains. It is public data;
// operators may pin it or configure their own roots instead.
const IntelSGXRootCAPEM = `-----BEGIN CERTIFICATE-----
MIICjzCCAjSgAwIBAgIUImUM1lqdNInzg7SVUr9QGzknBqwwCgYIKoZIzj0EAwIw
aDEaMBgGA1UEAwwRSW50ZWwgU0dYIFJvb3QgQ0ExGjAYBgNVBAoMEUludGVsIENv
cnBvcmF0aW9uMRQwEgYDVQQHDAtTYW50YSBDbGFyYTELMAkGA1UECAwCQ0ExCzAJ
BgNVBAYTAlVTMB4XDTE4MDUyMTEwNDUxMFoXDTQ5MTIzMTIzNTk1OVowaDEaMBgG
A1UEAwwRSW50ZWwgU0dYIFJvb3QgQ0ExGjAYBgNVBAoMEUludGVsIENvcnBvcmF0
aW9uMRQwEgYDVQQHDAtTYW50YSBDbGFyYTELMAkGA1UECAwCQ0ExCzAJBgNVBAYT
AlVTMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEC6nEwMDIYZOj/iPWsCzaEKi7
1OiOSLRFhWGjbnBVJfVnkY4u3IjkDYYL0MxO4mqsyYjlBalTVYxFP2sJBK5zlKOB
uzCBuDAfBgNVHSMEGDAWgBQiZQzWWp00ifODtJVSv1AbOScGrDBSBgNVHR8ESzBJ
MEegRaBDhkFodHRwczovL2NlcnRpZmljYXRlcy50cnVzdGVkc2VydmljZXMuaW50
ZWwuY29tL0ludGVsU0dYUm9vdENBLmRlcjAdBgNVHQ4EFgQUImUM1lqdNInzg7SV
Ur9QGzknBqwwDgYDVR0PAQH/BAQDAgEGMBIGA1UdEwEB/wQIMAYBAf8CAQEwCgYI
KoZIzj0EAwIDSQAwRgIhAOW/5QkR+S9CiSDcNoowLuPRLsWGf/Yi7GSX94BgwTwg
AiEA4J0lrHoMs+Xo5o/sX6O9QWxHRAvZUGOdRQ7cvqRXaqI=
-----END CERTIFICATE-----
`

// IntelSGXRootCA returns a pool holding only Intel's SGX Root CA.
func IntelSGXRootCA() *x509.CertPool {
	pool, err := CertPoolFromPEM([]byte(IntelSGXRootCAPEM))
	if err != nil {
		panic(err) // the constant above is a valid certificate
	}
	return pool
}

// CertPoolFromPEM builds a pool of trusted roots from PEM certificates, for configured trust roots.
func CertPoolFromPEM(data []byte) (*x509.CertPool, error) {
	certs, err := pemcerts.Parse(data)
	if err != nil {
		return nil, fmt.Errorf("parsing trust roots: %w", err)
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, nil
}
