package cli

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/choose"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/policy/policyedit"
	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/initclient"
	"github.com/berth-k8s/berth/internal/initconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/webhook"
	"github.com/berth-k8s/berth/internal/workspace"
)

// ErrInitRejected is returned when the node refuses the init request without saying why (wrong
// init secret, or not the node the operator meant).
var ErrInitRejected = errors.New("the node rejected the init request: wrong init secret, or not the node you meant")

// ErrInitFailed is returned when the node answered with an InitFailure.
var ErrInitFailed = errors.New("init failed")

type initOptions struct {
	endpoint       string
	configPath     string
	workspace      string
	insecure       bool
	connectTimeout time.Duration
	timeout        time.Duration
	verbose        bool
	// restore, when set, makes this init a restore of the snapshot (berth restore).
	restore *restoreSource
}

func newInitCmd() *cobra.Command {
	o := initOptions{workspace: ".", connectTimeout: 5 * time.Minute, timeout: 30 * time.Minute}
	cmd := &cobra.Command{
		Use:   "init --endpoint HOST:PORT --config FILE",
		Short: "Initialize a cluster on its first control-plane node",
		Long: `init makes a fresh node the first control plane of a new cluster.

It generates the cluster's master secret and salt, writes them to the workspace (mode 0600)
before anything is sent, connects to the node's InitServer, proves it may initialize the node
with the init secret, and shows the node's progress phase by phase. On success it writes the
admin kubeconfig to the workspace.

If init fails part of the way (a phase failed, the connection broke, the node's daemon crashed),
run the same command again with the same workspace: the node resumes at the failed phase. The
workspace's master secret says which cluster the unfinished attempt locked the node for, so init
then accepts a node whose lock register (TPM PCR 15, TDX RTMR3) holds that cluster's ID instead of
zeros, and says so. A workspace that holds a finished cluster's admin.conf is never overwritten.

Nothing secret is sent before the node has proven, inside the TLS handshake, that it runs what
the attestation policy (attestationPolicyFile in the config) expects; a node that fails gets
nothing and init stops at once with the index, expected and actual value. Only with
--insecure-skip-attestation (development only) does init talk to an unattested node.

The config file is a config.berth.dev/v1alpha1 ClusterConfiguration (every field:
internal/clusterconfig/REFERENCE.md; a JSON schema for editors: berth config schema):
  apiVersion: config.berth.dev/v1alpha1
  kind: ClusterConfiguration
  clusterName: berth
  kubernetesVersion: ` + k8sversion.Default().Kubernetes + `   # supported: ` + k8sversion.SupportedList() + `
  networking: {serviceSubnet: 10.96.0.0/12, podSubnet: 10.244.0.0/16}
  apiServer:
    certSANs: [198.51.100.10]
    extraArgs: [{name: max-requests-inflight, value: "800"}]
    audit: {policy: {rules: [{level: Metadata}]}}
  kubelet: {maxPods: 200}                # the kubelet's own v1beta1 KubeletConfiguration
  kubeProxy: {mode: nftables}            # kube-proxy's own v1alpha1 KubeProxyConfiguration
  initSecretFile: init-secret
  policies:
    attestationPolicyFile: policy.yaml   # optional
    joinPolicyFile: join-policy.yaml     # optional, see below
    imagePolicyFile: images.yaml         # optional
  components: {skipKubeProxy: false, skipCoreDNS: false}
A malformed file (an unknown field, a wrong type, an override of Berth's PodSecurity admission) is
refused, naming the field, before init contacts the node. The unversioned file of earlier releases
is still read, with a warning. The cluster keeps the configuration in force (without the paths and
the init secret) in the ConfigMap kube-system/berth-cluster-config; berth config diff compares a
file with it.

Nodes that join check the cluster's joinservice against a join policy (the bootstrapper's
BERTH_JOIN_POLICY: the image's measurements, a set lock register, the EK CAs). With joinPolicyFile,
init writes that policy, self-contained and with the cluster's attestation-key CA in akRoots, to
the workspace's join-policy.yaml once the master secret exists (the CA is derived from it; the
file holds nothing secret). Give that file to the nodes you create from then on, where they read
their join policy: their joins then cost the joinservice no TPM work (it shows a certified key and
a session proof renewed every 10 s). A node with a policy without the CA, such as one created
before init, still joins; the joinservice's TPM then proves its key to that node in the handshake.

The node's progress goes to stderr; the result (cluster ID, admin kubeconfig, join policy) to stdout.`,
		Example: `  berth init --endpoint 198.51.100.10:9000 --config cluster.yaml --workspace ./my-cluster
  export KUBECONFIG=$PWD/my-cluster/admin.conf && berth status`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runInit(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), o)
		},
	}
	addInitFlags(cmd, &o)
	return cmd
}

