package leaderterm

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"
	"k8s.io/client-go/kubernetes/fake"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func config(client *fake.Clientset, identity string) Config {
	return Config{Client: client, Namespace: "berth-system", Name: "berth-test", Identity: identity,
		LeaseDuration: 2 * time.Second, RenewDeadline: time.Second, RetryPeriod: 200 * time.Millisecond}
}

// TestHandover: of two replicas one leads; when its context ends it releases the Lease, its term
// ends before Run returns, and the other replica leads next.
func TestHandover(t *testing.T) {
	client := fake.NewClientset()
	type term struct {
		who   string
		ended chan struct{}
	}
	terms := make(chan term, 4)
	run := func(ctx context.Context, who string, done chan<- error) {
		done <- Run(ctx, config(client, who), func(ctx context.Context) {
			tm := term{who: who, ended: make(chan struct{})}
			terms <- tm
			<-ctx.Done()
			close(tm.ended)
		})
	}
	ctxA, cancelA := context.WithCancel(t.Context())
	ctxB, cancelB := context.WithCancel(t.Context())
	defer cancelB()
	doneA, doneB := make(chan error, 1), make(chan error, 1)
	go run(ctxA, "a", doneA)
	first := <-terms
	if first.who != "a" {
		t.Fatalf("first leader %s, want a (it campaigned alone)", first.who)
	}
	go run(ctxB, "b", doneB)
	cancelA()
	if err := <-doneA; err != nil {
		t.Fatalf("Run of a = %v", err)
	}
	select {
	case <-first.ended:
	default:
		t.Fatal("Run of a returned before its term ended")
	}
	if second := <-terms; second.who != "b" {
		t.Fatalf("second leader %s, want b", second.who)
	}
	cancelB()
	if err := <-doneB; err != nil {
		t.Fatalf("Run of b = %v", err)
	}
	select {
	case tm := <-terms:
		t.Fatalf("an extra term of %s", tm.who)
	default:
	}
}

func TestRunRefusesAnIncompleteConfig(t *testing.T) {
	c := config(fake.NewClientset(), "")
	if err := Run(t.Context(), c, func(context.Context) {}); err == nil {
		t.Fatal("Run without an identity succeeded")
	}
	c = config(fake.NewClientset(), "a")
	c.RenewDeadline = c.LeaseDuration
	err := Run(t.Context(), c, func(context.Context) {})
	if err == nil || errors.Is(err, context.Canceled) {
		t.Fatalf("Run with RenewDeadline = LeaseDuration = %v, want client-go's refusal", err)
	}
}
