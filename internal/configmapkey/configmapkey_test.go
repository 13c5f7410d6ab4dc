package configmapkey

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

var (
	ref    = Ref{Namespace: "ns", Name: "record", Key: "data", Labels: map[string]string{"app.kubernetes.io/part-of": "berth"}}
	atOnce = wait.Backoff{Steps: 4}
)

func appendLine(line string) func(string) (string, error) {
	return func(v string) (string, error) { return v + line + "\n", nil }
}

func TestUpdateCreatesThenChanges(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	cm, err := Update(ctx, client, ref, atOnce, appendLine("a"))
	if err != nil {
		t.Fatalf("Update on no ConfigMap: %v", err)
	}
	if cm.Data[ref.Key] != "a\n" || !maps.Equal(cm.Labels, ref.Labels) {
		t.Fatalf("created ConfigMap: data %q, labels %v; want %q and %v", cm.Data[ref.Key], cm.Labels, "a\n", ref.Labels)
	}
	// An existing ConfigMap keeps its labels and other keys.
	cm.Labels = map[string]string{"owner": "someone"}
	cm.Data["other"] = "kept"
	if _, err := client.CoreV1().ConfigMaps(ref.Namespace).Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	cm, err = Update(ctx, client, ref, atOnce, appendLine("b"))
	if err != nil {
		t.Fatalf("Update: %v", err)
	}
	want := map[string]string{ref.Key: "a\nb\n", "other": "kept"}
	if !maps.Equal(cm.Data, want) || cm.Labels["owner"] != "someone" || len(cm.Labels) != 1 {
		t.Fatalf("updated ConfigMap: data %v, labels %v; want data %v and its own labels", cm.Data, cm.Labels, want)
	}
}

// conflicting makes the first n writes of verb fail as if another writer had got in first.
func conflicting(client *fake.Clientset, verb string, n int) *int {
	writes := 0
	client.PrependReactor(verb, "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		if writes++; writes > n {
			return false, nil, nil
		}
		gr := schema.GroupResource{Resource: "configmaps"}
		if verb == "create" {
			return true, nil, apierrors.NewAlreadyExists(gr, ref.Name)
		}
		return true, nil, apierrors.NewConflict(gr, ref.Name, errors.New("the object has been modified"))
	})
	return &writes
}

func TestUpdateStartsOverWhenAnotherWriterWon(t *testing.T) {
	for _, verb := range []string{"update", "create"} {
		t.Run(verb, func(t *testing.T) {
			ctx := context.Background()
			client := fake.NewClientset()
			if verb == "update" {
				if _, err := Update(ctx, client, ref, atOnce, appendLine("first")); err != nil {
					t.Fatal(err)
				}
			}
			conflicting(client, verb, 2)
			calls := 0
			cm, err := Update(ctx, client, ref, atOnce, func(v string) (string, error) {
				calls++
				return v + "x\n", nil
			})
			if err != nil {
				t.Fatalf("Update after two lost races: %v", err)
			}
			if calls != 3 {
				t.Errorf("change called %d times, want 3 (once a round)", calls)
			}
			if got := cm.Data[ref.Key]; !strings.HasSuffix(got, "x\n") || strings.Count(got, "x") != 1 {
				t.Errorf("written value %q, want one x appended", got)
			}
		})
	}
}

func TestUpdateGivesUpAfterTheBackoffSteps(t *testing.T) {
	client := fake.NewClientset()
	writes := conflicting(client, "create", 100)
	_, err := Update(context.Background(), client, ref, atOnce, appendLine("x"))
	if !apierrors.IsAlreadyExists(err) || !strings.Contains(err.Error(), "after 4 attempts") {
		t.Fatalf("Update losing every race = %v, want the AlreadyExists after 4 attempts", err)
	}
	if *writes != atOnce.Steps {
		t.Fatalf("%d writes, want %d", *writes, atOnce.Steps)
	}
}

func TestUpdateStopsAtOtherErrors(t *testing.T) {
	t.Run("change", func(t *testing.T) {
		client := fake.NewClientset()
		errBad := errors.New("unreadable record")
		_, err := Update(context.Background(), client, ref, atOnce, func(string) (string, error) { return "", errBad })
		if !errors.Is(err, errBad) || errors.Unwrap(err) != nil {
			t.Fatalf("Update = %v, want change's error itself", err)
		}
		for _, a := range client.Actions() {
			if a.GetVerb() != "get" {
				t.Errorf("Update with a failing change made a %s", a.GetVerb())
			}
		}
	})
	for _, verb := range []string{"get", "update"} {
		t.Run(verb, func(t *testing.T) {
			ctx := context.Background()
			client := fake.NewClientset()
			if _, err := Update(ctx, client, ref, atOnce, appendLine("a")); err != nil {
				t.Fatal(err)
			}
			client.ClearActions()
			client.PrependReactor(verb, "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "configmaps"}, ref.Name, errors.New("no"))
			})
			_, err := Update(ctx, client, ref, atOnce, appendLine("b"))
			if !apierrors.IsForbidden(err) {
				t.Fatalf("Update = %v, want the Forbidden", err)
			}
			if n := len(client.Actions()); n > 2 {
				t.Fatalf("%d requests, want one round: a Forbidden is not retried", n)
			}
		})
	}
}