// addInitFlags registers the flags init and restore share.
func addInitFlags(cmd *cobra.Command, o *initOptions) {
	f := cmd.Flags()
	f.StringVar(&o.endpoint, "endpoint", "", "HOST:PORT of the node's InitServer (required)")
	f.StringVar(&o.configPath, "config", "", "cluster config file (required)")
	f.StringVar(&o.workspace, "workspace", o.workspace, "directory for the cluster's admin kubeconfig, master secret and init log")
	f.BoolVar(&o.insecure, "insecure-skip-attestation", false, "send secrets without verifying the node's attestation (development only)")
	f.DurationVar(&o.connectTimeout, "connect-timeout", o.connectTimeout, "how long to keep trying to reach the node before init starts")
	f.DurationVar(&o.timeout, "timeout", o.timeout, "overall limit for init once connected")
	f.BoolVarP(&o.verbose, "verbose", "v", false, "also print the node's init output (always saved to the workspace's init.log)")
	_ = cmd.MarkFlagRequired("endpoint")
	_ = cmd.MarkFlagRequired("config")
}

// loadInitConfig reads the config file and its init secret, printing its warnings to errOut; its
// errors are usage errors.
func loadInitConfig(path string, errOut io.Writer) (initconfig.Config, []byte, error) {
	cfg, secret, warnings, err := initconfig.Load(path)
	printWarnings(errOut, path, warnings)
	if err != nil {
		return cfg, nil, usageErr("%w", err)
	}
	return cfg, secret, nil
}

// printWarnings prints the warnings about a file the operator gave.
func printWarnings(errOut io.Writer, path string, warnings []string) {
	for _, w := range warnings {
		_, _ = fmt.Fprintf(errOut, "warning: %s: %s\n", path, w)
	}
}

// readConfigFile reads a file the config names; its error is a usage error.
func readConfigFile(path string) ([]byte, error) {
	data, err := initconfig.ReadFile(path)
	if err != nil {
		return nil, usageErr("%w", err)
	}
	return data, nil
}

// checkWorkspace creates the workspace and refuses one that holds a finished cluster.
func checkWorkspace(dir string) error {
	return workspaceErr(dir, workspace.Create(dir))
}

// workspaceErr turns the refusal of a finished workspace into a usage error.
func workspaceErr(dir string, err error) error {
	if errors.Is(err, workspace.ErrFinished) {
		return usageErr("workspace %s already holds a cluster's %s; use another --workspace", dir, workspace.AdminConf)
	}
	return err
}

// prepareWorkspace returns the master secret and salt: those of an earlier, unfinished attempt (so
// the node can resume), or new ones, written to the workspace before anything is sent.
func prepareWorkspace(dir string, out io.Writer) (master, salt []byte, err error) {
	master, salt, resumed, err := workspace.PrepareSecret(dir)
	if err != nil {
		return nil, nil, workspaceErr(dir, err)
	}
	path := filepath.Join(dir, workspace.MasterSecret)
	if resumed {
		_, _ = fmt.Fprintf(out, "Resuming with the master secret in %s\n", path)
		return master, salt, nil
	}
	_, _ = fmt.Fprintf(out, "Wrote the cluster's master secret to %s (keep it safe: it is the root of every cluster key)\n", path)
	return master, salt, nil
}

