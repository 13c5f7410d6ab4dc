package mini

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
)

// BootPCR is the PCR the simulated boot of a mini node measures into (PCR 4 holds the boot
// loader and kernel on a real machine).
const BootPCR = 4

// LockPCR is the PCR the bootstrappers' node lock extends the cluster ID into.
const LockPCR = 15

// bootEvent is what a node's simulated boot measures: the same for every genuine node, different
// for a tampered one.
func bootEvent(tampered bool) [32]byte {
	if tampered {
		return sha256.Sum256([]byte("berth mini boot: tampered image"))
	}
	return sha256.Sum256([]byte("berth mini boot: genuine image"))
}

// ExpectedBootPCR is the value of BootPCR after a genuine node's simulated boot (one extend from
// the reset value of zeros).
func ExpectedBootPCR() string {
	ev := bootEvent(false)
	var zero [32]byte
	sum := sha256.Sum256(append(zero[:], ev[:]...))
	return hex.EncodeToString(sum[:])
}

// measureBoot extends node n's simulated boot into its TPM, the way firmware measures a machine's
// boot chain before any Berth code runs. It retries while swtpm is still starting.
func (c *Cluster) measureBoot(ctx context.Context, n Node) error {
	ev := bootEvent(n.Tampered)
	if err := c.tpmCommand(ctx, n, "tpm2_pcrextend", fmt.Sprintf("%d:sha256=%s", BootPCR, hex.EncodeToString(ev[:]))); err != nil {
		return fmt.Errorf("measuring boot: %w", err)
	}
	return nil
}

// clearTPM clears node n's TPM (TPM2_Clear with the empty lockout authorization): every object
// under the storage and endorsement hierarchies created since manufacturing, such as a sealed disk
// key, becomes unusable, while the EK certificate (written under the platform hierarchy) stays.
func (c *Cluster) clearTPM(ctx context.Context, n Node) error {
	if err := c.tpmCommand(ctx, n, "tpm2_clear"); err != nil {
		return fmt.Errorf("clearing TPM: %w", err)
	}
	c.log.Info("cleared the node's TPM: its sealed keys are gone", zap.String("node", n.Name))
	return nil
}

// tpmCommand runs a tpm2-tools command against node n's swtpm from inside the node's network
// namespace, retrying while swtpm is still starting.
func (c *Cluster) tpmCommand(ctx context.Context, n Node, tool string, args ...string) error {
	cmd := Cmd{Path: "nsenter", Args: append([]string{"--net=" + filepath.Join(c.env.NetnsRoot, c.cfg.NodeNetns(n.Name)), "--",
		tool, "-T", fmt.Sprintf("swtpm:host=127.0.0.1,port=%d", TPMPort)}, args...)}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var last error
	if err := wait.PollUntilContextCancel(wctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, last = c.run.Run(ctx, cmd)
		return last == nil, nil
	}); err != nil {
		return fmt.Errorf("%w (last: %w)", err, last)
	}
	return nil
}

// policyFile is the cluster's attestation policy, which berth init checks the first node against
// and the joinservice checks every joining node against: the genuine boot in BootPCR, a lock
// register that is still zero (a fresh node), EK certificates rooted in the mini-local CA.
func (c *Cluster) policyFile() []byte {
	return []byte(fmt.Sprintf(`# Written by berth mini.
apiVersion: config.berth.dev/v1alpha1
kind: AttestationPolicy
variant: tpm
measurements:
  %d:
    expected: %s
    mode: enforce
    source: berth mini simulated boot of a genuine node image
  %d:
    expected: %s
    mode: enforce
    source: lock register of a fresh node
trustRoots:
  - file: %s
  - file: %s
`, BootPCR, ExpectedBootPCR(), LockPCR, strings.Repeat("00", 32), c.cfg.TPMCARoot(), c.cfg.TPMCAIntermediate()))
}

// joinPolicyFile is what a joining node of the mini image demands of the joinservice: the same
// genuine boot, and a lock register that is set (it runs on a bootstrapped node; the node also
// checks it holds the cluster ID of the ticket). berth init adds the cluster's attestation-key CA.
func (c *Cluster) joinPolicyFile() []byte {
	return []byte(fmt.Sprintf(`# Written by berth mini.
apiVersion: config.berth.dev/v1alpha1
kind: AttestationPolicy
variant: tpm
measurements:
  %d:
    expected: %s
    mode: enforce
    source: berth mini simulated boot of a genuine node image
  %d:
    nonZero: true
    mode: enforce
    source: the joinservice runs on a bootstrapped node
trustRoots:
  - file: %s
  - file: %s
`, BootPCR, ExpectedBootPCR(), LockPCR, c.cfg.TPMCARoot(), c.cfg.TPMCAIntermediate()))
}
