package k8sversion

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestDefault(t *testing.T) {
	d := Default()
	want := Release{Kubernetes: "v1.37.2", Etcd: "3.7.0", CoreDNS: "v1.14.6", Pause: "3.10.2"}
	if d != want {
		t.Fatalf("Default() = %+v, want %+v", d, want)
	}
	if d.Minor() != "v1.37" {
		t.Errorf("Minor() = %q, want v1.37", d.Minor())
	}
	im := d.Images()
	if im.Etcd != "registry.k8s.io/etcd:3.7.0-0" || im.KubeProxy != "registry.k8s.io/kube-proxy:v1.37.2" ||
		im.CoreDNS != "registry.k8s.io/coredns/coredns:v1.14.6" || im.Pause != "registry.k8s.io/pause:3.10.2" {
		t.Errorf("Images() = %+v", im)
	}
}

func TestLookup(t *testing.T) {
	for _, v := range []string{"v1.36.3", "v1.36"} {
		r, err := Lookup(v)
		if err != nil || r.Kubernetes != "v1.36.3" || r.Etcd != "3.6.8" || r.CoreDNS != "v1.14.2" {
			t.Errorf("Lookup(%q) = %+v, %v; want v1.36.3 with etcd 3.6.8, CoreDNS v1.14.2", v, r, err)
		}
	}
	if r, err := Lookup(""); err != nil || r != Default() {
		t.Errorf(`Lookup("") = %+v, %v; want the default`, r, err)
	}
	for _, v := range []string{"v1.34.2", "v1.35", "1.37.2", "v1.37.1", "v1.3", "latest", "v1.37.2\x1b[31m"} {
		_, err := Lookup(v)
		if !errors.Is(err, ErrUnsupported) {
			t.Errorf("Lookup(%q) = %v, want ErrUnsupported", v, err)
			continue
		}
		for _, s := range []string{"v1.37.2", "v1.36.3", "v1.36"} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("Lookup(%q) error %q does not list %s", v, err, s)
			}
		}
		if strings.ContainsRune(err.Error(), '\x1b') {
			t.Errorf("Lookup(%q) error %q carries a control character", v, err)
		}
	}
}

func TestSupportedList(t *testing.T) {
	if got := SupportedList(); got != "v1.37.2 (default), v1.36.3" {
		t.Errorf("SupportedList() = %q", got)
	}
	s := Supported()
	s[0].Kubernetes = "changed"
	if Default().Kubernetes != "v1.37.2" {
		t.Error("Supported() hands out the table itself")
	}
}

func TestParseRejects(t *testing.T) {
	for name, in := range map[string]string{
		"empty":         "# only a comment\n",
		"three fields":  "v1.37.2\t3.7.0\tv1.14.6\n",
		"no v":          "1.37.2\t3.7.0\tv1.14.6\t3.10.2\n",
		"etcd with v":   "v1.37.2\tv3.7.0\tv1.14.6\t3.10.2\n",
		"leading zero":  "v1.37.02\t3.7.0\tv1.14.6\t3.10.2\n",
		"minor twice":   "v1.37.2\t3.7.0\tv1.14.6\t3.10.2\nv1.37.1\t3.7.0\tv1.14.6\t3.10.2\n",
		"coredns short": "v1.37.2\t3.7.0\tv1.14\t3.10.2\n",
		"spaces":        "v1.37.2 3.7.0 v1.14.6 3.10.2\n",
	} {
		if _, err := parse(in); err == nil {
			t.Errorf("%s: parse accepted %q", name, in)
		}
	}
}

// TestBuildScriptAgrees runs scripts/build-k8s.sh's version selection (an unsupported version fails
// before anything is built) and checks that every row has its build modules under build/.
func TestBuildScriptAgrees(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(root, "scripts", "build-k8s.sh")
	out, err := exec.Command(script, "--kubernetes-version", "v1.35", "k8s").CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("build-k8s.sh --kubernetes-version v1.35: %v, want exit status 2\n%s", err, out)
	}
	if want := "supported: v1.37.2, v1.36.3"; !strings.Contains(string(out), want) {
		t.Errorf("build-k8s.sh output %q does not contain %q", out, want)
	}
	list, err := exec.Command(script, "--supported").Output()
	if err != nil {
		t.Fatalf("build-k8s.sh --supported: %v", err)
	}
	if got, want := strings.Fields(string(list)), names(Release.String); !slices.Equal(got, want) {
		t.Errorf("build-k8s.sh --supported = %v, want %v", got, want)
	}
	for _, r := range Supported() {
		for _, dir := range []string{"k8s/" + r.Kubernetes, "etcd/" + r.Etcd, "coredns/" + r.CoreDNS} {
			mod, err := os.ReadFile(filepath.Join(root, "build", dir, "go.mod"))
			if err != nil {
				t.Errorf("%s: no build module: %v", r, err)
				continue
			}
			name, ver, _ := strings.Cut(dir, "/")
			wantReq := map[string]string{"k8s": "k8s.io/kubernetes " + ver, "etcd": "go.etcd.io/etcd/server/v3 v" + ver,
				"coredns": "github.com/coredns/coredns " + ver}[name]
			if !strings.Contains(string(mod), wantReq) {
				t.Errorf("build/%s/go.mod does not require %s", dir, wantReq)
			}
		}
	}
}
