package vtpmtest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/prereq"
)

// Unavailable ends a test whose TPM is missing: it skips, saying why, and fails instead under
// CI=true, where nothing may skip silently.
func Unavailable(t testing.TB, why string) {
	t.Helper()
	prereq.Missing(t, "%s", why)
}

// SwtpmCA is a directory holding swtpm's local CA (created on first use by swtpm_localca) and the
// swtpm_setup configuration that uses it.
type SwtpmCA struct {
	Dir string
}

// NewSwtpmCA prepares a local CA directory under t.TempDir. It skips the test when swtpm's tools are
// not installed (Debian packages swtpm and swtpm-tools).
func NewSwtpmCA(t testing.TB) *SwtpmCA {
	t.Helper()
	for _, bin := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		if _, err := exec.LookPath(bin); err != nil {
			Unavailable(t, fmt.Sprintf("swtpm test needs %s (apt packages swtpm, swtpm-tools): %v", bin, err))
		}
	}
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "localca"), 0o700); err != nil {
		t.Fatal(err)
	}
	localca, _ := exec.LookPath("swtpm_localca")
	files := map[string]string{
		"swtpm_setup.conf": fmt.Sprintf("create_certs_tool = %s\ncreate_certs_tool_config = %s\ncreate_certs_tool_options = %s\n",
			localca, filepath.Join(dir, "swtpm-localca.conf"), filepath.Join(dir, "swtpm-localca.options")),
		"swtpm-localca.conf": fmt.Sprintf("statedir = %[1]s\nsigningkey = %[1]s/signkey.pem\nissuercert = %[1]s/issuercert.pem\ncertserial = %[1]s/certserial\n",
			filepath.Join(dir, "localca")),
		"swtpm-localca.options": "--platform-manufacturer Berth\n--platform-version 2.1\n--platform-model test\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return &SwtpmCA{Dir: dir}
}

// RootPEM returns the CA's root certificate (valid after the first StartSwtpm).
func (ca *SwtpmCA) RootPEM(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ca.Dir, "localca", "swtpm-localca-rootca-cert.pem"))
	if err != nil {
		t.Fatalf("reading swtpm local CA root: %v", err)
	}
	return b
}

// IssuerPEM returns the CA's intermediate certificate that signs EK certificates.
func (ca *SwtpmCA) IssuerPEM(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ca.Dir, "localca", "issuercert.pem"))
	if err != nil {
		t.Fatalf("reading swtpm local CA issuer: %v", err)
	}
	return b
}

// Swtpm is a running swtpm process with an EK certificate from its CA.
type Swtpm struct {
	// Spec is the BERTH_TPM value for this TPM ("unix:PATH").
	Spec string
	// Open opens a connection to the TPM's data channel.
	Open vtpm.OpenFunc
	cmd  *exec.Cmd
	ctrl string // swtpm's control channel socket
}

// StartSwtpm manufactures a TPM state with an RSA EK certificate signed by ca and serves it over a
// unix socket. The process is stopped and waited for in t.Cleanup.
func StartSwtpm(t testing.TB, ca *SwtpmCA) *Swtpm {
	t.Helper()
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	setup := exec.CommandContext(ctx, "swtpm_setup", "--tpm2", "--tpmstate", state, "--create-ek-cert",
		"--config", filepath.Join(ca.Dir, "swtpm_setup.conf"), "--overwrite")
	if out, err := setup.CombinedOutput(); err != nil {
		t.Fatalf("swtpm_setup: %v\n%s", err, out)
	}
	sock := filepath.Join(dir, "tpm.sock")
	cmd := exec.CommandContext(ctx, "swtpm", "socket", "--tpm2", "--tpmstate", "dir="+state,
		"--server", "type=unixio,path="+sock, "--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--flags", "not-need-init,startup-clear", "--log", "file="+filepath.Join(dir, "swtpm.log"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting swtpm: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	// swtpm opens its socket shortly after it starts: poll for it every 20 ms for up to 10 s.
	const (
		socketPoll    = 20 * time.Millisecond
		socketTimeout = 10 * time.Second
	)
	var d net.Dialer
	var last error
	if err := wait.PollUntilContextTimeout(ctx, socketPoll, socketTimeout, true, func(ctx context.Context) (bool, error) {
		c, err := d.DialContext(ctx, "unix", sock)
		if last = err; err != nil {
			return false, nil
		}
		_ = c.Close()
		return true, nil
	}); err != nil {
		t.Fatalf("swtpm did not open %s: %v", sock, last)
	}
	open, err := vtpm.OpenerFromSpec("unix:" + sock)
	if err != nil {
		t.Fatal(err)
	}
	return &Swtpm{Spec: "unix:" + sock, Open: open, cmd: cmd, ctrl: filepath.Join(dir, "ctrl.sock")}
}

// PID is the swtpm process's ID, for harnesses that account the TPM's CPU time.
func (s *Swtpm) PID() int { return s.cmd.Process.Pid }

// swtpm control channel commands (swtpm's ctrl protocol: big-endian command code, then its payload).
const ctrlCmdInit = 0x02 // CMD_INIT: re-initialize the TPM as a power cycle does

// Reset power-cycles the TPM as a reboot would: CMD_INIT on the control channel, then
// TPM2_Startup(CLEAR). Volatile state (PCRs, loaded objects, sessions) is lost, NV and persistent
// objects stay.
func (s *Swtpm) Reset(ctx context.Context) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", s.ctrl)
	if err != nil {
		return fmt.Errorf("connecting to swtpm control channel: %w", err)
	}
	defer c.Close()
	if d, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(d)
	}
	req := binary.BigEndian.AppendUint32(nil, ctrlCmdInit)
	req = binary.BigEndian.AppendUint32(req, 0) // init flags: keep the state
	if _, err := c.Write(req); err != nil {
		return fmt.Errorf("sending CMD_INIT: %w", err)
	}
	var rsp [4]byte
	if _, err := io.ReadFull(c, rsp[:]); err != nil {
		return fmt.Errorf("reading CMD_INIT result: %w", err)
	}
	if rc := binary.BigEndian.Uint32(rsp[:]); rc != 0 {
		return fmt.Errorf("CMD_INIT: TPM result %#x", rc)
	}
	rwc, err := s.Open(ctx)
	if err != nil {
		return err
	}
	defer rwc.Close()
	_, err = tpm2.Startup{StartupType: tpm2.TPMSUClear}.Execute(transport.FromReadWriter(rwc))
	if err != nil && !errors.Is(err, tpm2.TPMRCInitialize) { // swtpm's startup-clear flag may have started it
		return fmt.Errorf("TPM2_Startup: %w", err)
	}
	return nil
}
