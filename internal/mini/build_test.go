package mini

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeScript writes an executable shell script.
func writeScript(t *testing.T, path, body string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
}

// BuildBins passes the Kubernetes version, the components and the cache to the script, maps its lines to Bins, and refuses
// a script that failed or printed another number of bin dirs.
func TestBuildBins(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "build.sh")
	writeScript(t, script, `echo "building $* in $BERTH_CACHE" >&2
[ "$1" = --kubernetes-version ] || exit 2
v=$2; shift 2
for c in "$@"; do echo "$BERTH_CACHE/$c-$v/bin"; echo; done
`)
	var log strings.Builder
	bins, err := BuildBins(t.Context(), script, "/cache", "v1.36.3", &log)
	if err != nil {
		t.Fatal(err)
	}
	want := Bins{K8s: "/cache/k8s-v1.36.3/bin", Etcd: "/cache/etcd-v1.36.3/bin", CoreDNS: "/cache/coredns-v1.36.3/bin",
		Flannel: "/cache/flannel-v1.36.3/bin", PodBin: "/cache/podbin-v1.36.3/bin"}
	if bins != want {
		t.Errorf("BuildBins() = %+v, want %+v", bins, want)
	}
	if log.String() != "building --kubernetes-version v1.36.3 k8s etcd coredns flannel podbin in /cache\n" {
		t.Errorf("the script's progress = %q", log.String())
	}
	for name, body := range map[string]string{
		"fails":          "echo broken >&2; exit 1\n",
		"too few lines":  "echo /a; echo /b\n",
		"too many lines": "for i in 1 2 3 4 5 6; do echo /$i; done\n",
	} {
		writeScript(t, script, body)
		if _, err := BuildBins(t.Context(), script, "/cache", "v1.37.2", &log); err == nil || !strings.Contains(err.Error(), script) {
			t.Errorf("%s: BuildBins() = %v, want an error naming the script", name, err)
		}
	}
}

func TestDefaultBuildScript(t *testing.T) {
	root := t.TempDir()
	self := filepath.Join(root, "bin", "berth")
	if got := DefaultBuildScript(self); got != filepath.Join("scripts", "build-k8s.sh") {
		t.Errorf("without a checkout: %s", got)
	}
	if err := os.MkdirAll(filepath.Join(root, "scripts"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeScript(t, filepath.Join(root, "scripts", "build-k8s.sh"), "")
	if got := DefaultBuildScript(self); got != filepath.Join(root, "bin", "..", "scripts", "build-k8s.sh") {
		t.Errorf("in a checkout: %s", got)
	}
}

// Without a joinservice binary beside berth there is no archive of Berth's images, and a note says
// why.
func TestWriteBerthArchiveWithoutJoinService(t *testing.T) {
	dir := t.TempDir()
	var notes []string
	archive, cleanup, err := WriteBerthArchive(Config{}, filepath.Join(dir, "berth"), dir, func(s string) { notes = append(notes, s) })
	if err != nil || archive != "" || cleanup == nil {
		t.Fatalf("WriteBerthArchive() = %q, %v", archive, err)
	}
	cleanup()
	if len(notes) != 1 || !strings.Contains(notes[0], filepath.Join(dir, "joinservice")) {
		t.Errorf("notes = %q", notes)
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("left in the cache: %v", left)
	}
}
