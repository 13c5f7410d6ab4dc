package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/afero"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/berth-k8s/berth/bootstrapper"
	"github.com/berth-k8s/berth/bootstrapper/certrenew"
	"github.com/berth-k8s/berth/bootstrapper/components"
	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/bootstrapper/initserver"
	"github.com/berth-k8s/berth/bootstrapper/joinclient"
	"github.com/berth-k8s/berth/bootstrapper/joincluster"
	"github.com/berth-k8s/berth/bootstrapper/kmskeeper"
	"github.com/berth-k8s/berth/internal/apiserver"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/command"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/jointrace"
	"github.com/berth-k8s/berth/internal/kmsplugin"
	"github.com/berth-k8s/berth/internal/kubeadm"
	"github.com/berth-k8s/berth/internal/kubelet"
	"github.com/berth-k8s/berth/internal/logging"
	"github.com/berth-k8s/berth/internal/metadata"
	metachoose "github.com/berth-k8s/berth/internal/metadata/choose"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/version"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/nodelock"
)

// metadataProvider is everything the daemon asks the platform.
type metadataProvider interface {
	Self(ctx context.Context) (metadata.Instance, error)
	Peers(ctx context.Context) ([]metadata.Instance, error)
	ControlPlaneEndpoint(ctx context.Context) (string, error)
	InitSecretHash(ctx context.Context) ([]byte, error)
}

// newMetadata builds the metadata provider cfg names (--metadata, --metadata-url, ...). hc, when not
// nil, carries the cloud providers' requests.
func newMetadata(ctx context.Context, cfg *config, fs afero.Fs, hc *http.Client) (metadataProvider, error) {
	mc := cfg.metadataConfig()
	mc.FS, mc.HTTPClient = fs, hc
	return metachoose.New(ctx, mc)
}

