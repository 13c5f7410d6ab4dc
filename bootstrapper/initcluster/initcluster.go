// Package initcluster turns a fresh node into the first control plane of a new cluster, as a typed
// list of named, idempotent phases:
//
//	phase             does                                                     re-run after failure
//	preflight         kubeadm matches the requested version, CRI socket present safe
//	kubeadm-config    renders kubeadm's config from the v1beta4 types           rewrites the file
//	certs             kubeadm init phase certs all                              keeps valid certs
//	kms               the KMS plugin's key (generation 1 from the master         installs the same key again
//	                  secret; restoring: the snapshot's generations) on the
//	                  state disk, the API server's encryption configuration,
//	                  the plugin started
//	restore-etcd      restoring only: the snapshot's etcd data into the etcd     removes its own partial
//	                  directory as this node's one-member cluster               data, restores again
//	kubeadm-init      starts the kubelet, runs kubeadm init (its own preflight   kubeadm reset, certs (and
//	                  checks included, certs skipped)                           restore-etcd), then kubeadm
//	                                                                            init again
//	wait-apiserver    polls the API server's /readyz                            safe
//	restore-cleanup   restoring only: the old machines' Node objects, every      safe (deletes what is
//	                  pod bound to a node, the admitted machines (record and    there)
//	                  Machines; removed ones stay) and the image-policy
//	                  webhook's configuration deleted
//	components        server-side applies the cluster components in order       safe (apply is idempotent)
//	admin-kubeconfig  reads admin.conf for the operator                         safe
//
// The InitServer runs the phases in order, streams each start and end, records finished phases, and
// resumes at the first unfinished one when the operator retries.
//
// A restore (`berth restore`) is an init whose request carries a sealed etcd snapshot (Restore):
// kubeadm init then starts etcd on the restored data directory (its DirAvailable--var-lib-etcd
// check ignored) with new certificates, so that every credential of the old cluster stops working,
// and the API server reads the restored Secrets with the snapshot's KMS keys.
package initcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/cpfiles"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/metadata"
)

// Phase names, stable: they appear on the wire and in the node's state file.
const (
	PhasePreflight       = "preflight"
	PhaseKubeadmConfig   = "kubeadm-config"
	PhaseCerts           = "certs"
	PhaseKMS             = "kms"
	PhaseKubeadmInit     = "kubeadm-init"
	PhaseWaitAPIServer   = "wait-apiserver"
	PhaseComponents      = "components"
	PhaseAdminKubeconfig = "admin-kubeconfig"
	// PhaseRestoreEtcd and PhaseRestoreCleanup run only when the request restores a snapshot.
	PhaseRestoreEtcd    = "restore-etcd"
	PhaseRestoreCleanup = "restore-cleanup"
)

// Request is a validated init request.
type Request struct {
	// Cluster is the operator's cluster configuration (validated); its name, version, networks,
	// SANs and components are the fields below.
	Cluster           clusterconfig.ClusterConfiguration
	ClusterName       string
	KubernetesVersion string
	ServiceCIDR       string
	PodCIDR           string
	CertSANs          []string
	Keys              *clusterkeys.Keys
	Salt              []byte
	AttestationPolicy []byte
	SkipKubeProxy     bool
	SkipCoreDNS       bool
	ImagePolicy       []byte
	// Restore, when set, makes this init restore the cluster of a sealed snapshot.
	Restore *Restore
}

// Restore is the snapshot a restoring init starts from.
type Restore struct {
	// Snapshot is the path of the sealed snapshot on this node; the init server opened it to its
	// end with Keys before the node lock was taken.
	Snapshot string
	// Manifest is the snapshot's manifest (its KMS keys among it).
	Manifest backup.Manifest
}

