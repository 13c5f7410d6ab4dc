package main

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/pflag"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/logging"
	metachoose "github.com/berth-k8s/berth/internal/metadata/choose"
	"github.com/berth-k8s/berth/internal/version"
)

// config is the daemon's configuration.
type config struct {
	metadata       string
	metadataFile   string
	metadataURL    string
	metadataAPI    string
	attestation    string
	tpm            string
	lockPCR        uint
	joinPolicy     string
	stateDir       string
	runDir         string
	initListen     string
	kubelet        string
	kubeletPath    string
	kubeletArgs    []string
	kubeadmPath    string
	ignorePreflt   []string
	kubernetesDir  string
	kubeletDir     string
	criSocket      string
	runtimePidFile string
	cgroupDriver   string
	kubeProxyMode  string
	conntrackMax   int
	neverPull      bool
	componentsDir  string
	joinImage      string
	webhookImage   string
	joinPort       int
	diskUUID       string
	log            logging.Config
	stateDisk      string
	diskBackend    string
	stateMount     string
	etcdDir        string
	restoreDir     string
	recoverListen  string
	sealPCRs       []uint
	sealFresh      bool
	phasePCR       uint
	kmsSocket      string
	kmsMetrics     string
}

func defaultConfig() *config {
	return &config{
		stateDir:      "/var/lib/berth",
		runDir:        "/run/berth",
		initListen:    ":9000",
		kubelet:       "systemd",
		kubeletPath:   "kubelet",
		kubeadmPath:   "kubeadm",
		kubernetesDir: "/etc/kubernetes",
		kubeletDir:    "/var/lib/kubelet",
		criSocket:     "unix:///run/containerd/containerd.sock",
		joinImage:     "berth.local/joinservice:" + version.Version,
		joinPort:      joinconfig.JoinPort,
		log:           logging.Defaults(),
		lockPCR:       15,
		conntrackMax:  -1,
		diskBackend:   "none",
		stateMount:    "/run/berth/state-disk",
		etcdDir:       "/var/lib/etcd",
		recoverListen: ":9001",
		sealPCRs:      []uint{4, 7, 9, 11, 12},
		kmsSocket:     kmsplugin.DefaultSocket,
		kmsMetrics:    net.JoinHostPort("", strconv.Itoa(kmsplugin.MetricsPort)),
	}
}

