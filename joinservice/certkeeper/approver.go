package certkeeper

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/webhook/install"
)

// Approving kubelet serving certificates. With serverTLSBootstrap the kubelet asks for its serving
// certificate with a CSR for the signer kubernetes.io/kubelet-serving, which nothing approves by
// default; kube-controller-manager signs it with the cluster CA once it is approved. The approver
// approves only a request that names the node that sends it and nothing else:
//
//   - the requester (set by the API server from its credentials, not by the node) is
//     system:node:NAME in group system:nodes: the kubelet's client certificate, which the
//     joinservice issued for the instance name the platform gave the attested machine (or which the
//     kubelet renewed for that same name);
//   - the request's subject is CN=system:node:NAME, O=system:nodes, its usages are exactly digital
//     signature (and key encipherment) and server auth, it names no e-mail address and no URI;
//   - its DNS names are at most NAME, and its IP addresses are among the addresses the platform's
//     metadata gives instance NAME (the node's own word in its Node object does not count);
//   - a Node NAME exists;
//   - with WithRevocations, no machine that joined as NAME is revoked in the machine record
//     (`berth node remove`): a removed node gets no serving certificate, whatever credential it
//     still holds. (Its client certificate renewals, which kube-controller-manager approves, never
//     get this far: the API server's revocation policy refuses the removed node's CSR itself.)
//
// A request that fails a check is denied with the reason (the kubelet asks again, and the denial
// is visible in `kubectl get csr`); one that cannot be checked yet (metadata unreachable, the Node
// not registered yet) stays pending and is checked again at the next resync.

// Reasons of denials, in berth_certkeeper_csr_decisions_total and the CSR's Denied condition.
const (
	ReasonNotANode       = "NotANode"
	ReasonSubject        = "SubjectMismatch"
	ReasonUsages         = "BadUsages"
	ReasonNames          = "NameNotOfNode"
	ReasonAddresses      = "AddressNotOfNode"
	ReasonUnknownNode    = "UnknownInstance"
	ReasonBadRequest     = "BadRequest"
	ReasonRevoked        = "NodeRevoked"
	reasonApproved       = "NodeVerified"
	approverResync       = 30 * time.Second
	nodeUserPrefix       = "system:node:"
	nodesGroup           = "system:nodes"
	kubeletServingSigner = certificatesv1.KubeletServingSignerName
)

// errNotYet is a check that cannot be made yet: the request stays pending.
var errNotYet = errors.New("cannot be checked yet")

// denial is a definite refusal with a reason.
type denial struct{ reason, message string }

func (d *denial) Error() string { return d.reason + ": " + d.message }

func deny(reason, format string, args ...any) error {
	return &denial{reason: reason, message: fmt.Sprintf(format, args...)}
}

// Approver approves kubelet serving CSRs of verified nodes.
type Approver struct {
	log    *zap.Logger
	client kubernetes.Interface
	meta   interface {
		Peers(ctx context.Context) ([]metadata.Instance, error)
	}
	metrics *Metrics
	// recordNamespace is where the machine record is; empty: revocations are not checked.
	recordNamespace string
}

// NewApprover returns an approver that checks requests against meta's instances.
func NewApprover(log *zap.Logger, client kubernetes.Interface, meta interface {
	Peers(ctx context.Context) ([]metadata.Instance, error)
}, m *Metrics) *Approver {
	return &Approver{log: log, client: client, meta: meta, metrics: m}
}

// WithRevocations makes the approver deny the requests of nodes whose machine is revoked in the
// machine record in namespace, and returns it.
func (a *Approver) WithRevocations(namespace string) *Approver {
	a.recordNamespace = namespace
	return a
}

// Run watches kubelet serving CSRs and decides every pending one until ctx ends.
func (a *Approver) Run(ctx context.Context) error {
	factory := informers.NewSharedInformerFactoryWithOptions(a.client, approverResync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.signerName", kubeletServingSigner).String()
		}))
	inf := factory.Certificates().V1().CertificateSigningRequests().Informer()
	handle := func(obj any) {
		if csr, ok := obj.(*certificatesv1.CertificateSigningRequest); ok {
			a.Decide(ctx, csr)
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    handle,
		UpdateFunc: func(_, obj any) { handle(obj) },
	}); err != nil {
		return fmt.Errorf("watching kubelet serving CSRs: %w", err)
	}
	factory.Start(ctx.Done())
	<-ctx.Done()
	factory.Shutdown()
	return nil
}

// Decide approves or denies csr when it is a pending kubelet serving request, and leaves it pending
// when it cannot be checked yet.
func (a *Approver) Decide(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) {
	if csr.Spec.SignerName != kubeletServingSigner || decided(csr) {
		return
	}
	log := a.log.With(zap.String("csr", csr.Name), zap.String("requester", csr.Spec.Username))
	err := a.verify(ctx, csr)
	var d *denial
	switch {
	case errors.Is(err, errNotYet):
		log.Info("kubelet serving CSR left pending", zap.Error(err))
		return
	case errors.As(err, &d):
		a.decide(ctx, log, csr, certificatesv1.CertificateDenied, d.reason, d.message)
	case err != nil:
		log.Warn("checking a kubelet serving CSR", zap.Error(err))
	default:
		a.decide(ctx, log, csr, certificatesv1.CertificateApproved, reasonApproved,
			"Berth's certificate keeper verified the requesting node against the platform's instance record")
	}
}