// Job is the typed state the phases share during one init attempt.
type Job struct {
	Req Request
	// Out receives human-readable output of every phase (kubeadm's output, progress notes).
	Out io.Writer
	// Self is this node as metadata describes it.
	Self metadata.Instance
	// ControlPlaneEndpoint is HOST:PORT of the API server.
	ControlPlaneEndpoint string
	// Kubeconfig is the admin kubeconfig, set by the last phase.
	Kubeconfig []byte
}

// Phase is one named, idempotent step of init.
type Phase struct {
	Name string
	Run  func(ctx context.Context, job *Job) error
}

// Config configures an Initializer.
type Config struct {
	// StateDir holds Berth's files on the node (the kubeadm config goes here).
	StateDir string
	// KubernetesDir is kubeadm's directory (default /etc/kubernetes).
	KubernetesDir string
	// CRISocket is the container runtime endpoint.
	CRISocket string
	// CgroupDriver is the kubelet's cgroup driver ("systemd" or "cgroupfs").
	CgroupDriver string
	// KubeProxyMode is kube-proxy's mode; empty leaves kubeadm's default.
	KubeProxyMode string
	// KubeProxyConntrackMaxPerCore, when set, is kube-proxy's conntrack.maxPerCore.
	KubeProxyConntrackMaxPerCore *int32
	// NeverPull makes kubeadm and kubelet use pre-imported images only.
	NeverPull bool
	// KubeletExtraArgs are extra kubelet flags.
	KubeletExtraArgs [][2]string
	// APIServerTimeout bounds wait-apiserver (default 3 minutes).
	APIServerTimeout time.Duration
	// EtcdDir is etcd's data directory as kubeadm's local etcd uses it (default /var/lib/etcd); a
	// restore writes its member directory there.
	EtcdDir string
}

// Initializer provides the init phases.
type Initializer struct {
	cfg        Config
	fs         afero.Fs
	meta       metadataAPI
	kubeadm    kubeadmRunner
	kubelet    kubeletStarter
	waiter     apiWaiter
	components componentInstaller
	// kms holds the KMS plugin's keys and encryption says where the API server finds them; nil
	// initializes without encryption at rest.
	kms        kmsInstaller
	encryption *kubeadm.Encryption
	// cleaner clears the old machines out of a restored cluster.
	cleaner restoreCleaner
}

// New returns an Initializer.
func New(cfg Config, fsys afero.Fs, meta metadataAPI, kubeadm kubeadmRunner, kubelet kubeletStarter, waiter apiWaiter, components componentInstaller) *Initializer {
	if cfg.KubernetesDir == "" {
		cfg.KubernetesDir = "/etc/kubernetes"
	}
	if cfg.APIServerTimeout == 0 {
		cfg.APIServerTimeout = 3 * time.Minute
	}
	if cfg.EtcdDir == "" {
		cfg.EtcdDir = "/var/lib/etcd"
	}
	return &Initializer{cfg: cfg, fs: fsys, meta: meta, kubeadm: kubeadm, kubelet: kubelet, waiter: waiter, components: components,
		cleaner: kubeCleaner{}}
}

// WithKMS makes the cluster encrypt Secrets at rest through the KMS plugin: the kubeadm configuration
// gives the API server enc's flag and mounts, and the kms phase installs the plugin's first key
// before kubeadm init starts the API server.
func (i *Initializer) WithKMS(k kmsInstaller, enc kubeadm.Encryption) *Initializer {
	i.kms = k
	i.encryption = &enc
	return i
}

func (i *Initializer) configPath() string { return filepath.Join(i.cfg.StateDir, "kubeadm-init.yaml") }
func (i *Initializer) adminConfPath() string {
	return filepath.Join(i.cfg.KubernetesDir, "admin.conf")
}

// ErrNotControlPlane is returned by Prepare when metadata gives this node another role than
// control plane: init must not even take the node lock, or the node could never join its cluster.
var ErrNotControlPlane = errors.New("metadata says this node is not a control plane")

