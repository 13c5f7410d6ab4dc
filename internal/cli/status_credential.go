package cli

import (
	"crypto/x509"
	"fmt"
	"io"
	"os"
	"time"

	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/pemcerts"
)

// The operator's own credential in berth status: the client certificate of the kubeconfig berth
// status itself uses. berth init's admin.conf lasts a year and berth kubeconfig's a day by default;
// nothing renews either, so status says when it ends and how to get the next one.

// renewAdminHint is how an operator gets a fresh credential.
const renewAdminHint = "berth kubeconfig --endpoint CONTROL_PLANE (with the cluster's master secret)"

// operatorCredential is the operator section of berth status -o json|yaml. Its field names are
// stable.
type operatorCredential struct {
	// Subject is the certificate's common name and Groups its organizations.
	Subject string   `json:"subject"`
	Groups  []string `json:"groups,omitempty"`
	// NotBefore and NotAfter bound its validity.
	NotBefore time.Time `json:"notBefore"`
	NotAfter  time.Time `json:"notAfter"`
	// ExpiresSoon is true when less than a quarter of its validity, or less than a week, is left
	// (whichever is shorter): status warns from then on.
	ExpiresSoon bool `json:"expiresSoon"`
}

// credentialExpiredError is returned by berth status before it connects when the kubeconfig's client
// certificate has ended: the API server would only answer Unauthorized.
type credentialExpiredError struct{ c *operatorCredential }

func (e credentialExpiredError) Error() string {
	return fmt.Sprintf("the kubeconfig's client certificate (%s) expired at %s: get a new one with %s",
		printable(e.c.Subject), e.c.NotAfter.UTC().Format(time.RFC3339), renewAdminHint)
}

// readOperatorCredential returns the client certificate cfg authenticates with, judged at now; nil
// when cfg uses no client certificate (a token, an exec plugin) or names a file that is gone, since
// then the API server's answer is the judge.
func readOperatorCredential(cfg *rest.Config, now time.Time) (*operatorCredential, error) {
	data := cfg.CertData
	if len(data) == 0 && cfg.CertFile != "" {
		b, err := os.ReadFile(cfg.CertFile)
		if err != nil {
			return nil, nil //nolint:nilerr // client-go reports the missing file itself when it connects
		}
		data = b
	}
	if len(data) == 0 {
		return nil, nil
	}
	certs, err := pemcerts.Parse(data)
	if err != nil || len(certs) == 0 {
		return nil, &exitError{code: exitUsage, err: fmt.Errorf("the kubeconfig's client certificate does not parse: %w", err)}
	}
	c := credentialOf(certs[0], now)
	if !now.Before(c.NotAfter) {
		return nil, &exitError{code: exitFailure, err: credentialExpiredError{c}}
	}
	return c, nil
}

// credentialOf describes cert at now.
func credentialOf(cert *x509.Certificate, now time.Time) *operatorCredential {
	c := &operatorCredential{
		Subject:   cert.Subject.CommonName,
		Groups:    cert.Subject.Organization,
		NotBefore: cert.NotBefore,
		NotAfter:  cert.NotAfter,
	}
	warnWithin := min(cert.NotAfter.Sub(cert.NotBefore)/4, 7*24*time.Hour)
	c.ExpiresSoon = cert.NotAfter.Sub(now) < warnWithin
	return c
}

// printOperatorCredential is the text form: one line, and a warning with the way to renew when it
// expires soon.
func printOperatorCredential(out io.Writer, c *operatorCredential, now time.Time) {
	if c == nil {
		return
	}
	_, _ = fmt.Fprintf(out, "\nYour credential: %s, valid until %s (in %s)\n", printable(c.Subject), c.NotAfter.UTC().Format(time.RFC3339), left(c.NotAfter, now))
	if c.ExpiresSoon {
		_, _ = fmt.Fprintf(out, "WARNING: your credential expires in %s; get a new one with %s\n", left(c.NotAfter, now), renewAdminHint)
	}
}
