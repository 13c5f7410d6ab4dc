package cli

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/workspace"
	"github.com/berth-k8s/berth/recoverproto"
)

// ErrWrongMasterSecret is returned when the master secret does not derive the cluster ID of the
// node's state disk: nothing is sent.
var ErrWrongMasterSecret = errors.New("wrong master secret or wrong node")

// ErrDiskNotBound is returned when the node's state disk is not bound to the machine that attested:
// nothing is sent.
var ErrDiskNotBound = errors.New("the state disk is not bound to this machine")

// ErrNoMachineIdentity is returned when the node's attestation proves no machine identity, so no
// disk binding can be checked: nothing is sent.
var ErrNoMachineIdentity = errors.New("the node's attestation proves no machine identity")

// ErrKeyRefused is returned when the node says the key does not open its state disk.
var ErrKeyRefused = errors.New("the node refused the disk key")

type recoverOptions struct {
	endpoint       string
	masterSecret   string
	policyPath     string
	insecure       bool
	nodeName       string
	connectTimeout time.Duration
	timeout        time.Duration
}

func newRecoverCmd() *cobra.Command {
	o := recoverOptions{connectTimeout: 5 * time.Minute, timeout: 2 * time.Minute}
	cmd := &cobra.Command{
		Use:   "recover --endpoint NODE:PORT --master-secret FILE --policy FILE",
		Short: "Give a node that cannot open its state disk the key for it",
		Long: `recover lets a node that cannot open its encrypted state disk on its own boot again.

A node opens its state disk with the key sealed to its TPM; when that fails (its boot measured
differently, or its TPM was cleared) it asks the cluster's joinservices for a rejoin ticket. When
none answers, for example after a full power loss of the cluster, the node waits in its recovery
server (port ` + strconv.Itoa(recoverproto.DefaultPort) + `) for berth recover.

recover first has the node attest inside the TLS handshake and judges it against --policy (the
policy berth init used: a node waiting for recovery has not extended its lock register, so it
must be zero). It then asks which state disk the node waits for and which cluster that disk
belongs to, derives the cluster ID from the master secret (master-secret.json as berth init
wrote it) and refuses, sending nothing, when they differ. It then checks the disk binding the
node reports against the machine identity the node proved in its attestation (its TPM's
endorsement key, activated in the handshake) and refuses, sending nothing, unless the disk is
bound to that machine: a node cannot obtain the key of another machine's disk by naming its UUID.
Where the attestation proves no machine identity (TDX, or --insecure-skip-attestation) the disk is
bound to the node's instance name, which --node-name gives; without it nothing is sent.
Otherwise it sends the node the key derived for that one disk on that one machine. The master
secret itself stays on this machine; neither it nor the key is printed.

Exit code 3: the node failed attestation, proved no machine identity, the master secret is not
that of the node's cluster, the disk is not bound to the node, or the node refused the key. Only with --insecure-skip-attestation (development only) does
recover talk to an unattested node. Progress goes to stderr, the result to stdout.`,
		Example: `  berth recover --endpoint 198.51.100.10:9001 --master-secret my-cluster/master-secret.json --policy policy.yaml`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runRecover(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.endpoint, "endpoint", "", "NODE:PORT of the node's recovery server (required)")
	f.StringVar(&o.masterSecret, "master-secret", "", "the cluster's master-secret.json, as berth init wrote it (required)")
	f.StringVar(&o.policyPath, "policy", "", "attestation policy (YAML) the node must satisfy (required unless --insecure-skip-attestation)")
	f.BoolVar(&o.insecure, "insecure-skip-attestation", false, "send the disk key without verifying the node's attestation (development only)")
	f.StringVar(&o.nodeName, "node-name", "", "the node's instance name, for a node whose attestation proves no machine identity (TDX, or without attestation)")
	f.DurationVar(&o.connectTimeout, "connect-timeout", o.connectTimeout, "how long to keep trying to reach the node")
	f.DurationVar(&o.timeout, "timeout", o.timeout, "overall limit once connected")
	return cmd
}

// diskUUID is the canonical form of a state disk's UUID.
var diskUUID = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// runRecover sends a waiting node its disk key: progress and warnings go to errOut, the result to out.
func runRecover(ctx context.Context, out, errOut io.Writer, o recoverOptions) error {
	switch {
	case o.endpoint == "" || o.masterSecret == "":
		return usageErr("recover needs --endpoint and --master-secret")
	case o.insecure && o.policyPath != "":
		return usageErr("--policy and --insecure-skip-attestation exclude each other")
	case !o.insecure && o.policyPath == "":
		return usageErr("recover needs --policy: it verifies the node against it before sending the disk key (or pass --insecure-skip-attestation, development only)")
	}
	keys, err := readMasterSecret(o.masterSecret)
	if err != nil {
		return err
	}
	var validator atls.Validator
	if !o.insecure {
		_, v, err := loadValidator(o.policyPath)
		if err != nil {
			return err
		}
		validator = v
	}
	conn, verdict, err := dialNode(ctx, errOut, o.endpoint, validator, o.connectTimeout)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if ev := verdict.Accepted(); !o.insecure {
		if ev == nil {
			return &exitError{code: exitRejected, err: errors.New("the connection carries no attestation of the node; nothing was sent")}
		}
		if err := lockRegisterZero(ev); err != nil {
			return &exitError{code: exitRejected, err: fmt.Errorf("%w; nothing was sent", err)}
		}
		_, _ = fmt.Fprintf(errOut, "Node attested (%s): %d measurements match the policy\n", ev.Variant, len(ev.Result.Measurements))
		for _, w := range ev.Result.Warnings {
			_, _ = fmt.Fprintf(errOut, "  warning: %s\n", w)
		}
	}

	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	client := recoverproto.NewRecoveryServiceClient(conn)
	info, err := client.Info(ctx, &recoverproto.InfoRequest{})
	if err != nil {
		return fmt.Errorf("asking the node for its state disk: %s", peerStatus(err))
	}
	uuid := info.GetDiskUuid()
	if !diskUUID.MatchString(uuid) {
		return fmt.Errorf("the node named no valid state disk UUID (%s); nothing was sent", quotePeer(uuid))
	}
	nodeCluster := info.GetClusterId()
	if len(nodeCluster) == 0 {
		return fmt.Errorf("the node's state disk %s is not bound to a cluster: there is nothing to recover; nothing was sent", uuid)
	}
	if ours := keys.ClusterID(); !bytes.Equal(ours, nodeCluster) {
		return &exitError{code: exitRejected, err: fmt.Errorf("the master secret in %s derives cluster ID %s; the node's state disk belongs to cluster %s: %w; nothing was sent",
			o.masterSecret, shortID(ours), shortID(nodeCluster), ErrWrongMasterSecret)}
	}
	_, _ = fmt.Fprintf(errOut, "The node waits for state disk %s of cluster %s, the cluster of this master secret\n", uuid, shortID(nodeCluster))
	identity, err := machineIdentity(verdict.Accepted(), o.insecure, o.nodeName)
	if err != nil {
		return &exitError{code: exitRejected, err: fmt.Errorf("%w; nothing was sent", err)}
	}
	diskKey, bound := keys.BoundDiskKey(uuid, identity, info.GetDiskBinding())
	if !bound {
		return &exitError{code: exitRejected, err: fmt.Errorf("state disk %s: %w that attested (the binding in its header is for another machine or none); nothing was sent", uuid, ErrDiskNotBound)}
	}
	defer clear(diskKey)
	_, _ = fmt.Fprintf(errOut, "State disk %s is bound to the attested machine\n", uuid)

	if _, err := client.Recover(ctx, &recoverproto.RecoverRequest{DiskKey: diskKey}); err != nil {
		switch status.Code(err) {
		case codes.InvalidArgument:
			return &exitError{code: exitRejected, err: fmt.Errorf("%w for state disk %s: %s", ErrKeyRefused, uuid, peerStatus(err))}
		case codes.FailedPrecondition:
			return fmt.Errorf("the node's state disk %s is already open (by a rejoin ticket or another berth recover): %s", uuid, peerStatus(err))
		}
		return fmt.Errorf("sending the disk key: %s; the node did not confirm: see its log (running the same command again is safe)", peerStatus(err))
	}
	_, _ = fmt.Fprintf(out, "Sent the disk key for state disk %s to %s; the node opened it and continues booting\n", uuid, o.endpoint)
	return nil
}

// readMasterSecret reads master-secret.json in the format berth init writes and derives the
// cluster's keys from it; what is wrong with the file is a usage error.
func readMasterSecret(path string) (*clusterkeys.Keys, error) {
	keys, err := workspace.LoadKeys(path)
	if err != nil {
		return nil, &exitError{code: exitUsage, err: err}
	}
	return keys, nil
}

// lockRegisterZero checks that the attested node has not extended its lock register: a node
// waiting for recovery has not opened its state disk, so it has not.
func lockRegisterZero(ev *atls.Evidence) error {
	var index uint32
	switch ev.Variant {
	case vtpm.Variant:
		index = vtpm.DefaultLockPCR
	case tdx.VariantName:
		index = 1 + tdx.DefaultLockRTMR
	default:
		return fmt.Errorf("the node attests with variant %s, which has no known lock register", quotePeer(ev.Variant))
	}
	got, ok := ev.Result.Measurements[index]
	if !ok {
		return fmt.Errorf("the node's attestation does not include its lock register (index %d)", index)
	}
	if len(got) == 0 || !bytes.Equal(got, make([]byte, len(got))) {
		return fmt.Errorf("the node's lock register (index %d) is %x, not zero: a node that waits for recovery has not extended it", index, got)
	}
	return nil
}

// machineIdentity is the identity the node's disk binding must name: the machine identity the node
// proved (its attested identity, its attestation key activated in the handshake), or, where the
// attestation proves none (TDX, --insecure-skip-attestation), "instance/" + the node name the
// operator gave, as the joinservice binds such a node's disk.
func machineIdentity(ev *atls.Evidence, insecure bool, nodeName string) ([]byte, error) {
	if !insecure && ev != nil && ev.Activated && len(ev.Result.Identity) > 0 {
		return ev.Result.Identity, nil
	}
	if nodeName != "" {
		return []byte("instance/" + nodeName), nil
	}
	if ev == nil {
		return nil, fmt.Errorf("%w: pass --node-name for a node whose attestation is skipped", ErrNoMachineIdentity)
	}
	return nil, fmt.Errorf("%w (variant %s: no hardware identity, or its attestation key was not activated): pass --node-name", ErrNoMachineIdentity, quotePeer(ev.Variant))
}

// shortID is the first 8 hex digits of a cluster ID.
func shortID(id []byte) string {
	h := hex.EncodeToString(id)
	if len(h) > 8 {
		return h[:8] + "…"
	}
	return h
}

// maxPeerText bounds what is shown of a text the node sent.
const maxPeerText = 200

// quotePeer renders a text the node sent as a quoted, printable ASCII string, shortened.
func quotePeer(s string) string {
	if len(s) > maxPeerText {
		s = s[:maxPeerText]
	}
	return strconv.QuoteToASCII(s)
}

// peerStatus renders a gRPC error whose message came from the node: code and quoted message.
func peerStatus(err error) string {
	st, _ := status.FromError(err)
	return st.Code().String() + " " + quotePeer(st.Message())
}