// Prepare fills in what the phases need from metadata and checks that this node is a control plane
// (ErrNotControlPlane). It runs before the node lock is taken and before the first phase of every
// attempt.
func (i *Initializer) Prepare(ctx context.Context, job *Job) error {
	self, err := i.meta.Self(ctx)
	if err != nil {
		return fmt.Errorf("reading this node's metadata: %w", err)
	}
	if self.Role != metadata.RoleControlPlane {
		return fmt.Errorf("%w: its role is %q", ErrNotControlPlane, self.Role)
	}
	if len(self.IPs) == 0 {
		return errors.New("reading this node's metadata: no address")
	}
	job.Self = self
	endpoint, err := i.meta.ControlPlaneEndpoint(ctx)
	if err != nil || endpoint == "" {
		endpoint = net.JoinHostPort(self.IPs[0], "6443")
	}
	job.ControlPlaneEndpoint = endpoint
	return nil
}

// Phases returns the init phases in order; restore adds the phases of a restore.
func (i *Initializer) Phases(restore bool) []Phase {
	phases := []Phase{
		{PhasePreflight, i.preflight},
		{PhaseKubeadmConfig, i.writeConfig},
		{PhaseCerts, i.certs},
		{PhaseKMS, i.installKMS},
	}
	if restore {
		phases = append(phases, Phase{PhaseRestoreEtcd, i.restoreEtcd})
	}
	phases = append(phases, Phase{PhaseKubeadmInit, i.kubeadmInit}, Phase{PhaseWaitAPIServer, i.waitAPIServer})
	if restore {
		phases = append(phases, Phase{PhaseRestoreCleanup, i.restoreCleanup})
	}
	return append(phases, Phase{PhaseComponents, i.installComponents}, Phase{PhaseAdminKubeconfig, i.adminKubeconfig})
}

func (i *Initializer) preflight(ctx context.Context, job *Job) error {
	if sock, ok := unixSocketPath(i.cfg.CRISocket); ok {
		if _, err := i.fs.Stat(sock); err != nil {
			return fmt.Errorf("container runtime socket %s is not there: %w", sock, err)
		}
	}
	var out strings.Builder
	if err := i.kubeadm.Version(ctx, &out); err != nil {
		return fmt.Errorf("checking kubeadm: %w", err)
	}
	have := strings.TrimSpace(out.String())
	if have != job.Req.KubernetesVersion {
		return fmt.Errorf("this node's kubeadm is %s, the request asks for Kubernetes %s", have, job.Req.KubernetesVersion)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] kubeadm %s, container runtime at %s\n", have, i.cfg.CRISocket)
	return nil
}

// AuditPolicyFile is where a control plane keeps the API server's audit policy, relative to
// kubeadm's directory (cpfiles owns the path: control planes that join later write it there too).
const AuditPolicyFile = cpfiles.AuditPolicyFile

func (i *Initializer) dirs() cpfiles.Dirs {
	return cpfiles.Dirs{Kubernetes: i.cfg.KubernetesDir, State: i.cfg.StateDir}
}

// writeOperatorFiles writes the files the operator's configuration needs on the control plane
// (cpfiles.Render): its admission plugins' configuration merged into Berth's, its audit policy, its
// kubeadm patches. The joinservice renders the same files into every control-plane join ticket.
func (i *Initializer) writeOperatorFiles(c *clusterconfig.ClusterConfiguration) (admission, audit, patches string, err error) {
	files, err := cpfiles.Render(c)
	if err != nil {
		return "", "", "", err
	}
	if err := cpfiles.Write(i.fs, i.dirs(), files); err != nil {
		return "", "", "", fmt.Errorf("writing the cluster configuration's files: %w", err)
	}
	admission, audit, patches = i.dirs().Written(files)
	return admission, audit, patches, nil
}

