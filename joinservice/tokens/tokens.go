// Package tokens creates short-lived kubeadm bootstrap tokens: Secrets of type
// bootstrap.kubernetes.io/token in kube-system, which the API server accepts for TLS bootstrap and
// kubeadm join's discovery, and which the token cleaner deletes once they expire. The joinservice
// needs them only for control-plane joins: worker tickets carry no token (see joinservice/server).
package tokens

import (
	"context"
	"crypto/rand"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Group is the group kubeadm's RBAC lets join nodes with.
const Group = "system:bootstrappers:kubeadm:default-node-token"

// Issuer creates bootstrap tokens.
type Issuer struct {
	client kubernetes.Interface
	now    func() time.Time
}

// New returns an Issuer that writes through client.
func New(client kubernetes.Interface) *Issuer { return &Issuer{client: client, now: time.Now} }

// Token is a created bootstrap token.
type Token struct {
	// Value is "<id>.<secret>".
	Value   string
	Expires time.Time
}

const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

func randomString(n int) (string, error) {
	buf := make([]byte, n)
	if _, err := rand.Read(buf); err != nil {
		return "", err
	}
	for i, b := range buf {
		buf[i] = alphabet[int(b)%len(alphabet)]
	}
	return string(buf), nil
}

// Create creates a token valid for ttl, described for the node it is for.
func (i *Issuer) Create(ctx context.Context, ttl time.Duration, description string) (Token, error) {
	id, err := randomString(6)
	if err != nil {
		return Token{}, fmt.Errorf("generating token ID: %w", err)
	}
	secret, err := randomString(16)
	if err != nil {
		return Token{}, fmt.Errorf("generating token secret: %w", err)
	}
	expires := i.now().Add(ttl).UTC()
	obj := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "bootstrap-token-" + id, Namespace: metav1.NamespaceSystem},
		Type:       corev1.SecretTypeBootstrapToken,
		StringData: map[string]string{
			"description":                    description,
			"token-id":                       id,
			"token-secret":                   secret,
			"expiration":                     expires.Format(time.RFC3339),
			"usage-bootstrap-authentication": "true",
			"usage-bootstrap-signing":        "true",
			"auth-extra-groups":              Group,
		},
	}
	if _, err := i.client.CoreV1().Secrets(metav1.NamespaceSystem).Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		return Token{}, fmt.Errorf("creating bootstrap token: %w", err)
	}
	return Token{Value: id + "." + secret, Expires: expires}, nil
}
