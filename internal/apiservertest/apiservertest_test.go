package apiservertest

import (
	"context"
	"testing"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(StoppingShared(m)) }

func TestSharedUsersAndRBAC(t *testing.T) {
	e := Shared(t)
	if again := Shared(t); again != e {
		t.Fatal("Shared started a second Env")
	}
	ctx := context.Background()
	ns, err := e.Client(t, AdminUser).CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ns.Items) == 0 {
		t.Fatal("no namespaces")
	}
	if _, err := e.Client(t, JoinServiceUser).CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{}); err == nil {
		t.Fatal("the joinservice user may list secrets without RBAC")
	}
}

func TestInstallBerth(t *testing.T) {
	e := Shared(t)
	ctx := context.Background()
	if err := e.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	// The joinservice's Role lets it read its configuration and the cluster Secret.
	js := e.Client(t, JoinServiceUser)
	cm, err := js.CoreV1().ConfigMaps(joinconfig.Namespace).Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := joinconfig.DecodeConfig(cm.Data)
	if err != nil || string(cfg.AttestationPolicy) != "variant: tpm\n" || string(cfg.ClusterID) != string(ClusterID()) {
		t.Fatalf("join config %+v (%v), want the policy and ClusterID", cfg, err)
	}
	if _, err := js.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, joinconfig.SecretName, metav1.GetOptions{}); err != nil {
		t.Fatalf("the joinservice reading the cluster Secret: %v", err)
	}
	if err := e.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatalf("installing again: %v", err)
	}
}

func TestRestartKeepsData(t *testing.T) {
	e := Start(t, KeepDir(false), APIServerArgs("--enable-aggregator-routing=true"))
	ctx := context.Background()
	admin := e.Client(t, AdminUser)
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "survivor"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pids := e.PIDs()
	if err := e.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	if after := e.PIDs(); len(after) != 2 || after[0] == pids[0] || after[1] == pids[1] {
		t.Fatalf("PIDs %v before and %v after the restart, want two new processes", pids, after)
	}
	if _, err := admin.CoreV1().Namespaces().Get(ctx, "survivor", metav1.GetOptions{}); err != nil {
		t.Fatalf("after the restart: %v", err)
	}
}