func (c *config) register(f *pflag.FlagSet) {
	f.StringVar(&c.metadata, "metadata", c.metadata, "metadata provider: static (a file), mini (the HTTP API of 'berth mini up'), qemu (the same API served by 'berth metadata serve'), gcp, aws or azure")
	f.StringVar(&c.metadataFile, "metadata-file", c.metadataFile, "metadata file for --metadata=static")
	f.StringVar(&c.metadataURL, "metadata-url", c.metadataURL, "base URL of the metadata API for --metadata=mini|qemu; for gcp, aws and azure the instance metadata service (default: the cloud's well-known address)")
	f.StringVar(&c.metadataAPI, "metadata-api-url", c.metadataAPI, "for --metadata=gcp|aws|azure: base URL of the cloud's compute API (default: the cloud's own endpoint)")
	f.StringVar(&c.attestation, "attestation", c.attestation, "attestation variant: tpm, tdx, or insecure-none (no attestation, development only)")
	f.StringVar(&c.tpm, "tpm", c.tpm, "TPM for --attestation=tpm: a device path such as /dev/tpmrm0, tcp:HOST:PORT or unix:PATH for swtpm")
	f.UintVar(&c.lockPCR, "lock-pcr", c.lockPCR, "PCR the node lock extends the cluster ID into (--attestation=tpm)")
	f.StringVar(&c.joinPolicy, "join-policy", c.joinPolicy, "attestation policy the cluster's joinservice must satisfy before this node joins (same image, lock register set); without it an attesting node cannot join")
	f.StringVar(&c.stateDir, "state-dir", c.stateDir, "directory for the node's state (lock marker, node state, kubeadm config)")
	f.StringVar(&c.runDir, "run-dir", c.runDir, "runtime directory, cleared at boot: the record of the daemon's child processes (kubeadm, the kubelet), which a restarted daemon kills")
	f.StringVar(&c.initListen, "init-listen", c.initListen, "address the InitServer listens on")
	f.StringVar(&c.kubelet, "kubelet", c.kubelet, "how to run the kubelet: systemd (kubelet.service) or process (supervised child process)")
	f.StringVar(&c.kubeletPath, "kubelet-path", c.kubeletPath, "kubelet binary for --kubelet=process")
	f.StringSliceVar(&c.kubeletArgs, "kubelet-extra-args", c.kubeletArgs, "extra kubelet flags as NAME=VALUE, written into kubeadm's kubelet flags")
	f.StringVar(&c.kubeadmPath, "kubeadm-path", c.kubeadmPath, "kubeadm binary")
	f.StringSliceVar(&c.ignorePreflt, "kubeadm-ignore-preflight-errors", c.ignorePreflt, "kubeadm preflight checks to ignore (e.g. all on namespace nodes)")
	f.StringVar(&c.kubernetesDir, "kubernetes-dir", c.kubernetesDir, "kubeadm's configuration directory")
	f.StringVar(&c.kubeletDir, "kubelet-dir", c.kubeletDir, "the kubelet's directory")
	f.StringVar(&c.criSocket, "cri-socket", c.criSocket, "container runtime endpoint")
	f.StringVar(&c.runtimePidFile, "container-runtime-pidfile", c.runtimePidFile, "where the container runtime's start wrote its process ID, when its root is on the state disk (the mini cluster's containerd): a node locked by a REVOKED check-in stops it (SIGTERM) before closing the disk; empty: the runtime keeps running")
	f.StringVar(&c.cgroupDriver, "cgroup-driver", c.cgroupDriver, "kubelet cgroup driver: systemd or cgroupfs (default: systemd with --kubelet=systemd, else cgroupfs)")
	f.StringVar(&c.kubeProxyMode, "kube-proxy-mode", c.kubeProxyMode, "kube-proxy mode (nftables, iptables); empty keeps kubeadm's default")
	f.IntVar(&c.conntrackMax, "kube-proxy-conntrack-max-per-core", c.conntrackMax, "kube-proxy's conntrack.maxPerCore; 0 leaves the host's nf_conntrack_max alone (nodes sharing a kernel), -1 keeps kube-proxy's default")
	f.BoolVar(&c.neverPull, "never-pull", c.neverPull, "never pull images: every image is pre-imported into the container runtime")
	f.StringVar(&c.componentsDir, "components-dir", c.componentsDir, "directory of extra manifests (e.g. the pod network) applied after kubeadm init")
	f.StringVar(&c.joinImage, "joinservice-image", c.joinImage, "container image of the joinservice DaemonSet")
	f.StringVar(&c.webhookImage, "webhook-image", c.webhookImage, "container image of the image-policy webhook (Deployment berth-webhook), installed last; empty leaves it out")
	f.IntVar(&c.joinPort, "joinservice-port", c.joinPort, "port of the joinservice on control-plane nodes")
	f.StringVar(&c.diskUUID, "disk-uuid", c.diskUUID, "with --state-disk-backend=none only: the disk UUID this node names when it joins (default: a random one per start)")
	f.StringVar(&c.stateDisk, "state-disk", c.stateDisk, "the node's state disk: a block device for --state-disk-backend=luks, an image file for fscrypt")
	f.StringVar(&c.diskBackend, "state-disk-backend", c.diskBackend, "how the state disk is encrypted: luks (LUKS2 with integrity, needs device-mapper), fscrypt (ext4 encryption on a loop-mounted image, where there is no device-mapper) or none (state stays unencrypted on the host's directories; development only)")
	f.StringVar(&c.stateMount, "state-mount", c.stateMount, "where the opened state disk is mounted; its directories are then mounted over --kubernetes-dir, --kubelet-dir, --etcd-dir and --state-dir")
	f.StringVar(&c.etcdDir, "etcd-dir", c.etcdDir, "etcd's data directory on control planes (kept on the state disk)")
	f.StringVar(&c.restoreDir, "restore-snapshot-dir", c.restoreDir, "where a restore (berth restore) receives its sealed etcd snapshot before etcd's data is restored from it; it needs room for the snapshot (default: the system's temporary directory)")
	f.StringVar(&c.recoverListen, "recovery-listen", c.recoverListen, "address the recovery server listens on while the state disk waits for 'berth recover'")
	f.UintSliceVar(&c.sealPCRs, "seal-pcrs", c.sealPCRs, "boot PCRs the state disk key is sealed to (--attestation=tpm): the UKI (4), Secure Boot state (7), the kernel's command line and initrd (9), the UKI's sections (11), command line overrides and credentials (12); the lock PCR is always required to be zero")
	f.BoolVar(&c.sealFresh, "seal-fresh-disk", c.sealFresh, "also seal the random key of a freshly formatted state disk to the TPM (--attestation=tpm): a node rebooted before init or join opens its disk unattended instead of wiping it")
	f.UintVar(&c.phasePCR, "phase-pcr", c.phasePCR, "PCR (--attestation=tpm) the boot stage extends once the state disk is open; the state disk key is sealed to it being zero, so it unseals only once per boot, and a quote tells before the disk was opened (zero) from after; 0 marks nothing")
	f.StringVar(&c.kmsSocket, "kms-socket", c.kmsSocket, "unix socket of the KMS plugin a control plane runs for its API server (Secrets are encrypted at rest through it); kubeadm mounts its directory into the API server's pod")
	f.StringVar(&c.kmsMetrics, "kms-metrics-listen", c.kmsMetrics, "HOST:PORT where a control plane's KMS plugin serves /metrics (berth_kms_*; no secrets, only health and key generations), by default on every address of the node so that Prometheus in the cluster scrapes it (job berth-kms in deploy/monitoring); empty serves none")
	c.log.AddFlags(f)
}

