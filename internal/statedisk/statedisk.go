// Package statedisk is the encrypted state disk of a Berth node: the one place where the node keeps
// what must survive a reboot (the kubeadm and kubelet state, etcd's data, the bootstrapper's state
// directory). Everything above it talks to a Disk; two backends implement it.
//
//   - Fscrypt (NewFscrypt): an ext4 image file, loop-mounted, whose plaintext tree is an fscrypt v2
//     directory ("data", AES-256-XTS for contents, AES-256-CTS for file names). It needs neither
//     device-mapper nor cryptsetup, only loop devices and ext4 encryption, so the mini cluster and
//     CI use it.
//   - LUKS (NewLUKS): a block device formatted with cryptsetup as LUKS2 with dm-integrity
//     (hmac-sha256), so every sector is encrypted and authenticated; ext4 on the mapper device.
//     The OS image uses it.
//
// # Keys
//
// A disk key (the "slot key", 32 bytes) never encrypts data itself. It unlocks a keyslot that holds
// the volume key, like LUKS: Format creates a random volume key and wraps it under the first slot
// key, Open unwraps it, Rekey re-wraps the same volume key under a new slot key. Rekey therefore
// rewrites only the keyslot, not the data, and the old slot key stops opening the disk. In the
// fscrypt backend the keyslot sits in the plaintext header file at the file system's root: the
// 64-byte fscrypt master key wrapped with AES-256-GCM under the slot key, with the disk UUID and
// the header version as additional data (so a keyslot copied to another disk does not open there);
// a GCM failure is ErrWrongKey, never a guess. In the LUKS backend the keyslot is cryptsetup's own
// (PBKDF2 with 1000 iterations: the slot key is random, stretching would add nothing but time).
// Keys reach cryptsetup only through pipes (standard input, /dev/fd/3), never through argv or a
// file.
//
// # Header
//
// Header is the plaintext metadata a node needs before it can open its disk: the UUID, the cluster
// ID and the cluster's disk binding once the disk is bound, and the TPM-sealed key blob. The
// fscrypt backend keeps it in a JSON file at the root of the image's file system, the LUKS backend
// in a LUKS2 token of type "berth-state". Nothing in it is a key, and it is not secret. Someone who
// can write the disk can change it, which lets them make the disk fail to open but not read it (the
// binding is a MAC the joinservice checks, the sealed blob is only usable inside this node's TPM
// under its policy). The header's MAC (HeaderMAC: HMAC-SHA256 under a key derived from the disk key
// over the UUID, the cluster ID and the binding) lets whoever opened the disk with its key check
// that these fields are the ones written with that key; the boot stage refuses a header whose MAC
// does not verify before it trusts the cluster ID. A consumer must not trust the cluster ID further
// than the key that opened the disk vouches for it.
//
// # What is protected, and what is not
//
// Protected: the contents of every file under Root() and, with fscrypt, their names, against
// anyone who holds the image or device without a slot key (a stolen disk, a host reading the
// backing file). With LUKS2 and integrity, tampering with a sector is detected on read.
// Not protected: with fscrypt, the file system's metadata (sizes, timestamps, the directory tree's
// shape, extended attributes' existence) and the header file; ciphertext is not authenticated,
// so an attacker with write access can corrupt (not read) files. In both backends anyone who is
// root on the running node while the disk is open reads the plaintext: encryption at rest only.
package statedisk

import (
	"bufio"
	"context"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// KeySize is the length of a slot key in bytes.
const KeySize = 32

// headerMACLabel is the HKDF info of the header MAC's key, derived from the disk key.
const headerMACLabel = "berth/v1/state-disk-header-mac"

// HeaderMAC is the MAC of h's UUID (lower-case), cluster ID and binding under a key derived from
// the disk key (HKDF-SHA256, info headerMACLabel): HMAC-SHA256 over the three, each preceded by its
// length as 4 bytes big-endian, so no two headers share an input. The sealed blob is not covered:
// it changes with every reseal, and only this TPM can use it.
func HeaderMAC(diskKey []byte, h Header) ([]byte, error) {
	if err := checkKey(diskKey); err != nil {
		return nil, err
	}
	macKey, err := hkdf.Key(sha256.New, diskKey, nil, headerMACLabel, sha256.Size)
	if err != nil {
		return nil, fmt.Errorf("deriving the header MAC key: %w", err)
	}
	m := hmac.New(sha256.New, macKey)
	for _, field := range [][]byte{[]byte(strings.ToLower(h.UUID)), h.ClusterID, h.Binding} {
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(field)))
		m.Write(n[:])
		m.Write(field)
	}
	return m.Sum(nil), nil
}

// VerifyHeaderMAC reports whether h.MAC is HeaderMAC(diskKey, h); a header without a MAC never
// verifies.
func VerifyHeaderMAC(diskKey []byte, h Header) bool {
	want, err := HeaderMAC(diskKey, h)
	return err == nil && len(h.MAC) > 0 && hmac.Equal(want, h.MAC)
}

