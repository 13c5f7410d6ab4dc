package clusterconfig

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "write REFERENCE.md, clusterconfig.schema.json and featuregates.tsv (make clusterconfig-docs)")

// TestReferenceCurrent: REFERENCE.md and clusterconfig.schema.json are what the types generate,
// featuregates.tsv what the pinned k8s.io/kubernetes registers (`make clusterconfig-docs`
// rewrites them; `make check-generate` runs this test).
func TestReferenceCurrent(t *testing.T) {
	ref, err := Reference()
	if err != nil {
		t.Fatal(err)
	}
	schema, err := Schema()
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string][]byte{"REFERENCE.md": ref, "clusterconfig.schema.json": schema, "featuregates.tsv": generatedFeatureGates(t)} {
		if *update {
			if err := os.WriteFile(name, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		have, err := os.ReadFile(name)
		if err != nil || !bytes.Equal(have, want) {
			t.Errorf("%s is stale (%v): run make clusterconfig-docs and commit it", name, err)
		}
	}
}

// TestReferenceCoversEveryField: every JSON field of every type in the configuration has a row in
// the reference and a property in the schema.
func TestReferenceCoversEveryField(t *testing.T) {
	ref, err := Reference()
	if err != nil {
		t.Fatal(err)
	}
	schemaJSON, err := Schema()
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Defs map[string]struct {
			Properties map[string]any `json:"properties"`
		} `json:"$defs"`
	}
	if err := json.Unmarshal(schemaJSON, &schema); err != nil {
		t.Fatal(err)
	}
	for typ, fields := range map[string][]string{
		"ClusterConfiguration":  {"apiVersion", "kind", "clusterName", "kubernetesVersion", "networking", "apiServer", "controllerManager", "scheduler", "featureGates", "patches", "kubelet", "kubeProxy", "components", "policies", "initSecretFile"},
		"APIServer":             {"extraArgs", "extraVolumes", "certSANs", "audit", "oidc", "admission"},
		"Audit":                 {"policy", "logPath", "maxAge", "maxBackups", "maxSize"},
		"OIDC":                  {"issuerURL", "clientID", "usernameClaim", "usernamePrefix", "groupsClaim", "groupsPrefix", "caFile", "requiredClaims"},
		"Admission":             {"enablePlugins", "disablePlugins", "plugins"},
		"HostPathMount":         {"name", "hostPath", "mountPath", "readOnly", "pathType"},
		"Patch":                 {"target", "type", "patch"},
		"Policies":              {"attestationPolicyFile", "imagePolicyFile", "joinPolicyFile"},
		"ControlPlaneComponent": {"extraArgs", "extraVolumes"},
	} {
		if !strings.Contains(string(ref), "\n## "+typ+"\n") {
			t.Errorf("the reference has no section %s", typ)
		}
		for _, f := range fields {
			if _, ok := schema.Defs[typ].Properties[f]; !ok {
				t.Errorf("the schema's %s has no property %s", typ, f)
			}
		}
	}
	if strings.Contains(string(ref), "initSecret |") || strings.Contains(string(schemaJSON), `"initSecret"`) {
		t.Error("the in-memory initSecret is documented")
	}
}
