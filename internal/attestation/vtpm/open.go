// Package vtpm is Berth's TPM 2.0 attestation variant and lock register, built on go-tpm.
//
// The Issuer quotes the node's PCRs with an attestation key (AK) it creates under the TPM's
// endorsement key (EK) and ships the EK certificate, the AK's creation record and the quote in one
// JSON Document. The Validator checks, cheapest first: document shape and variant, the nonce and
// user data bound into the quote, the AK's attributes, the quote signature, the quoted PCR digest, the
// EK certificate chain to the policy's trust roots, the AK's creation under that EK, and finally the
// PCR values against the policy.
//
// The LockRegister is the hardware half of the node lock: it extends the cluster ID into a PCR and
// reads it back.
//
// The Sealer (seal.go) seals a small secret, the state disk's key, to the boot PCRs and a lock
// register that is still zero, so that only the next unchanged boot, before it takes the lock, can
// unseal it. Result.Identity of a validated document, and Issuer.MachineIdentity on the node, is
// SHA-256 of the EK's public area: the same on every boot, different between TPMs.
//
// The TPM is reached through an OpenFunc: a device such as /dev/tpmrm0, swtpm's data port over TCP
// or a unix socket, or (in tests only) the reference simulator in package tpmsim.
//
// The AK lives at a persistent handle (DefaultAKHandle) so that a quote costs one TPM command plus
// PCR reads; the Issuer recreates it under the EK once per process, or when it finds it replaced.
// Use one Issuer per TPM per process.
//
// The AK's link to the certified EK is proven by credential activation (activation.go): the
// Validator, as an atls.Challenger, encrypts a fresh secret to the EK bound to the AK's name; only a
// TPM holding both recovers it (Issuer.Activate), and the quote must bind the secret. The AK's
// TPM2_CertifyCreation record (its parent is the EK) and its fixedTPM/restricted attributes are
// checked too, but they alone prove consistency, not possession: EK certificates are public. Plain
// Validate, as used offline by berth policy check, cannot repeat an activation.
package vtpm

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/google/go-tpm/tpm2/transport"
)

// OpenFunc opens a connection to a TPM. Every call returns a fresh connection the caller closes; ctx
// bounds the opening only, not the connection.
type OpenFunc func(ctx context.Context) (io.ReadWriteCloser, error)

// maxResponse bounds a TPM response; TPM 2.0 responses fit in 4 KiB, we allow some slack.
const maxResponse = 64 << 10

// OpenerFromSpec returns the opener for a BERTH_TPM value: "tcp:HOST:PORT" or "unix:PATH" for swtpm's
// data channel, otherwise the path of a TPM character device such as /dev/tpmrm0.
func OpenerFromSpec(spec string) (OpenFunc, error) {
	switch {
	case spec == "":
		return nil, errors.New("empty TPM spec")
	case strings.HasPrefix(spec, "tcp:"):
		addr := strings.TrimPrefix(spec, "tcp:")
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("parsing TPM address %q: %w", addr, err)
		}
		return dialer("tcp", addr), nil
	case strings.HasPrefix(spec, "unix:"):
		path := strings.TrimPrefix(spec, "unix:")
		return dialer("unix", path), nil
	default:
		return func(context.Context) (io.ReadWriteCloser, error) { return os.OpenFile(spec, os.O_RDWR, 0) }, nil
	}
}

// dialTimeout bounds connecting to swtpm's data channel.
const dialTimeout = 5 * time.Second

// dialer returns an OpenFunc that connects to a socket, within dialTimeout and ctx.
func dialer(network, addr string) OpenFunc {
	d := net.Dialer{Timeout: dialTimeout}
	return func(ctx context.Context) (io.ReadWriteCloser, error) { return d.DialContext(ctx, network, addr) }
}

// conn is one open TPM connection speaking go-tpm's transport.TPM.
type conn struct {
	rwc io.ReadWriteCloser
}

// openTPM opens a connection and applies the context's deadline where the transport supports one.
func openTPM(ctx context.Context, open OpenFunc) (*conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	rwc, err := open(ctx)
	if err != nil {
		return nil, fmt.Errorf("opening TPM: %w", err)
	}
	if d, ok := ctx.Deadline(); ok {
		if nc, ok := rwc.(net.Conn); ok {
			_ = nc.SetDeadline(d)
		}
	}
	return &conn{rwc: rwc}, nil
}

var _ transport.TPM = (*conn)(nil)

// Send writes one command and reads exactly one response. Stream transports (swtpm sockets) may
// deliver a response in pieces, so the response size is taken from its header.
func (c *conn) Send(cmd []byte) ([]byte, error) {
	if _, err := c.rwc.Write(cmd); err != nil {
		return nil, fmt.Errorf("writing TPM command: %w", err)
	}
	if _, ok := c.rwc.(*os.File); ok {
		// A TPM character device returns a whole response per read.
		buf := make([]byte, maxResponse)
		n, err := c.rwc.Read(buf)
		if err != nil {
			return nil, fmt.Errorf("reading TPM response: %w", err)
		}
		return buf[:n], nil
	}
	hdr := make([]byte, 10)
	if _, err := io.ReadFull(c.rwc, hdr); err != nil {
		return nil, fmt.Errorf("reading TPM response header: %w", err)
	}
	size := binary.BigEndian.Uint32(hdr[2:6])
	if size < 10 || size > maxResponse {
		return nil, fmt.Errorf("reading TPM response: size %d out of range", size)
	}
	rsp := make([]byte, size)
	copy(rsp, hdr)
	if _, err := io.ReadFull(c.rwc, rsp[10:]); err != nil {
		return nil, fmt.Errorf("reading TPM response body: %w", err)
	}
	return rsp, nil
}

func (c *conn) Close() error { return c.rwc.Close() }
