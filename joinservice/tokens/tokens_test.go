package tokens

import (
	"context"
	"regexp"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestCreate(t *testing.T) {
	client := fake.NewClientset()
	tok, err := New(client).Create(context.Background(), 15*time.Minute, "join of worker-0")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^[a-z0-9]{6}\.[a-z0-9]{16}$`).MatchString(tok.Value) {
		t.Fatalf("token %q does not have kubeadm's format", tok.Value)
	}
	s, err := client.CoreV1().Secrets("kube-system").Get(context.Background(), "bootstrap-token-"+tok.Value[:6], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Type != "bootstrap.kubernetes.io/token" || s.StringData["token-secret"] != tok.Value[7:] || s.StringData["auth-extra-groups"] != Group {
		t.Fatalf("secret = %+v", s)
	}
}
