package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/apply"
)

func manifests(t *testing.T, args ...string) ([]*unstructured.Unstructured, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	cmd := NewRootCmd()
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(append([]string{"manifests"}, args...))
	if err := cmd.Execute(); err != nil {
		t.Fatalf("berth manifests %v: %v\n%s", args, err, errOut.String())
	}
	objs, err := apply.Decode(out.Bytes())
	if err != nil {
		t.Fatalf("decoding the output: %v\n%s", err, out.String())
	}
	return objs, out.String(), errOut.String()
}

func kinds(objs []*unstructured.Unstructured) []string {
	var ks []string
	for _, o := range objs {
		ks = append(ks, o.GetKind()+"/"+o.GetName())
	}
	return ks
}

// TestManifests: berth-system's objects, then the webhook's, with the images given; what init makes is
// left out and named on stderr, never printed.
func TestManifests(t *testing.T) {
	objs, out, notes := manifests(t, "--joinservice-image", "berth.local/joinservice:dev", "--webhook-image", "berth.local/berth-webhook:dev",
		"--image-pull-policy", "Never", "--joinservice-env", "BERTH_ATTESTATION=tpm,BERTH_TPM=unix:/run/swtpm/sock")
	got := kinds(objs)
	for _, want := range []string{"Namespace/berth-system", "RuntimeClass/berth-host", "Role/berth:joinservice", "DaemonSet/berth-joinservice",
		"Deployment/berth-webhook", "ValidatingWebhookConfiguration/berth-image-policy", "Secret/berth-cluster-secrets"} {
		if !slices.Contains(got, want) {
			t.Errorf("no %s in %v", want, got)
		}
	}
	if slices.Index(got, "Namespace/berth-system") != 0 || slices.Index(got, "DaemonSet/berth-joinservice") > slices.Index(got, "Deployment/berth-webhook") {
		t.Errorf("order %v: berth-system's objects, namespace first, then the webhook's", got)
	}
	for _, o := range objs {
		if o.GetKind() == "Secret" && o.Object["data"] != nil {
			t.Errorf("Secret %s printed with data", o.GetName())
		}
		if o.GetKind() == "DaemonSet" {
			c, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			if img := c[0].(map[string]any)["image"]; img != "berth.local/joinservice:dev" {
				t.Errorf("joinservice image %v", img)
			}
			vols, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "volumes")
			if !strings.Contains(toJSON(t, vols), `"path":"/run/swtpm"`) {
				t.Errorf("the TPM socket's directory is not mounted: %s", toJSON(t, vols))
			}
		}
	}
	for _, want := range []string{"Secret berth-system/berth-cluster-secrets without its data", "clusterID", "without caBundle"} {
		if !strings.Contains(notes, want) {
			t.Errorf("stderr does not say %q:\n%s", want, notes)
		}
	}
	if strings.Contains(out, "note:") {
		t.Error("notes on stdout")
	}

	// Without a webhook image, no webhook.
	objs, _, _ = manifests(t, "--webhook-image", "")
	for _, k := range kinds(objs) {
		if strings.Contains(k, "berth-webhook") || strings.Contains(k, "berth-image-policy") {
			t.Errorf("%s without a webhook image", k)
		}
	}
}

// TestManifestsConfig: the init config's Kubernetes version pins Pod Security, and its policies are in
// the join configuration and the webhook's policy, the attestation policy with its files inlined.
func TestManifestsConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("root.pem", "-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n")
	write("policy.yaml", "variant: tpm\ntrustRoots:\n  - file: root.pem\n")
	write("images.yaml", "rules: []\n")
	write("init.yaml", "kubernetesVersion: v1.36.3\nattestationPolicyFile: policy.yaml\ncomponents:\n  imagePolicyFile: images.yaml\n")
	objs, _, notes := manifests(t, "--config", filepath.Join(dir, "init.yaml"), "-o", "json")
	for _, o := range objs {
		switch o.GetKind() + "/" + o.GetName() {
		case "Namespace/berth-system":
			if v := o.GetLabels()["pod-security.kubernetes.io/enforce-version"]; v != "v1.36" {
				t.Errorf("enforce-version %q, want v1.36", v)
			}
		case "ConfigMap/berth-join-config":
			data, _, _ := unstructured.NestedStringMap(o.Object, "data")
			if p := data["attestationPolicy"]; !strings.Contains(p, "pem:") || strings.Contains(p, "file:") {
				t.Errorf("attestation policy %q, want the trust root inlined", p)
			}
			if data["kubernetesVersion"] != "v1.36.3" {
				t.Errorf("join configuration %v", data)
			}
		case "ConfigMap/berth-webhook-policy":
			data, _, _ := unstructured.NestedStringMap(o.Object, "data")
			if data["policy.yaml"] != "rules: []\n" {
				t.Errorf("webhook policy %v", data)
			}
		}
	}
	if strings.Contains(notes, "attestationPolicy") {
		t.Errorf("the attestation policy is named as left out:\n%s", notes)
	}
}

func TestManifestsUsage(t *testing.T) {
	for _, args := range [][]string{
		{"-o", "text"},
		{"--image-pull-policy", "Sometimes"},
		{"--joinservice-image", ""},
		{"--config", "/nonexistent/init.yaml"},
		{"extra"},
	} {
		if code := Execute(context.Background(), append([]string{"manifests"}, args...), &bytes.Buffer{}, &bytes.Buffer{}); code != exitUsage {
			t.Errorf("berth manifests %v: exit %d, want %d (usage)", args, code, exitUsage)
		}
	}
}

// TestManifestsApply applies the printed objects to a real API server, as kubectl apply -f would.
func TestManifestsApply(t *testing.T) {
	env := apiservertest.Shared(t)
	objs, _, _ := manifests(t, "--joinservice-env", "BERTH_TPM=unix:/run/swtpm/sock")
	a, err := apply.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Apply(context.Background(), objs...); err != nil {
		t.Fatalf("applying the manifests: %v", err)
	}
}

func toJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
