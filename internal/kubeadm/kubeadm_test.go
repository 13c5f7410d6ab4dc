package kubeadm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/command/commandtest"
)

func validInit() InitParams {
	return InitParams{
		Node:                         NodeParams{Name: "cp-0", IP: "198.51.100.10", CRISocket: "unix:///run/containerd/containerd.sock", NeverPull: true},
		ControlPlaneEndpoint:         "198.51.100.10:6443",
		ClusterName:                  "berth",
		KubernetesVersion:            "v1.34.2",
		ServiceCIDR:                  "10.96.0.0/12",
		PodCIDR:                      "10.244.0.0/16",
		CertSANs:                     []string{"198.51.100.10"},
		CgroupDriver:                 "cgroupfs",
		KubeProxyMode:                "nftables",
		KubeProxyConntrackMaxPerCore: new(int32),
	}
}

func TestInitConfig(t *testing.T) {
	out, err := InitConfig(validInit())
	if err != nil {
		t.Fatal(err)
	}
	docs := strings.Split(string(out), "---\n")
	if len(docs) != 4 {
		t.Fatalf("got %d documents, want 4:\n%s", len(docs), out)
	}
	var initCfg struct {
		Kind             string
		LocalAPIEndpoint struct {
			AdvertiseAddress string
			BindPort         int
		}
		NodeRegistration struct {
			Name             string
			ImagePullPolicy  string
			Taints           []any
			KubeletExtraArgs []struct{ Name, Value string }
		}
	}
	if err := yaml.Unmarshal([]byte(docs[0]), &initCfg); err != nil {
		t.Fatal(err)
	}
	if initCfg.Kind != "InitConfiguration" || initCfg.LocalAPIEndpoint.AdvertiseAddress != "198.51.100.10" ||
		initCfg.LocalAPIEndpoint.BindPort != 6443 || initCfg.NodeRegistration.Name != "cp-0" ||
		initCfg.NodeRegistration.ImagePullPolicy != "Never" {
		t.Errorf("InitConfiguration = %+v", initCfg)
	}
	if a := initCfg.NodeRegistration.KubeletExtraArgs; len(a) != 1 || a[0].Name != "node-ip" || a[0].Value != "198.51.100.10" {
		t.Errorf("kubeletExtraArgs = %+v", a)
	}
	if !strings.Contains(string(out), "ttl: 1m0s") {
		t.Errorf("kubeadm's bootstrap token does not expire within a minute:\n%s", out)
	}
	for _, want := range []string{"kind: ClusterConfiguration", "kubernetesVersion: v1.34.2", "podSubnet: 10.244.0.0/16",
		"controlPlaneEndpoint: 198.51.100.10:6443", "kind: KubeletConfiguration", "cgroupDriver: cgroupfs", "rotateCertificates: true", "serverTLSBootstrap: true",
		"failCgroupV1: false", "mode: nftables", "maxPerCore: 0", "taints: null", "encryptionAlgorithm: ECDSA-P256"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("config lacks %q:\n%s", want, out)
		}
	}
}

// TestInitConfigAdmission: the admission configuration reaches the API server as a flag, and its
// directory as a read-only mount; without one, neither is there.
func TestInitConfigAdmission(t *testing.T) {
	p := validInit()
	p.AdmissionConfigFile = "/etc/kubernetes/berth/admission.yaml"
	out, err := InitConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	var cluster struct {
		Kind      string
		APIServer struct {
			ExtraArgs    []struct{ Name, Value string }
			ExtraVolumes []struct {
				Name, HostPath, MountPath, PathType string
				ReadOnly                            bool
			}
		}
	}
	if err := yaml.Unmarshal([]byte(strings.Split(string(out), "---\n")[1]), &cluster); err != nil {
		t.Fatal(err)
	}
	args := map[string]string{}
	for _, a := range cluster.APIServer.ExtraArgs {
		args[a.Name] = a.Value
	}
	if cluster.Kind != "ClusterConfiguration" || args["admission-control-config-file"] != p.AdmissionConfigFile ||
		args["enable-aggregator-routing"] != "true" {
		t.Errorf("API server arguments %v", cluster.APIServer.ExtraArgs)
	}
	if v := cluster.APIServer.ExtraVolumes; len(v) != 1 || v[0].HostPath != "/etc/kubernetes/berth" ||
		v[0].MountPath != "/etc/kubernetes/berth" || !v[0].ReadOnly || v[0].PathType != "Directory" {
		t.Errorf("API server volumes %+v", v)
	}
	// With the encryption configuration in the same directory, the directory is mounted once.
	p.Encryption = &Encryption{ConfigFile: "/etc/kubernetes/berth/encryption-config.yaml", SocketDir: "/run/berth/kms"}
	if out, err = InitConfig(p); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(out), "mountPath: /etc/kubernetes/berth\n"); n != 1 || !strings.Contains(string(out), "admission-control-config-file") {
		t.Errorf("/etc/kubernetes/berth mounted %d times:\n%s", n, out)
	}
	out, err = InitConfig(validInit())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "admission-control-config-file") || strings.Contains(string(out), "extraVolumes") {
		t.Errorf("admission configuration without one asked for:\n%s", out)
	}
}