// Header is the plaintext metadata of a state disk: nothing in it is a key.
type Header struct {
	UUID      string // the disk UUID (lower-case, canonical 8-4-4-4-12)
	ClusterID []byte // nil until the disk is bound to a cluster
	Binding   []byte // the cluster's disk binding MAC; nil until bound
	Sealed    []byte // opaque blob from the TPM sealer; nil when none
	// MAC authenticates UUID, ClusterID and Binding under the disk's key (HeaderMAC); nil on a disk
	// bound before headers were authenticated, or not bound yet.
	MAC []byte
}

var (
	// ErrWrongKey means the key does not open the disk (authenticated, never a guess).
	ErrWrongKey = errors.New("the key does not open the state disk")
	// ErrNotFormatted means there is no state disk header on the device or image.
	ErrNotFormatted = errors.New("no state disk header")
)

// Disk is an encrypted state disk. Both backends implement it.
type Disk interface {
	// Header returns the plaintext header; ErrNotFormatted if there is none.
	Header(ctx context.Context) (Header, error)
	// Format destroys everything on the disk, gives it a new UUID, and leaves it open and mounted
	// with key as its only slot key.
	Format(ctx context.Context, key []byte) (Header, error)
	// Open unlocks and mounts the disk; ErrWrongKey on a wrong key, and then nothing changed.
	Open(ctx context.Context, key []byte) error
	// Rekey re-wraps the keyslot from oldKey to newKey; the data is untouched. ErrWrongKey if
	// oldKey does not open the disk.
	Rekey(ctx context.Context, oldKey, newKey []byte) error
	// SetBinding records the cluster ID and the disk binding in the header, atomically.
	SetBinding(ctx context.Context, clusterID, binding []byte) error
	// SetSealed records the TPM-sealed key blob in the header, atomically.
	SetSealed(ctx context.Context, blob []byte) error
	// SetMAC records the header's MAC (HeaderMAC), atomically.
	SetMAC(ctx context.Context, mac []byte) error
	// Opened reports whether the disk is already unlocked and mounted (a daemon restart within
	// the same boot).
	Opened(ctx context.Context) (bool, error)
	// Root is where the plaintext tree is while the disk is open.
	Root() string
	// Close unmounts the disk and makes the kernel forget its key.
	Close(ctx context.Context) error
}

var (
	_ Disk = (*Fscrypt)(nil)
	_ Disk = (*LUKS)(nil)
)

// Cmd is one program a backend runs.
type Cmd struct {
	Name string
	Args []string
	// Stdin, if non-nil, is the program's standard input, fed through a pipe.
	Stdin []byte
	// Files[i] is readable by the program as /dev/fd/(3+i), each fed through its own pipe: the
	// way to hand a second secret to a program without writing it to any file system.
	Files [][]byte
	// Stdout, if non-nil, receives the program's standard output (else it goes with stderr into
	// the error message).
	Stdout io.Writer
}

func (c Cmd) String() string { return strings.Join(append([]string{c.Name}, c.Args...), " ") }

// Runner runs the external programs of a backend (mkfs.ext4, mount, umount, cryptsetup). Exec is
// the real one. A Runner must never log Stdin or Files: they carry keys.
type Runner interface {
	Run(ctx context.Context, cmd Cmd) error
}

const headerVersion = "berth-statedisk/v1"

func checkKey(key []byte) error {
	if len(key) != KeySize {
		return fmt.Errorf("checking key: a state disk key has %d bytes, got %d", KeySize, len(key))
	}
	return nil
}

// newUUID returns a random (version 4) UUID in canonical lower-case form.
func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generating UUID: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// mountEntry is the top-most mount at a path, from /proc/self/mountinfo.
type mountEntry struct {
	Major, Minor uint32
	Source       string
}

// mountAt returns the top-most mount whose mount point is dir (ok false if dir is not a mount
// point).
func mountAt(mountinfo, dir string) (entry mountEntry, ok bool, err error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return mountEntry{}, false, fmt.Errorf("resolving %s: %w", dir, err)
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		abs = real
	}
	f, err := os.Open(mountinfo)
	if err != nil {
		return mountEntry{}, false, fmt.Errorf("reading mount table: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 || UnescapeMountinfo(fields[4]) != abs {
			continue
		}
		sep := -1
		for i := 6; i < len(fields); i++ {
			if fields[i] == "-" {
				sep = i
				break
			}
		}
		majMin := strings.SplitN(fields[2], ":", 2)
		if sep < 0 || sep+2 >= len(fields) || len(majMin) != 2 {
			continue
		}
		major, err1 := strconv.ParseUint(majMin[0], 10, 32)
		minor, err2 := strconv.ParseUint(majMin[1], 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		entry = mountEntry{Major: uint32(major), Minor: uint32(minor), Source: UnescapeMountinfo(fields[sep+2])}
		ok = true // later lines are mounted on top of earlier ones: keep the last
	}
	if err := sc.Err(); err != nil {
		return mountEntry{}, false, fmt.Errorf("reading mount table: %w", err)
	}
	return entry, ok, nil
}

// UnescapeMountinfo undoes the octal escapes (\040 for a space, ...) of /proc/self/mountinfo.
func UnescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
