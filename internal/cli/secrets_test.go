package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsstate"
)

func kmsConfigMap(t *testing.T, spec kmsstate.Spec, nodes map[string]kmsstate.NodeStatus) *corev1.ConfigMap {
	t.Helper()
	data := map[string]string{}
	b, _ := json.Marshal(spec)
	data[kmsstate.KeySpec] = string(b)
	for n, ns := range nodes {
		b, _ := json.Marshal(ns)
		data[kmsstate.NodeKeyPrefix+n] = string(b)
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kmsstate.ConfigMapName, Namespace: joinconfig.Namespace}, Data: data}
}

// The encryption section of berth status: one line per control plane, an old report makes its plugin
// unhealthy, a keeper's message is escaped, a rotation in progress is named.
func TestEncryptionSection(t *testing.T) {
	now := time.Now().UTC()
	client := fake.NewClientset(kmsConfigMap(t, kmsstate.Spec{Generations: []uint32{1, 2}, Active: 2}, map[string]kmsstate.NodeStatus{
		"cp1": {Generations: []uint32{1, 2}, Active: 2, Healthy: true, ActiveKeyID: "berth:g2:00112233aabbccdd", EncryptKeyID: "berth:g2:00112233aabbccdd", Updated: now},
		"cp2": {Generations: []uint32{1}, Active: 1, Healthy: true, ActiveKeyID: "berth:g1:ffeeddccbbaa9988", Message: "waiting\x1b[2J", Updated: now.Add(-10 * time.Minute)},
	}))
	r, err := readEncryption(context.Background(), client, now)
	if err != nil {
		t.Fatal(err)
	}
	if r.Healthy || !r.Rotating || len(r.ControlPlanes) != 2 || !r.ControlPlanes[0].Healthy || r.ControlPlanes[1].Healthy {
		t.Fatalf("report = %+v", r)
	}
	var out bytes.Buffer
	printEncryption(&out, r, now)
	text := out.String()
	t.Log("\n" + text)
	for _, want := range []string{"Encryption at rest (secrets through the KMS v2 plugin berth): UNHEALTHY", "rotation in progress (generations [1 2], active 2)",
		"cp1   healthy    berth:g2:00112233aabbccdd", "cp2   UNHEALTHY", `waiting\x1b[2J; no report for 10m0s`} {
		if !strings.Contains(text, want) {
			t.Errorf("section lacks %q", want)
		}
	}
	if strings.Contains(text, "\x1b") {
		t.Error("a keeper's message reaches the terminal unescaped")
	}

	// Nothing reported yet: said so, not healthy.
	r, err = readEncryption(context.Background(), fake.NewClientset(), now)
	if err != nil {
		t.Fatal(err)
	}
	out.Reset()
	printEncryption(&out, r, now)
	if r.Healthy || !strings.Contains(out.String(), "No control plane has reported") || !strings.Contains(out.String(), "key generation 1") {
		t.Errorf("empty cluster:\n%s", out.String())
	}
}

// The -o json field names of both secrets commands are the documented, stable ones.
func TestSecretsJSONFields(t *testing.T) {
	for _, c := range []struct {
		v    any
		keys []string
	}{
		{encryptionReport{}, []string{"provider", "resources", "apiServerCheck", "healthy", "generations", "active", "rotating", "controlPlanes"}},
		{rotateReport{}, []string{"from", "to", "fromKeyIDs", "toKeyID", "controlPlanes", "rewritten", "scans", "objects", "notEncrypted", "tookSeconds"}},
	} {
		v, keys := c.v, c.keys
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			if _, ok := m[k]; !ok {
				t.Errorf("%T -o json lacks %q", v, k)
			}
		}
	}
}
