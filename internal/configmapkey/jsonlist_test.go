package configmapkey

import (
	"context"
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

type item struct {
	Name string `json:"name"`
}

func TestReadList(t *testing.T) {
	ctx := context.Background()
	errNone := errors.New("no list yet")
	client := fake.NewClientset()
	if _, err := ReadList[item](ctx, client, ref, "list", errNone); !errors.Is(err, errNone) {
		t.Fatalf("missing ConfigMap: got %v, want %v", err, errNone)
	}
	value, err := EncodeList([]item{{"a"}, {"b"}}, "list")
	if err != nil {
		t.Fatal(err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ref.Namespace, Name: ref.Name}, Data: map[string]string{ref.Key: value}}
	if _, err := client.CoreV1().ConfigMaps(ref.Namespace).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := ReadList[item](ctx, client, ref, "list", errNone)
	if err != nil || len(got) != 2 || got[0].Name != "a" || got[1].Name != "b" {
		t.Fatalf("ReadList = %v, %v; want [a b]", got, err)
	}
}

func TestDecodeList(t *testing.T) {
	for _, blank := range []string{"", "  \n"} {
		if got, err := DecodeList[item](blank, "list"); err != nil || got != nil {
			t.Errorf("DecodeList(%q) = %v, %v; want an empty list", blank, got, err)
		}
	}
	_, err := DecodeList[item]("{not a list", "machine record")
	if err == nil || !strings.HasPrefix(err.Error(), "decoding machine record: ") {
		t.Errorf("malformed value: got %v, want an error naming the machine record", err)
	}
}