func (i *Initializer) writeConfig(_ context.Context, job *Job) error {
	cluster := job.Req.Cluster
	admission, audit, patches, err := i.writeOperatorFiles(&cluster)
	if err != nil {
		return err
	}
	cfg, err := kubeadm.InitConfig(kubeadm.InitParams{
		Node: kubeadm.NodeParams{
			Name: job.Self.Name, IP: job.Self.IPs[0], CRISocket: i.cfg.CRISocket,
			KubeletExtraArgs: i.cfg.KubeletExtraArgs, NeverPull: i.cfg.NeverPull,
		},
		ControlPlaneEndpoint:         job.ControlPlaneEndpoint,
		ClusterName:                  job.Req.ClusterName,
		KubernetesVersion:            job.Req.KubernetesVersion,
		ServiceCIDR:                  job.Req.ServiceCIDR,
		PodCIDR:                      job.Req.PodCIDR,
		CertSANs:                     job.Req.CertSANs,
		CgroupDriver:                 i.cfg.CgroupDriver,
		KubeProxyMode:                i.cfg.KubeProxyMode,
		KubeProxyConntrackMaxPerCore: i.cfg.KubeProxyConntrackMaxPerCore,
		Encryption:                   i.encryption,
		AdmissionConfigFile:          admission,
		Cluster:                      &cluster,
		AuditPolicyFile:              audit,
		PatchesDir:                   patches,
	})
	if err != nil {
		return fmt.Errorf("rendering kubeadm config: %w", err)
	}
	if err := i.fs.MkdirAll(i.cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	if err := afero.WriteFile(i.fs, i.configPath(), cfg, 0o600); err != nil {
		return fmt.Errorf("writing kubeadm config: %w", err)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] wrote kubeadm configuration to %s\n", i.configPath())
	return nil
}

func (i *Initializer) certs(ctx context.Context, job *Job) error {
	return i.kubeadm.Certs(ctx, job.Out, i.configPath())
}

// installKMS installs generation 1 of the KMS key, derived from the request's master secret; a
// restore installs the snapshot's generations instead, under which its Secrets are encrypted.
func (i *Initializer) installKMS(ctx context.Context, job *Job) error {
	if i.kms == nil {
		return nil
	}
	const first = 1
	set := kmsplugin.KeySet{Active: first, Keys: []kmsplugin.Key{{Generation: first, KEK: job.Req.Keys.KMSKey(first)}}}
	if r := job.Req.Restore; r != nil {
		var err error
		if set, err = snapshotKeySet(r.Manifest.KMS); err != nil {
			return err
		}
	}
	if err := i.kms.Install(ctx, set); err != nil {
		return fmt.Errorf("installing the KMS key: %w", err)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] KMS plugin started with key %s; the API server encrypts Secrets through it\n", set.ActiveKeyID())
	return nil
}

func (i *Initializer) kubeadmInit(ctx context.Context, job *Job) error {
	var skip []string
	if job.Req.SkipKubeProxy {
		skip = append(skip, "addon/kube-proxy")
	}
	if job.Req.SkipCoreDNS {
		skip = append(skip, "addon/coredns")
	}
	attempted := filepath.Join(i.cfg.StateDir, "kubeadm-init.attempted")
	if _, err := i.fs.Stat(attempted); err == nil {
		// An earlier kubeadm init got part of the way. kubeadm init is not idempotent, so undo it
		// and redo it from the certificates on. The kubelet must not run across the reset: it would
		// keep the undone attempt's client certificate, under the CA the reset deletes, and never
		// register with the API server of the next attempt.
		_, _ = fmt.Fprintln(job.Out, "[berth] an earlier kubeadm init did not finish: stopping the kubelet, resetting and running it again")
		if err := i.kubelet.Stop(ctx); err != nil {
			return err
		}
		if err := i.kubeadm.Reset(ctx, job.Out, i.cfg.CRISocket); err != nil {
			return err
		}
		if err := i.kubeadm.Certs(ctx, job.Out, i.configPath()); err != nil {
			return err
		}
		if job.Req.Restore != nil {
			// kubeadm reset emptied etcd's data directory.
			if err := i.restoreEtcd(ctx, job); err != nil {
				return err
			}
		}
	}
	// The kubelet must be running (or ready to start once kubeadm wrote its config) before kubeadm
	// waits for the control-plane static pods.
	if err := i.kubelet.Start(ctx); err != nil {
		return fmt.Errorf("starting kubelet: %w", err)
	}
	if err := afero.WriteFile(i.fs, attempted, nil, 0o600); err != nil {
		return fmt.Errorf("recording kubeadm init attempt: %w", err)
	}
	if job.Req.Restore != nil {
		// etcd's data directory holds the restored member: kubeadm's local etcd starts on it.
		return i.kubeadm.InitOnEtcdData(ctx, job.Out, i.configPath(), skip...)
	}
	return i.kubeadm.Init(ctx, job.Out, i.configPath(), skip...)
}

func (i *Initializer) waitAPIServer(ctx context.Context, job *Job) error {
	ctx, cancel := context.WithTimeout(ctx, i.cfg.APIServerTimeout)
	defer cancel()
	start := time.Now()
	if err := i.waiter.WaitReady(ctx, i.adminConfPath()); err != nil {
		return fmt.Errorf("waiting for the API server: %w", err)
	}
	_, _ = fmt.Fprintf(job.Out, "[berth] API server ready after %s\n", time.Since(start).Round(time.Millisecond))
	return nil
}

func (i *Initializer) installComponents(ctx context.Context, job *Job) error {
	return i.components.Install(ctx, i.adminConfPath(), job)
}

func (i *Initializer) adminKubeconfig(_ context.Context, job *Job) error {
	data, err := afero.ReadFile(i.fs, i.adminConfPath())
	if err != nil {
		return fmt.Errorf("reading admin kubeconfig: %w", err)
	}
	job.Kubeconfig = data
	return nil
}

func unixSocketPath(endpoint string) (string, bool) {
	const prefix = "unix://"
	if len(endpoint) > len(prefix) && endpoint[:len(prefix)] == prefix {
		return endpoint[len(prefix):], true
	}
	if filepath.IsAbs(endpoint) {
		return endpoint, true
	}
	return "", false
}

// metadataAPI is what init needs to know about this node.
type metadataAPI interface {
	// Self returns this instance.
	Self(ctx context.Context) (metadata.Instance, error)
	// ControlPlaneEndpoint returns HOST:PORT of the API server, if the platform publishes one.
	ControlPlaneEndpoint(ctx context.Context) (string, error)
}

// kubeadmRunner runs kubeadm's init steps.
type kubeadmRunner interface {
	Version(ctx context.Context, out io.Writer) error
	Certs(ctx context.Context, out io.Writer, configPath string) error
	Init(ctx context.Context, out io.Writer, configPath string, skipPhases ...string) error
	InitOnEtcdData(ctx context.Context, out io.Writer, configPath string, skipPhases ...string) error
	Reset(ctx context.Context, out io.Writer, criSocket string) error
}

// kubeletStarter starts and stops the kubelet (internal/kubelet).
type kubeletStarter interface {
	// Start enables the kubelet; it may return before the kubelet runs.
	Start(ctx context.Context) error
	// Stop stops the kubelet and returns once it no longer runs.
	Stop(ctx context.Context) error
}

// apiWaiter waits for the API server.
type apiWaiter interface {
	// WaitReady returns once the API server behind kubeconfig answers /readyz with 200, or ctx ends.
	WaitReady(ctx context.Context, kubeconfigPath string) error
}

// kmsInstaller makes a key set the node's KMS keys (kmskeeper.Keeper).
type kmsInstaller interface {
	Install(ctx context.Context, set kmsplugin.KeySet) error
}

// componentInstaller installs the cluster's components.
type componentInstaller interface {
	// Install applies every component in order. It MUST be idempotent.
	Install(ctx context.Context, kubeconfigPath string, job *Job) error
}