func TestInitConfigInvalid(t *testing.T) {
	for name, mutate := range map[string]func(*InitParams){
		"no name":      func(p *InitParams) { p.Node.Name = "" },
		"bad ip":       func(p *InitParams) { p.Node.IP = "node" },
		"no socket":    func(p *InitParams) { p.Node.CRISocket = "" },
		"bad endpoint": func(p *InitParams) { p.ControlPlaneEndpoint = "198.51.100.10" },
		"bad port":     func(p *InitParams) { p.ControlPlaneEndpoint = "198.51.100.10:99999" },
		"bad pod cidr": func(p *InitParams) { p.PodCIDR = "10.244.0.0" },
		"no version":   func(p *InitParams) { p.KubernetesVersion = "" },
		"bad cgroups":  func(p *InitParams) { p.CgroupDriver = "cgroupv3" },
		"relative encryption config": func(p *InitParams) {
			p.Encryption = &Encryption{ConfigFile: "encryption.yaml", SocketDir: "/run/berth/kms"}
		},
		"relative socket dir": func(p *InitParams) {
			p.Encryption = &Encryption{ConfigFile: "/etc/kubernetes/berth/encryption-config.yaml", SocketDir: "run"}
		},
		"relative admission configuration": func(p *InitParams) { p.AdmissionConfigFile = "berth/admission.yaml" },
	} {
		t.Run(name, func(t *testing.T) {
			p := validInit()
			mutate(&p)
			if _, err := InitConfig(p); !errors.Is(err, ErrInvalidParams) {
				t.Fatalf("InitConfig() = %v, want ErrInvalidParams", err)
			}
		})
	}
}

// With Encryption the API server gets the flag and both mounts, in the ClusterConfiguration that
// kubeadm uploads for the control planes that join later; without it, neither.
func TestInitConfigEncryption(t *testing.T) {
	p := validInit()
	p.Encryption = &Encryption{ConfigFile: "/etc/kubernetes/berth/encryption-config.yaml", SocketDir: "/run/berth/kms"}
	out, err := InitConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	var cluster struct {
		Kind      string
		APIServer struct {
			ExtraArgs    []struct{ Name, Value string }
			ExtraVolumes []struct {
				Name, HostPath, MountPath, PathType string
				ReadOnly                            bool
			}
		} `json:"apiServer"`
	}
	if err := yaml.Unmarshal([]byte(strings.Split(string(out), "---\n")[1]), &cluster); err != nil {
		t.Fatal(err)
	}
	args := map[string]string{}
	for _, a := range cluster.APIServer.ExtraArgs {
		args[a.Name] = a.Value
	}
	if cluster.Kind != "ClusterConfiguration" || args["encryption-provider-config"] != "/etc/kubernetes/berth/encryption-config.yaml" ||
		args["enable-aggregator-routing"] != "true" {
		t.Errorf("API server args = %v", args)
	}
	vols := map[string]string{}
	for _, v := range cluster.APIServer.ExtraVolumes {
		vols[v.HostPath] = fmt.Sprintf("%s ro=%v %s", v.MountPath, v.ReadOnly, v.PathType)
	}
	if vols["/etc/kubernetes/berth"] != "/etc/kubernetes/berth ro=true DirectoryOrCreate" || vols["/run/berth/kms"] != "/run/berth/kms ro=false DirectoryOrCreate" {
		t.Errorf("API server volumes = %v", vols)
	}
	plain, err := InitConfig(validInit())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(plain), "encryption-provider-config") || strings.Contains(string(plain), "extraVolumes") {
		t.Errorf("without Encryption the config still encrypts:\n%s", plain)
	}
}

func TestJoinConfig(t *testing.T) {
	p := JoinParams{
		Node:              NodeParams{Name: "w-0", IP: "198.51.100.20", CRISocket: "unix:///c.sock", Untainted: true},
		APIServerEndpoint: "198.51.100.10:6443",
		Token:             "abcdef.0123456789abcdef",
		CACertHashes:      []string{"sha256:00"},
	}
	out, err := JoinConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: JoinConfiguration", "apiServerEndpoint: 198.51.100.10:6443", "taints: []", "name: w-0"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("config lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "controlPlane") {
		t.Errorf("worker config has a controlPlane section:\n%s", out)
	}
	p.ControlPlane = true
	out, _ = JoinConfig(p)
	if !strings.Contains(string(out), "advertiseAddress: 198.51.100.20") {
		t.Errorf("control-plane join lacks localAPIEndpoint:\n%s", out)
	}
	p.CACertHashes = nil
	if _, err := JoinConfig(p); !errors.Is(err, ErrInvalidParams) {
		t.Errorf("JoinConfig() without CA pin = %v, want ErrInvalidParams", err)
	}
}