// runInit initializes the cluster: progress and warnings go to errOut, the result to out.
func runInit(ctx context.Context, out, errOut io.Writer, o initOptions) error {
	cfg, secret, err := loadInitConfig(o.configPath, errOut)
	if err != nil {
		return err
	}
	clusterConfig, err := clusterconfig.Marshal(cfg.InCluster())
	if err != nil {
		return err
	}
	policyBytes, err := readConfigFile(cfg.Policies.AttestationPolicyFile)
	if err != nil {
		return err
	}
	if len(policyBytes) > 0 {
		// The node and its joinservice get the policy without the files beside it.
		policyFile := cfg.Policies.AttestationPolicyFile
		if policyBytes, err = policyedit.Inline(policyBytes, filepath.Dir(policyFile)); err != nil {
			return usageErr("%s: %w", policyFile, err)
		}
	}
	joinPolicy, err := loadJoinPolicy(cfg.Policies.JoinPolicyFile)
	if err != nil {
		return err
	}
	if err := checkWorkspace(o.workspace); err != nil {
		return err
	}
	resumed, err := workspace.Unfinished(o.workspace)
	if err != nil {
		return err
	}
	var validator choose.Validator
	switch {
	case o.insecure:
	case cfg.Policies.AttestationPolicyFile == "":
		return usageErr("config %s has no attestationPolicyFile: berth init verifies the node against it before sending secrets (or pass --insecure-skip-attestation, development only)", o.configPath)
	default:
		p, err := policy.Load(cfg.Policies.AttestationPolicyFile)
		if err != nil {
			return usageErr("attestation policy: %w", err)
		}
		for _, w := range p.Warnings {
			_, _ = fmt.Fprintf(errOut, "warning: %s\n", w)
		}
		if resumed != nil {
			if idx, ok := initclient.AcceptResumedLock(p, resumed.ClusterID()); ok {
				_, _ = fmt.Fprintf(errOut, "Resuming the unfinished init in %s (cluster ID %x): the node may be fresh or hold this cluster's ID in its lock register (index %d)\n",
					o.workspace, resumed.ClusterID(), idx)
			}
		}
		if validator, err = choose.NewValidator(p, zap.NewNop()); err != nil {
			return usageErr("attestation policy: %w", err)
		}
	}
	imagePolicy, err := readConfigFile(cfg.Policies.ImagePolicyFile)
	if err != nil {
		return err
	}
	if len(imagePolicy) > 0 {
		p, err := webhook.ParsePolicy(imagePolicy)
		if err != nil {
			return usageErr("%s: %w", cfg.Policies.ImagePolicyFile, err)
		}
		printWarnings(errOut, cfg.Policies.ImagePolicyFile, p.Warnings)
	}
	conn, verdict, err := dialNode(ctx, errOut, o.endpoint, validator, o.connectTimeout)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if ev := verdict.Accepted(); ev != nil {
		_, _ = fmt.Fprintf(errOut, "Node attested (%s): %d measurements match the policy\n", ev.Variant, len(ev.Result.Measurements))
		for _, w := range ev.Result.Warnings {
			_, _ = fmt.Fprintf(errOut, "  warning: %s\n", w)
		}
	}
	// Only now, with the node verified, the cluster's secrets come into being (or are reloaded to
	// resume an earlier attempt); they reach the disk before they reach the wire.
	var master, salt []byte
	if o.restore != nil {
		master, salt, err = adoptWorkspace(o.workspace, o.restore, errOut)
	} else {
		master, salt, err = prepareWorkspace(o.workspace, errOut)
	}
	if err != nil {
		return err
	}
	joinPolicyPath, err := publishJoinPolicy(o.workspace, joinPolicy, master, salt, errOut)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	req := &initproto.InitRequest{
		InitSecret:        secret,
		MasterSecret:      master,
		Salt:              salt,
		ClusterName:       cfg.ClusterName,
		KubernetesVersion: cfg.KubernetesVersion,
		ServiceCidr:       cfg.Networking.ServiceSubnet,
		PodCidr:           cfg.Networking.PodSubnet,
		ApiserverCertSans: cfg.APIServer.CertSANs,
		ClusterConfig:     clusterConfig,
		AttestationPolicy: policyBytes,
		Components: &initproto.Components{
			SkipKubeProxy: cfg.Components.SkipKubeProxy,
			SkipCoredns:   cfg.Components.SkipCoreDNS,
			ImagePolicy:   imagePolicy,
		},
	}
	var stream initclient.Stream
	if o.restore != nil {
		stream, err = sendRestore(ctx, initproto.NewInitServiceClient(conn), req, o.restore, errOut)
	} else {
		stream, err = initproto.NewInitServiceClient(conn).Init(ctx, req)
	}
	if err != nil {
		return fmt.Errorf("starting init: %w", err)
	}
	logFile, err := workspace.OpenInitLog(o.workspace)
	if err != nil {
		return err
	}
	defer logFile.Close()
	return receiveInit(stream, out, errOut, logFile, o, joinPolicyPath)
}

// publishJoinPolicy writes the cluster's join policy (joinPolicy with the cluster's attestation-key
// CA) into the workspace and returns its path; "" when the config names no join policy.
func publishJoinPolicy(dir string, joinPolicy, master, salt []byte, errOut io.Writer) (string, error) {
	if joinPolicy == nil {
		return "", nil
	}
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		return "", err
	}
	data, err := clusterJoinPolicy(joinPolicy, keys)
	if err != nil {
		return "", err
	}
	if err := checkJoinPolicy(data, workspace.JoinPolicy); err != nil {
		return "", err
	}
	path, err := workspace.WriteJoinPolicy(dir, data)
	if err != nil {
		return "", err
	}
	_, _ = fmt.Fprintf(errOut, "Wrote the join policy for this cluster's new nodes to %s (with the cluster's attestation-key CA)\n", path)
	return path, nil
}