func (a *Approver) decide(ctx context.Context, log *zap.Logger, csr *certificatesv1.CertificateSigningRequest, kind certificatesv1.RequestConditionType, reason, message string) {
	next := csr.DeepCopy()
	next.Status.Conditions = append(next.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type: kind, Status: corev1.ConditionTrue, Reason: reason, Message: message, LastUpdateTime: metav1.Now(),
	})
	_, err := a.client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, csr.Name, next, metav1.UpdateOptions{FieldManager: install.KeeperFieldManager})
	switch {
	case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
		// Decided or deleted meanwhile; the informer brings the new state.
		return
	case err != nil:
		log.Warn("recording the decision on a kubelet serving CSR", zap.String("decision", string(kind)), zap.Error(err))
		return
	}
	decision := "approved"
	if kind == certificatesv1.CertificateDenied {
		decision = "denied"
		log.Warn("kubelet serving CSR denied", zap.String("reason", reason), zap.String("message", message))
	} else {
		log.Info("kubelet serving CSR approved")
	}
	a.metrics.CSRDecision(decision, reason)
}

func decided(csr *certificatesv1.CertificateSigningRequest) bool {
	return slices.ContainsFunc(csr.Status.Conditions, func(c certificatesv1.CertificateSigningRequestCondition) bool {
		return c.Type == certificatesv1.CertificateApproved || c.Type == certificatesv1.CertificateDenied || c.Type == certificatesv1.CertificateFailed
	})
}

// verify returns nil for a request to approve, a *denial, or an error wrapping errNotYet.
func (a *Approver) verify(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) error {
	name, ok := strings.CutPrefix(csr.Spec.Username, nodeUserPrefix)
	if !ok || name == "" || !slices.Contains(csr.Spec.Groups, nodesGroup) {
		return deny(ReasonNotANode, "requester %q is not a node (system:node:NAME in group system:nodes)", csr.Spec.Username)
	}
	if a.recordNamespace != "" {
		ms, err := machines.Read(ctx, a.client, a.recordNamespace)
		switch {
		case errors.Is(err, machines.ErrNoRecord):
		case err != nil:
			return fmt.Errorf("%w: %w", errNotYet, err)
		case slices.Contains(machines.RevokedNodes(ms), name):
			return deny(ReasonRevoked, "node %s was removed from the cluster (berth node remove); berth node readmit re-admits it", name)
		}
	}
	block, _ := pem.Decode(csr.Spec.Request)
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return deny(ReasonBadRequest, "the request is not a PEM CERTIFICATE REQUEST")
	}
	req, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return deny(ReasonBadRequest, "the request does not parse: %v", err)
	}
	if err := req.CheckSignature(); err != nil {
		return deny(ReasonBadRequest, "the request's signature does not verify: %v", err)
	}
	if req.Subject.CommonName != csr.Spec.Username || !slices.Equal(req.Subject.Organization, []string{nodesGroup}) {
		return deny(ReasonSubject, "subject CN=%q O=%q, want CN=%q O=[%s]", req.Subject.CommonName, req.Subject.Organization, csr.Spec.Username, nodesGroup)
	}
	if !servingUsages(csr.Spec.Usages) {
		return deny(ReasonUsages, "usages %v, want digital signature (and key encipherment) and server auth", csr.Spec.Usages)
	}
	if len(req.EmailAddresses) > 0 || len(req.URIs) > 0 {
		return deny(ReasonNames, "the request names e-mail addresses or URIs")
	}
	for _, dns := range req.DNSNames {
		if dns != name {
			return deny(ReasonNames, "DNS name %q is not the node's name %q", dns, name)
		}
	}
	peers, err := a.meta.Peers(ctx)
	if err != nil {
		return fmt.Errorf("%w: asking the platform for its instances: %w", errNotYet, err)
	}
	i := slices.IndexFunc(peers, func(p metadata.Instance) bool { return p.Name == name })
	if i < 0 {
		return deny(ReasonUnknownNode, "the platform knows no instance %q", name)
	}
	for _, ip := range req.IPAddresses {
		if !slices.ContainsFunc(peers[i].IPs, func(s string) bool { return net.ParseIP(s).Equal(ip) }) {
			return deny(ReasonAddresses, "IP address %s is not one of instance %s's addresses %v", ip, name, peers[i].IPs)
		}
	}
	if _, err := a.client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{}); err != nil {
		return fmt.Errorf("%w: reading Node %s: %w", errNotYet, name, err)
	}
	return nil
}

// servingUsages: digital signature and server auth, optionally key encipherment, nothing else.
func servingUsages(u []certificatesv1.KeyUsage) bool {
	has := map[certificatesv1.KeyUsage]bool{}
	for _, x := range u {
		switch x {
		case certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth, certificatesv1.UsageKeyEncipherment:
			has[x] = true
		default:
			return false
		}
	}
	return has[certificatesv1.UsageDigitalSignature] && has[certificatesv1.UsageServerAuth]
}