func TestJoinConfigDiscoveryFile(t *testing.T) {
	p := JoinParams{
		Node:              NodeParams{Name: "w-0", IP: "198.51.100.20", CRISocket: "unix:///c.sock", Untainted: true},
		APIServerEndpoint: "198.51.100.10:6443",
		DiscoveryFile:     "/var/lib/berth/discovery.conf",
	}
	out, err := JoinConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kubeConfigPath: /var/lib/berth/discovery.conf", "name: w-0"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("config lacks %q:\n%s", want, out)
		}
	}
	for _, unwanted := range []string{"bootstrapToken", "tlsBootstrapToken", "token:"} {
		if strings.Contains(string(out), unwanted) {
			t.Errorf("tokenless config has %q:\n%s", unwanted, out)
		}
	}
	for name, mutate := range map[string]func(*JoinParams){
		"token and file": func(p *JoinParams) { p.Token = "abcdef.0123456789abcdef" },
		"relative file":  func(p *JoinParams) { p.DiscoveryFile = "discovery.conf" },
		"neither":        func(p *JoinParams) { p.DiscoveryFile = "" },
	} {
		q := p
		mutate(&q)
		if _, err := JoinConfig(q); !errors.Is(err, ErrInvalidParams) {
			t.Errorf("%s: JoinConfig() = %v, want ErrInvalidParams", name, err)
		}
	}
}

func TestRunnerArgv(t *testing.T) {
	rec := &commandtest.Recorder{}
	r := &Runner{Path: "/opt/bin/kubeadm", IgnorePreflightErrors: []string{"all"}, Exec: rec}
	ctx := context.Background()
	for _, err := range []error{
		r.Version(ctx, io.Discard),
		r.Certs(ctx, io.Discard, "/c.yaml"),
		r.Init(ctx, io.Discard, "/c.yaml", "addon/kube-proxy"),
		r.Join(ctx, io.Discard, "/j.yaml"),
		r.Reset(ctx, io.Discard, "unix:///c.sock"),
		r.CertsRenew(ctx, io.Discard, "/etc/kubernetes"),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	want := strings.Join([]string{
		"/opt/bin/kubeadm version -o short",
		"/opt/bin/kubeadm init phase certs all --config /c.yaml",
		"/opt/bin/kubeadm init --config /c.yaml --skip-token-print --skip-phases=certs,addon/kube-proxy --ignore-preflight-errors=all",
		"/opt/bin/kubeadm join --config /j.yaml --ignore-preflight-errors=all",
		"/opt/bin/kubeadm reset --force --cri-socket unix:///c.sock",
		"/opt/bin/kubeadm certs renew all --kubeconfig /etc/kubernetes/admin.conf --cert-dir /etc/kubernetes/pki",
	}, "\n")
	if got := rec.String(); got != want {
		t.Fatalf("calls:\n%s\nwant:\n%s", got, want)
	}
}

// InitOnEtcdData passes over the etcd directory check, beside the runner's own ignored checks; with
// "all" it passes "all" alone, since kubeadm refuses "all" beside named checks.
func TestInitOnEtcdDataArgv(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		ignore []string
		want   string
	}{
		{nil, "--ignore-preflight-errors=DirAvailable--var-lib-etcd"},
		{[]string{"Swap"}, "--ignore-preflight-errors=Swap,DirAvailable--var-lib-etcd"},
		{[]string{"all"}, "--ignore-preflight-errors=all"},
		{[]string{"All"}, "--ignore-preflight-errors=All"},
	} {
		rec := &commandtest.Recorder{}
		r := &Runner{Path: "kubeadm", IgnorePreflightErrors: tc.ignore, Exec: rec}
		if err := r.InitOnEtcdData(ctx, io.Discard, "/c.yaml"); err != nil {
			t.Fatal(err)
		}
		if want := "kubeadm init --config /c.yaml --skip-token-print --skip-phases=certs " + tc.want; rec.String() != want {
			t.Errorf("with %v: %s, want %s", tc.ignore, rec.String(), want)
		}
		if len(r.IgnorePreflightErrors) != len(tc.ignore) {
			t.Errorf("the runner's own list changed: %v", r.IgnorePreflightErrors)
		}
	}
}
