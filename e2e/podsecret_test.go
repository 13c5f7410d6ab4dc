//go:build e2e

package e2e

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// podSecretPaths are the places on a node where a Secret passed to a pod shows up in plaintext, as
// the node's own (decrypted) mounts show them: containerd's metadata (the container's environment),
// the kubelet's secret volume and the pod's log. The control search must find the marker in each.
var podSecretPaths = map[string]string{
	"containerd's root":      "/var/lib/containerd/",
	"the kubelet's volumes":  "/var/lib/kubelet/pods/",
	"the pod's log":          "/var/log/pods/",
	"containerd's run state": "/run/containerd/",
}

// checkPodSecretAtRest passes a Secret holding a random marker to a pod on node, as an environment
// variable (of both its containers) and as a volume (of the running one), and lets the pod's init
// container print it (so it is also in the pod's log). Then, while the pod runs:
//  1. control: searching the node's files through its own mount namespace finds the marker in
//     containerd's metadata, the secret volume and the pod log (the search can see plaintext);
//  2. the marker, raw and base64, is in no file under the cluster directory on the host: state disk
//     images (their raw bytes), containerd, kubelet and CNI directories, logs, TPM state.
func checkPodSecretAtRest(t testing.TB, c *cluster, node string) {
	t.Helper()
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	marker := "berth-pod-secret-" + hex.EncodeToString(b)
	c.kube("create", "secret", "generic", "pod-secret-marker", "-n", "default", "--from-literal=value="+marker)
	manifest := `apiVersion: v1
kind: Pod
metadata: {name: pod-secret-marker, namespace: default}
spec:
  nodeName: ` + node + `
  tolerations: [{operator: Exists}]
  initContainers:
  - name: echo
    image: berth.local/testapp:v1
    imagePullPolicy: Never
    args: [echo, "secret=$(MARKER)"]
    env: [{name: MARKER, valueFrom: {secretKeyRef: {name: pod-secret-marker, key: value}}}]
  containers:
  - name: serve
    image: berth.local/testapp:v1
    imagePullPolicy: Never
    args: [serve]
    env: [{name: MARKER, valueFrom: {secretKeyRef: {name: pod-secret-marker, key: value}}}]
    volumeMounts: [{name: secret, mountPath: /secret, readOnly: true}]
    readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 2}
  volumes:
  - {name: secret, secret: {secretName: pod-secret-marker}}
`
	f := filepath.Join(t.TempDir(), "pod-secret.yaml")
	if err := os.WriteFile(f, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	c.kube("apply", "-f", f)
	defer func() {
		c.kube("delete", "pod", "pod-secret-marker", "-n", "default", "--wait=false")
		c.kube("delete", "secret", "pod-secret-marker", "-n", "default")
	}()
	// Running (not finished): the kubelet keeps the secret volume mounted only while the pod runs.
	c.kube("wait", "--for=condition=Ready", "pod/pod-secret-marker", "--timeout=120s")
	if logs := c.kube("logs", "pod-secret-marker", "-c", "echo"); !strings.Contains(logs, "secret="+marker) {
		t.Fatalf("the pod did not print the Secret's value: %q", logs)
	}

	// 1. Control: the node's own view (its mount namespace: the opened state disk, its tmpfs mounts).
	start := time.Now()
	ns := "--mount=" + filepath.Join(c.dir, "ns", node+".mnt")
	args := []string{ns, "--", "grep", "-rlaF", "-D", "skip", "--exclude-dir=rootfs", "-e", marker}
	for _, p := range podSecretPaths {
		args = append(args, p)
	}
	// grep exits 1 when nothing matches and 2 when some file could not be read; the list decides.
	out, err := c.run(5*time.Minute, "nsenter", args...)
	found := strings.Fields(out)
	t.Logf("pod Secret through %s's mounts (%.1fs, grep: %v): %d files:\n%s", node, time.Since(start).Seconds(), err, len(found), out)
	for name, prefix := range podSecretPaths {
		if name == "containerd's run state" {
			continue // tmpfs; listed for the record only
		}
		hit := false
		for _, p := range found {
			hit = hit || strings.HasPrefix(p, prefix)
		}
		if !hit {
			t.Errorf("control: the Secret's marker is not in %s (%s) through %s's mounts: the search cannot see it there", name, prefix, node)
		}
	}

	// 2. Nothing of it in the host's backing files.
	needles := map[string][]byte{
		"marker":          []byte(marker),
		"marker (base64)": []byte(base64.StdEncoding.EncodeToString([]byte(marker))),
	}
	start = time.Now()
	hits, scanned := searchTree(t, c.dir, map[string]bool{
		filepath.Join(c.dir, "master-secret.json"): true, filepath.Join(c.dir, "init-secret"): true,
	}, needles)
	t.Logf("pod Secret at rest: searched %d MiB of the cluster's host files in %.1fs", scanned>>20, time.Since(start).Seconds())
	for name, files := range hits {
		sort.Strings(files)
		for i, p := range files {
			if r, err := filepath.Rel(c.dir, p); err == nil {
				files[i] = r
			}
		}
		t.Errorf("the pod's Secret (%s) is in plaintext in host-side files of the cluster: %s", name, strings.Join(files, " "))
	}
}