// receiveInit shows the node's progress on errOut (and its output with --verbose) and writes the
// result to out.
func receiveInit(stream initclient.Stream, out, errOut, logFile io.Writer, o initOptions, joinPolicyPath string) error {
	start := time.Now()
	started := map[string]time.Time{}
	success, err := initclient.Receive(stream, initclient.Handler{
		Progress: func(p *initproto.Progress) {
			label := fmt.Sprintf("[%d/%d] %-17s", p.GetIndex(), p.GetTotal(), p.GetPhase())
			switch p.GetState() {
			case initproto.PhaseState_PHASE_STATE_STARTED:
				started[p.GetPhase()] = time.Now()
				_, _ = fmt.Fprintf(errOut, "%s started\n", label)
			case initproto.PhaseState_PHASE_STATE_SUCCEEDED:
				_, _ = fmt.Fprintf(errOut, "%s done in %s\n", label, time.Since(started[p.GetPhase()]).Round(time.Millisecond))
			case initproto.PhaseState_PHASE_STATE_SKIPPED:
				_, _ = fmt.Fprintf(errOut, "%s skipped (%s)\n", label, p.GetMessage())
			case initproto.PhaseState_PHASE_STATE_FAILED:
				_, _ = fmt.Fprintf(errOut, "%s FAILED after %s\n", label, time.Since(started[p.GetPhase()]).Round(time.Millisecond))
			}
		},
		Log: func(data []byte) {
			_, _ = logFile.Write(data)
			if o.verbose {
				_, _ = errOut.Write(data)
			}
		},
	})
	var failure *initclient.FailureError
	switch {
	case err == nil:
		verb := "initialized"
		if o.restore != nil {
			verb = "restored"
		}
		return writeInitResult(out, o.workspace, verb, success, time.Since(start), joinPolicyPath)
	case errors.Is(err, initclient.ErrNoResult):
		return errors.New("the node ended init without a result; see the node's log")
	case errors.Is(err, initclient.ErrRejected):
		return &exitError{code: exitRejected, err: ErrInitRejected}
	case errors.Is(err, initclient.ErrRateLimited):
		return errors.New("the node is rate-limiting init requests: wait a few seconds, then run the same command again")
	case errors.As(err, &failure):
		f := failure.Failure
		msg := fmt.Sprintf("%s: %s", strings.TrimPrefix(f.GetCode().String(), "FAILURE_CODE_"), f.GetMessage())
		if f.GetRetryable() {
			msg += fmt.Sprintf("\nThe node's output is in %s. Run the same command again to resume.", filepath.Join(o.workspace, workspace.InitLog))
		}
		return fmt.Errorf("%w: %s", ErrInitFailed, msg)
	default:
		return fmt.Errorf("init interrupted after %s: %w; run the same command again to resume", time.Since(start).Round(time.Second), err)
	}
}

func writeInitResult(out io.Writer, dir, verb string, s *initproto.InitSuccess, took time.Duration, joinPolicyPath string) error {
	if len(s.GetKubeconfig()) == 0 {
		return errors.New("the node reported success without a kubeconfig")
	}
	adminPath, err := workspace.WriteResult(dir, s.GetKubeconfig(), s.GetClusterId())
	if err != nil {
		return err
	}
	idHex := hex.EncodeToString(s.GetClusterId())
	if abs, err := filepath.Abs(adminPath); err == nil {
		adminPath = abs // the printed commands work from any directory
	}
	_, _ = fmt.Fprintf(out, "\nCluster %s in %s.\nCluster ID: %s\nAdmin kubeconfig: %s\n", verb, took.Round(time.Millisecond), idHex, adminPath)
	if joinPolicyPath != "" {
		_, _ = fmt.Fprintf(out, "Join policy for new nodes (BERTH_JOIN_POLICY): %s\n", joinPolicyPath)
	}
	_, _ = fmt.Fprintf(out, "Use it with:\n  export KUBECONFIG=%s\n  berth status\n", adminPath)
	return nil
}

// dialNode connects to a node's attested gRPC endpoint (the InitServer, the recovery server), checking
// its attestation with validator (nil: skipped, with a warning), and waits until the connection is up
// or the verdict is known. Its warning and progress go to errOut.
func dialNode(ctx context.Context, errOut io.Writer, endpoint string, validator atls.Validator, timeout time.Duration) (*grpc.ClientConn, *initclient.Verdict, error) {
	if validator == nil {
		_, _ = fmt.Fprintln(errOut, "WARNING: attestation is skipped; the node's identity is not verified")
	}
	conn, verdict, err := initclient.NewConn(endpoint, validator)
	var endpointErr *initclient.EndpointError
	if errors.As(err, &endpointErr) {
		return nil, nil, usageErr("--endpoint %q: %w", endpoint, endpointErr.Err)
	}
	if err != nil {
		return nil, nil, err
	}
	_, _ = fmt.Fprintf(errOut, "Connecting to %s ...\n", endpoint)
	if err := initclient.WaitConnected(ctx, conn, timeout, verdict); err != nil {
		_ = conn.Close()
		if errors.Is(err, initclient.ErrAttestationFailed) {
			return nil, nil, &exitError{code: exitRejected, err: err}
		}
		return nil, nil, err
	}
	return conn, verdict, nil
}
