package cli

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/pemcerts"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

// The certificates section of berth status: the earliest expiry of every certificate Berth renews,
// and who renews it.

// certificatesReport is the certificates section of berth status -o json|yaml. Its field names are
// stable.
type certificatesReport struct {
	// Earliest is the earliest expiry of all of them; nil when none could be read.
	Earliest *time.Time `json:"earliestExpiry,omitempty"`
	// Webhook is the image-policy webhook's trust chain; nil when it is not installed.
	Webhook *webhookCertificates `json:"webhook,omitempty"`
	// ControlPlanes are the control planes' kubeadm certificates, by node.
	ControlPlanes []controlPlaneCertificates `json:"controlPlanes"`
	// Problems are what could not be read (no permission, a Secret that does not parse).
	Problems []string `json:"problems,omitempty"`
}

type webhookCertificates struct {
	ServingExpiry time.Time `json:"servingExpiry"`
	CAExpiry      time.Time `json:"caExpiry"`
	// BundleExpiry is the earliest expiry among the CAs the configuration publishes.
	BundleExpiry time.Time `json:"bundleExpiry"`
	// RotationUnderWay: the published bundle holds the previous CA besides the current one.
	RotationUnderWay bool `json:"rotationUnderWay"`
	// RenewedBy is the node whose joinservice holds the certificate keeper's Lease ("" when none).
	RenewedBy string `json:"renewedBy"`
	// LeaseRenewed is when the keeper last renewed its Lease.
	LeaseRenewed *time.Time `json:"leaseRenewed,omitempty"`
}

type controlPlaneCertificates struct {
	Node string `json:"node"`
	// Expiry is the earliest expiry of the node's certificates as its renewer last recorded it.
	Expiry *time.Time `json:"expiry,omitempty"`
	// LastRenewed is when the node last renewed them.
	LastRenewed *time.Time `json:"lastRenewed,omitempty"`
	// Ready is the Node's Ready condition.
	Ready bool `json:"ready"`
}

// readCertificates gathers the certificates section; what it cannot read goes to Problems.
func readCertificates(ctx context.Context, client kubernetes.Interface, namespace string) certificatesReport {
	r := certificatesReport{ControlPlanes: []controlPlaneCertificates{}}
	var expiries []time.Time
	problem := func(format string, args ...any) { r.Problems = append(r.Problems, fmt.Sprintf(format, args...)) }

	secret, err := client.CoreV1().Secrets(namespace).Get(ctx, webhookconfig.TLSSecret, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		problem("webhook certificates: reading Secret %s/%s: %v", namespace, webhookconfig.TLSSecret, err)
	default:
		w := &webhookCertificates{}
		first := func(key string) (*x509.Certificate, []*x509.Certificate) {
			certs, err := pemcerts.Parse(secret.Data[key])
			if err != nil || len(certs) == 0 {
				problem("webhook certificates: %s in Secret %s does not parse", key, webhookconfig.TLSSecret)
				return nil, nil
			}
			return certs[0], certs
		}
		if leaf, _ := first("tls.crt"); leaf != nil {
			w.ServingExpiry = leaf.NotAfter
			expiries = append(expiries, leaf.NotAfter)
		}
		if ca, _ := first("ca.crt"); ca != nil {
			w.CAExpiry = ca.NotAfter
		}
		if _, bundle := first("ca-bundle.crt"); len(bundle) > 0 {
			w.RotationUnderWay = len(bundle) > 1
			for _, c := range bundle {
				if w.BundleExpiry.IsZero() || c.NotAfter.Before(w.BundleExpiry) {
					w.BundleExpiry = c.NotAfter
				}
			}
			expiries = append(expiries, w.BundleExpiry)
		}
		lease, err := client.CoordinationV1().Leases(namespace).Get(ctx, joinconfig.CertKeeperLease, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			problem("webhook certificates: reading Lease %s/%s: %v", namespace, joinconfig.CertKeeperLease, err)
		default:
			if h := lease.Spec.HolderIdentity; h != nil {
				// The keeper's identity is NODE_suffix.
				w.RenewedBy, _, _ = strings.Cut(*h, "_")
			}
			if lease.Spec.RenewTime != nil {
				t := lease.Spec.RenewTime.UTC()
				w.LeaseRenewed = &t
			}
		}
		r.Webhook = w
	}

	nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "node-role.kubernetes.io/control-plane"})
	if err != nil {
		problem("control-plane certificates: listing the control planes: %v", err)
	} else {
		for _, n := range nodes.Items {
			cp := controlPlaneCertificates{Node: n.Name}
			for _, c := range n.Status.Conditions {
				if c.Type == "Ready" {
					cp.Ready = c.Status == "True"
				}
			}
			if t, err := time.Parse(time.RFC3339, n.Annotations[joinconfig.NodeCertExpiryAnnotation]); err == nil {
				cp.Expiry = &t
				expiries = append(expiries, t)
			}
			if t, err := time.Parse(time.RFC3339, n.Annotations[joinconfig.NodeCertsRenewedAnnotation]); err == nil {
				cp.LastRenewed = &t
			}
			r.ControlPlanes = append(r.ControlPlanes, cp)
		}
		slices.SortFunc(r.ControlPlanes, func(a, b controlPlaneCertificates) int { return strings.Compare(a.Node, b.Node) })
	}
	if len(expiries) > 0 {
		e := slices.MinFunc(expiries, func(a, b time.Time) int { return a.Compare(b) }).UTC()
		r.Earliest = &e
	}
	return r
}

