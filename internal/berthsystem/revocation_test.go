package berthsystem_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"strings"
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/machines"
)

// kubeletWrites are the writes a kubelet makes, each as a dry run (admission runs in full, nothing
// is stored): register its Node, report its status, renew its Lease, give up its Lease, post an
// Event, ask for a client certificate.
func kubeletWrites(t *testing.T, node string, kubelet kubernetes.Interface) map[string]func(context.Context) error {
	t.Helper()
	dry := []string{metav1.DryRunAll}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: berthsystem.NodeUserPrefix + node, Organization: []string{"system:nodes"}}}, key)
	if err != nil {
		t.Fatal(err)
	}
	return map[string]func(context.Context) error{
		"register Node": func(ctx context.Context) error {
			_, err := kubelet.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{DryRun: dry})
			if apierrors.IsAlreadyExists(err) {
				return nil // admitted: storage found the Node registered (a deleted Node would be created)
			}
			return err
		},
		"patch Node status": func(ctx context.Context) error {
			_, err := kubelet.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, []byte(`{"status":{"conditions":[{"type":"Ready","status":"True"}]}}`),
				metav1.PatchOptions{DryRun: dry}, "status")
			return err
		},
		"renew Lease": func(ctx context.Context) error {
			_, err := kubelet.CoordinationV1().Leases(corev1.NamespaceNodeLease).Patch(ctx, node, types.MergePatchType,
				[]byte(`{"spec":{"renewTime":"2030-01-01T00:00:00.000000Z"}}`), metav1.PatchOptions{DryRun: dry})
			return err
		},
		"delete Lease": func(ctx context.Context) error {
			return kubelet.CoordinationV1().Leases(corev1.NamespaceNodeLease).Delete(ctx, node, metav1.DeleteOptions{DryRun: dry})
		},
		"post Event": func(ctx context.Context) error {
			_, err := kubelet.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, &corev1.Event{
				ObjectMeta:     metav1.ObjectMeta{Name: node + ".start"},
				InvolvedObject: corev1.ObjectReference{Kind: "Node", Name: node}, Reason: "Starting", Type: corev1.EventTypeNormal,
				Source: corev1.EventSource{Component: "kubelet", Host: node}}, metav1.CreateOptions{DryRun: dry})
			return err
		},
		"ask for a certificate": func(ctx context.Context) error {
			_, err := kubelet.CertificatesV1().CertificateSigningRequests().Create(ctx, &certificatesv1.CertificateSigningRequest{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "csr-"},
				Spec: certificatesv1.CertificateSigningRequestSpec{
					Request:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
					SignerName: certificatesv1.KubeAPIServerClientKubeletSignerName,
					Usages:     []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth},
				}}, metav1.CreateOptions{DryRun: dry})
			return err
		},
	}
}

// TestRevocationOnAPIServer runs the revocation policy in a real kube-apiserver that authorizes
// kubelets as a kubeadm cluster does (Node authorizer, NodeRestriction): while the machine record
// lists w2 as revoked, every write of w2's kubelet is refused, w1's are all allowed; without the
// policy the same list refuses nothing (so the refusals are the policy's); a re-admission lifts it.
func TestRevocationOnAPIServer(t *testing.T) {
	env := apiservertest.Start(t, apiservertest.Nodes("w1", "w2"))
	ctx := context.Background()
	admin := env.Client(t, apiservertest.AdminUser)
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	writes := map[string]map[string]func(context.Context) error{}
	for _, n := range []string{"w1", "w2"} {
		kubelet := env.Client(t, apiservertest.NodeUser(n))
		// Registered and leasing before the removal, as a running kubelet is.
		if _, err := kubelet.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("registering %s: %v", n, err)
		}
		holder := n
		if err := wait.PollUntilContextTimeout(ctx, policyPoll, policyLoad, true, func(ctx context.Context) (bool, error) {
			_, err := kubelet.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Name: n}, Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder}}, metav1.CreateOptions{})
			return err == nil, nil // kube-node-lease appears shortly after the API server starts
		}); err != nil {
			t.Fatalf("%s's Lease: %v", n, err)
		}
		writes[n] = kubeletWrites(t, n, kubelet)
	}
	setRevoked := func(revoked bool) {
		t.Helper()
		_, err := machines.Update(ctx, admin, joinconfig.Namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
			ms, _ = machines.Admit(ms, machines.Machine{Identity: "aa", Node: "w1", Role: machines.RoleWorker},
				machines.Machine{Identity: "bb", Node: "w2", Role: machines.RoleWorker})
			ms[machines.Index(ms, "bb")].Removal = nil
			if revoked {
				ms[machines.Index(ms, "bb")].Removal = &machines.Removal{}
			}
			return ms, nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// check runs every write of node and wants each refused by the policy, or each allowed.
	check := func(node string, refused bool) {
		t.Helper()
		for what, write := range writes[node] {
			err := write(ctx)
			byPolicy := apierrors.IsForbidden(err) && strings.Contains(err.Error(), berthsystem.RevocationName)
			switch {
			case refused && !byPolicy:
				t.Errorf("%s's kubelet: %s = %v, want refused by %s", node, what, err, berthsystem.RevocationName)
			case !refused && err != nil:
				t.Errorf("%s's kubelet: %s = %v, want allowed", node, what, err)
			}
		}
	}
	// waitW2 waits until the API server's view of the parameter makes w2's status refused or not.
	waitW2 := func(refused bool) {
		t.Helper()
		write := writes["w2"]["patch Node status"]
		if err := wait.PollUntilContextTimeout(ctx, policyPoll, policyLoad, true, func(ctx context.Context) (bool, error) {
			err := write(ctx)
			return (apierrors.IsForbidden(err) && strings.Contains(err.Error(), berthsystem.RevocationName)) == refused, nil
		}); err != nil {
			t.Fatalf("w2's status write refused = %v still %s after the change", !refused, policyLoad)
		}
	}

	// w2 revoked in the record, no policy: nothing is refused.
	setRevoked(true)
	check("w2", false)
	check("w1", false)

	policy, binding := berthsystem.Revocation()
	a, err := apply.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	for _, ac := range []any{policy, binding} {
		o, err := apply.Unstructured(ac)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Apply(ctx, o); err != nil {
			t.Fatalf("applying the revocation policy: %v", err)
		}
	}
	waitW2(true)
	check("w2", true)
	check("w1", false)
	err = writes["w2"]["renew Lease"](ctx)
	t.Logf("w2's kubelet renewing its Lease: %v", err)
	// The admin is not a node: its writes to w2's objects pass.
	if _, err := admin.CoreV1().Nodes().Patch(ctx, "w2", types.MergePatchType, []byte(`{"metadata":{"labels":{"removed":"yes"}}}`), metav1.PatchOptions{}); err != nil {
		t.Errorf("the admin labelling Node w2: %v", err)
	}

	// Re-admitted: w2 writes again.
	setRevoked(false)
	waitW2(false)
	check("w2", false)
	check("w1", false)
}
