package apiservertest

import (
	"context"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestStart(t *testing.T) {
	e := Start(t)
	ns, err := e.Client(t, AdminUser).CoreV1().Namespaces().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ns.Items) == 0 {
		t.Fatal("no namespaces")
	}
	_, err = e.Client(t, JoinServiceUser).CoreV1().Secrets("kube-system").List(context.Background(), metav1.ListOptions{})
	if err == nil {
		t.Fatal("the joinservice user may list secrets without RBAC")
	}
}