// daemon builds the daemon's parts from cfg and runs it.
func daemon(ctx context.Context, cfg *config) error {
	log, err := logging.New(cfg.log, os.Stderr)
	if err != nil {
		return &configError{err}
	}
	defer func() { _ = log.Sync() }()
	log.Info("bootstrapper starting", zap.String("version", version.Version), zap.String("metadata", cfg.metadata),
		zap.String("attestation", cfg.attestation), zap.String("kubelet", cfg.kubelet))

	// Children a crashed daemon left behind (a kubeadm init, a kubelet) die before anything else
	// starts: they would race this daemon's own.
	if err := os.MkdirAll(cfg.runDir, 0o700); err != nil {
		return fmt.Errorf("creating runtime directory: %w", err)
	}
	children := command.NewChildren(filepath.Join(cfg.runDir, "children.json"))
	children.OnError = func(err error) { log.Warn("recording child processes", zap.Error(err)) }
	killed, err := children.KillStale()
	for _, k := range killed {
		log.Warn("killed a process a previous daemon left behind", zap.Int("pid", k.PID), zap.String("name", k.Name),
			zap.String("group", k.Group.Name), zap.Int("groupPID", k.Group.PID))
	}
	if err != nil {
		return fmt.Errorf("killing processes a previous daemon left behind: %w", err)
	}

	fs := afero.NewOsFs()
	meta, err := newMetadata(ctx, cfg, fs, nil)
	if err != nil {
		return &configError{err}
	}

	att, err := newAttestation(cfg, log)
	if err != nil {
		return &configError{err}
	}
	// A control plane's lock registers hold its role (nodelock.ControlPlaneLockID), the role metadata
	// gives this instance, as the InitServer and the joinservice use it.
	for i, m := range att.markers {
		att.markers[i] = nodelock.ForRole(m, func(ctx context.Context) (bool, error) {
			self, err := meta.Self(ctx)
			if err != nil {
				return false, err
			}
			return self.Role == metadata.RoleControlPlane, nil
		})
	}
	// Nothing reads node state or attests before the state disk is open.
	stage, err := openStateDisk(ctx, cfg, log, meta, att)
	if err != nil {
		return err
	}
	diskUUID := cfg.diskUUID
	if stage != nil {
		diskUUID = stage.UUID()
	} else if diskUUID == "" {
		if diskUUID, err = randomUUID(); err != nil {
			return fmt.Errorf("generating a disk UUID: %w", err)
		}
	}

	exec := command.Runner{Children: children}
	var closeKubeletLog func() error
	var kube interface {
		Start(ctx context.Context) error
		Stop(ctx context.Context) error
		Run(ctx context.Context) error
	}
	switch cfg.kubelet {
	case "systemd":
		kube = &kubelet.Systemd{Exec: exec}
	case "process":
		if err := os.MkdirAll(cfg.stateDir, 0o700); err != nil {
			return fmt.Errorf("creating state directory: %w", err)
		}
		logFile, err := os.OpenFile(filepath.Join(cfg.stateDir, "kubelet.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("opening kubelet log: %w", err)
		}
		defer logFile.Close()
		closeKubeletLog = logFile.Close
		kube = &kubelet.Supervisor{Path: cfg.kubeletPath, KubeletDir: cfg.kubeletDir, KubernetesDir: cfg.kubernetesDir,
			Output: logFile, Log: log.Named("kubelet"), Children: children}
	}
	adm := &kubeadm.Runner{Path: cfg.kubeadmPath, IgnorePreflightErrors: cfg.ignorePreflt, Exec: exec}

	markers := append(att.markers, nodelock.NewFileMarker(fs, filepath.Join(cfg.stateDir, "bootstrapped")))
	lock := bootstrapper.NewRace(nodelock.New(markers...))
	state := nodestate.NewStore(fs, filepath.Join(cfg.stateDir, "node-state.json"))

	initConfig := initcluster.Config{
		StateDir: cfg.stateDir, KubernetesDir: cfg.kubernetesDir, CRISocket: cfg.criSocket, CgroupDriver: cfg.cgroupDriver,
		KubeProxyMode: cfg.kubeProxyMode, NeverPull: cfg.neverPull, KubeletExtraArgs: cfg.kubeletExtraArgs(),
		KubeProxyConntrackMaxPerCore: cfg.kubeProxyConntrackMaxPerCore(), EtcdDir: cfg.etcdDir,
	}
	installer := components.New(components.Config{
		ManifestDir: cfg.componentsDir, JoinServiceImage: cfg.joinImage, ImagePullPolicy: pullPolicy(cfg.neverPull),
		WebhookImage: cfg.webhookImage,
		JoinServiceEnv: map[string]string{
			joinconfig.EnvMetadata: cfg.metadata, joinconfig.EnvMetadataURL: cfg.metadataURL, joinconfig.EnvMetadataAPIURL: cfg.metadataAPI,
			joinconfig.EnvMetadataFile: cfg.metadataFile, joinconfig.EnvAttestation: cfg.attestation, joinconfig.EnvTPM: cfg.tpm,
		},
		JoinServiceHostPaths: berthsystem.TPMHostPaths(cfg.tpm),
	}, fs)
	// A control plane's KMS plugin runs as this daemon's child, which holds its keys (kmskeeper).
	self, err := selfPath()
	if err != nil {
		return fmt.Errorf("finding the daemon's binary for the KMS plugin: %w", err)
	}
	plugin := &kmsplugin.Supervisor{Path: self, Args: kmsPluginArgs(cfg), Stderr: os.Stderr, Log: log.Named("kmsplugin")}
	keeper := kmskeeper.New(kmskeeper.Config{StateDir: cfg.stateDir, KubernetesDir: cfg.kubernetesDir, Socket: cfg.kmsSocket},
		fs, log.Named("kmskeeper"), plugin, func(ctx context.Context) (string, string, error) {
			inst, err := meta.Self(ctx)
			if err != nil {
				return "", "", err
			}
			if len(inst.IPs) == 0 {
				return "", "", fmt.Errorf("metadata gives node %s no address", inst.Name)
			}
			return inst.Name, inst.IPs[0], nil
		})
	if cfg.diskBackend == "none" {
		log.Warn("no state disk: a control plane keeps its KMS keys unencrypted in the state directory (development only)")
	}
	initer := initcluster.New(initConfig, fs, meta, adm, kube, apiserver.Waiter{}, installer).WithKMS(keeper, keeper.Encryption())
	initOpts := []initserver.Option{initserver.WithServerOptions(
		grpc.Creds(att.serverCreds),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 15 * time.Second}),
	), initserver.WithSnapshotDir(cfg.restoreDir)}
	if stage != nil {
		initOpts = append(initOpts, initserver.WithDisk(stage))
	}
	initSrv := initserver.New(log.Named("initserver"), lock, meta, initer, state, initOpts...)

	joiner := joincluster.New(joincluster.Config{
		StateDir: cfg.stateDir, KubernetesDir: cfg.kubernetesDir, KubeletDir: cfg.kubeletDir, CRISocket: cfg.criSocket,
		KubeletExtraArgs: cfg.kubeletExtraArgs(), NeverPull: cfg.neverPull,
	}, log.Named("join"), fs, lock, adm, kube, state).WithKMS(keeper)
	if stage != nil {
		joiner = joiner.WithDisk(stage)
	}
	joinClient := joinclient.New(log.Named("joinclient"), meta, att.dialJoin, joiner, diskUUID).WithPort(cfg.joinPort).
		WithTrace(jointrace.NewRecorder(log.Named("jointrace"), fs, filepath.Join(cfg.stateDir, jointrace.FileName)),
			joinclient.KubeletReadiness{Kubeconfig: filepath.Join(cfg.kubernetesDir, "kubelet.conf")})

	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", cfg.initListen)
	if err != nil {
		return fmt.Errorf("listening for init: %w", err)
	}
	deps := bootstrapper.Deps{
		Log: log, Lock: lock, State: state, InitListener: lis, InitServer: initSrv, JoinClient: joinClient, Kubelet: kube,
		KMS: keeper, KMSPlugin: plugin,
	}
	if cfg.kubelet == "process" {
		// Where the daemon supervises the kubelet it is the node's supervisor and renews the
		// control-plane certificates itself; under systemd berth-cert-renew.timer does
		// (bootstrapper renew-certs).
		deps.CertRenewer = certrenew.New(certrenew.Config{KubernetesDir: cfg.kubernetesDir}, log.Named("certrenew"), fs, adm)
	}
	if stage != nil && stage.CheckInPending() {
		// No joinservice answered the boot's check-in (a full power cut): ask again while the node
		// runs; a REVOKED answer then stops the kubelet, its pods and (where its root is on the
		// state disk) the container runtime as part of the lock.
		stop := &lockStop{log: log.Named("lockstop"), kubelet: kube, criSocket: cfg.criSocket, closeLog: closeKubeletLog}
		if cfg.runtimePidFile != "" {
			stop.runtime = pidFileRuntime{path: cfg.runtimePidFile}
		}
		deps.CheckIn = func(ctx context.Context) error { return stage.KeepCheckingIn(ctx, stop.Stop) }
	}
	if cfg.webhookImage != "" {
		// Only the webhook has anything to check after a restart; without it there is nothing to log.
		webhook := install.Config{Image: cfg.webhookImage, ImagePullPolicy: pullPolicy(cfg.neverPull)}
		deps.Reconcile = func(ctx context.Context) error {
			return install.Reconcile(ctx, webhook, filepath.Join(cfg.kubernetesDir, "admin.conf"), lineLogger{log.Named("components")})
		}
	}
	err = bootstrapper.Run(ctx, deps)
	if err != nil {
		log.Error("bootstrapper failed", zap.Error(err))
		return err
	}
	log.Info("bootstrapper done")
	return nil
}

func pullPolicy(never bool) string {
	if never {
		return "Never"
	}
	return "IfNotPresent"
}

// lineLogger logs each line the component installer prints as one log entry.
type lineLogger struct{ log *zap.Logger }

func (l lineLogger) Write(p []byte) (int, error) {
	for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		if line != "" {
			l.log.Info("component installer", zap.String("step", line))
		}
	}
	return len(p), nil
}