// metadataConfig says which metadata provider the daemon builds.
func (c *config) metadataConfig() metachoose.Config {
	return metachoose.Config{Name: c.metadata, File: c.metadataFile, URL: c.metadataURL, APIURL: c.metadataAPI}
}

func (c *config) validate() error {
	var errs []error
	if err := c.metadataConfig().Validate(); err != nil {
		errs = append(errs, err)
	}
	switch c.attestation {
	case "insecure-none", "tdx":
	case "tpm":
		if c.tpm == "" {
			errs = append(errs, errors.New("--attestation=tpm needs --tpm"))
		}
		if c.lockPCR > 23 {
			errs = append(errs, fmt.Errorf("--lock-pcr %d is not a PCR (0-23)", c.lockPCR))
		}
	case "":
		errs = append(errs, errors.New("--attestation is required (tpm, tdx, or insecure-none chosen explicitly)"))
	default:
		errs = append(errs, fmt.Errorf("--attestation %q: want tpm, tdx or insecure-none", c.attestation))
	}
	switch c.kubelet {
	case "systemd", "process":
	default:
		errs = append(errs, fmt.Errorf("--kubelet %q: want systemd or process", c.kubelet))
	}
	if c.cgroupDriver == "" {
		c.cgroupDriver = "cgroupfs"
		if c.kubelet == "systemd" {
			c.cgroupDriver = "systemd"
		}
	}
	if c.cgroupDriver != "systemd" && c.cgroupDriver != "cgroupfs" {
		errs = append(errs, fmt.Errorf("--cgroup-driver %q: want systemd or cgroupfs", c.cgroupDriver))
	}
	if !filepath.IsAbs(c.stateDir) {
		errs = append(errs, fmt.Errorf("--state-dir %q must be absolute", c.stateDir))
	}
	if !filepath.IsAbs(c.runDir) {
		errs = append(errs, fmt.Errorf("--run-dir %q must be absolute", c.runDir))
	}
	if _, _, err := net.SplitHostPort(c.initListen); err != nil {
		errs = append(errs, fmt.Errorf("--init-listen %q: %w", c.initListen, err))
	}
	if c.joinPort <= 0 || c.joinPort > 65535 {
		errs = append(errs, fmt.Errorf("--joinservice-port %d is not a port", c.joinPort))
	}
	for _, a := range c.kubeletArgs {
		if name, _, ok := strings.Cut(a, "="); !ok || name == "" {
			errs = append(errs, fmt.Errorf("--kubelet-extra-args %q: want NAME=VALUE", a))
		}
	}
	switch c.diskBackend {
	case "none":
	case "fscrypt", "luks":
		if c.stateDisk == "" {
			errs = append(errs, fmt.Errorf("--state-disk-backend=%s needs --state-disk", c.diskBackend))
		}
		if !filepath.IsAbs(c.stateMount) {
			errs = append(errs, fmt.Errorf("--state-mount %q must be absolute", c.stateMount))
		}
		if _, _, err := net.SplitHostPort(c.recoverListen); err != nil {
			errs = append(errs, fmt.Errorf("--recovery-listen %q: %w", c.recoverListen, err))
		}
	default:
		errs = append(errs, fmt.Errorf("--state-disk-backend %q: want luks, fscrypt or none", c.diskBackend))
	}
	for _, p := range c.sealPCRs {
		if p > 23 || (c.attestation == "tpm" && p == c.lockPCR) {
			errs = append(errs, fmt.Errorf("--seal-pcrs: %d is not a boot PCR (0-23, not the lock PCR)", p))
		}
	}
	if c.phasePCR != 0 && (c.phasePCR > 23 || c.phasePCR == c.lockPCR || slices.Contains(c.sealPCRs, c.phasePCR)) {
		errs = append(errs, fmt.Errorf("--phase-pcr: %d is not free for the boot phase (1-23, neither the lock PCR nor a --seal-pcrs PCR)", c.phasePCR))
	}
	if !filepath.IsAbs(c.kmsSocket) {
		errs = append(errs, fmt.Errorf("--kms-socket %q must be absolute", c.kmsSocket))
	}
	if c.kmsMetrics != "" {
		if _, _, err := net.SplitHostPort(c.kmsMetrics); err != nil {
			errs = append(errs, fmt.Errorf("--kms-metrics-listen %q: %w", c.kmsMetrics, err))
		}
	}
	if c.conntrackMax < -1 {
		errs = append(errs, fmt.Errorf("--kube-proxy-conntrack-max-per-core %d: want -1 or more", c.conntrackMax))
	}
	if err := c.log.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (c *config) kubeletExtraArgs() [][2]string {
	var out [][2]string
	for _, a := range c.kubeletArgs {
		name, value, _ := strings.Cut(a, "=")
		out = append(out, [2]string{strings.TrimPrefix(name, "--"), value})
	}
	return out
}

func (c *config) kubeProxyConntrackMaxPerCore() *int32 {
	if c.conntrackMax < 0 {
		return nil
	}
	v := int32(c.conntrackMax)
	return &v
}