// printCertificates prints the certificates section.
func printCertificates(out io.Writer, r certificatesReport, now time.Time) {
	_, _ = fmt.Fprintln(out, "\nCertificates")
	if r.Earliest != nil {
		_, _ = fmt.Fprintf(out, "Earliest expiry: %s (in %s)\n", r.Earliest.Format(time.RFC3339), left(*r.Earliest, now))
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "CERTIFICATES\tEXPIRES\tIN\tRENEWED BY")
	if w := r.Webhook; w != nil {
		keeper := "nobody: no joinservice holds Lease " + joinconfig.CertKeeperLease
		if w.RenewedBy != "" {
			keeper = "certificate keeper on " + printable(w.RenewedBy)
		}
		row := func(what string, t time.Time, by string) {
			_, _ = fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", what, t.UTC().Format(time.RFC3339), left(t, now), by)
		}
		row("webhook serving certificate", w.ServingExpiry, keeper+" (renews at 2/3 of its life)")
		caNote := " (rotates it in four steps before a leaf's life plus 90 days is left)"
		if w.RotationUnderWay {
			caNote = " (a CA rotation is under way)"
		}
		row("webhook CA bundle", w.BundleExpiry, keeper+caNote)
	}
	for _, cp := range r.ControlPlanes {
		by := "itself (bootstrapper, or berth-cert-renew.timer on the image)"
		if cp.LastRenewed != nil {
			by += ", last " + cp.LastRenewed.UTC().Format(time.RFC3339)
		}
		if !cp.Ready {
			by += "; the node is not ready"
		}
		expires, in := "unknown (no renewal check recorded yet)", "-"
		if cp.Expiry != nil {
			expires, in = cp.Expiry.UTC().Format(time.RFC3339), left(*cp.Expiry, now)
		}
		_, _ = fmt.Fprintf(tw, "control plane %s\t%s\t%s\t%s\n", printable(cp.Node), expires, in, by)
	}
	_ = tw.Flush()
	for _, p := range r.Problems {
		_, _ = fmt.Fprintf(out, "  could not read: %s\n", oneLine(p))
	}
}

// left says how long until t, in days when it is at least two days away.
func left(t, now time.Time) string {
	d := t.Sub(now)
	switch {
	case d <= 0:
		return "EXPIRED"
	case d >= 48*time.Hour:
		return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
	default:
		return d.Round(time.Second).String()
	}
}
