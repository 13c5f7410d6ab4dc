package vtpm

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/berth-k8s/berth/internal/attestation"
)

// SystemEventLogPath is where Linux exposes the firmware's TCG event log.
const SystemEventLogPath = "/sys/kernel/security/tpm0/binary_bios_measurements"

// MaxEventLogSize bounds an event log in a document.
const MaxEventLogSize = 1 << 20

// ReadSystemEventLog reads the firmware event log; a machine without one (swtpm, the simulator, many
// VMs) yields nil and no error. Pass it to WithEventLog.
func ReadSystemEventLog() ([]byte, error) {
	b, err := os.ReadFile(SystemEventLogPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading event log: %w", err)
	}
	return b, nil
}

// TCG event types the replay needs to know.
const (
	evNoAction  = 0x00000003
	algSHA256   = 0x000b
	specIDMagic = "Spec ID Event03\x00"
	localityTag = "StartupLocality\x00"
)

// Event is one measurement from a TCG crypto-agile event log.
type Event struct {
	PCR    uint32
	Type   uint32
	SHA256 []byte
	Data   []byte
}

// ParseEventLog parses a TCG PC Client crypto-agile event log (a SHA-1 format Spec ID event followed by
// TCG_PCR_EVENT2 records) and returns its events with their SHA-256 digests and the initial PCR 0
// locality. It never trusts the log: every length is checked against the remaining input.
func ParseEventLog(log []byte) (events []Event, locality byte, err error) {
	if len(log) > MaxEventLogSize {
		return nil, 0, fmt.Errorf("%w: event log of %d bytes", attestation.ErrMalformed, len(log))
	}
	r := &reader{b: log}
	// The header event: pcrIndex, eventType, SHA-1 digest, eventSize, Spec ID Event03.
	r.u32()
	if t := r.u32(); t != evNoAction {
		return nil, 0, fmt.Errorf("%w: event log does not start with a Spec ID event", attestation.ErrMalformed)
	}
	r.bytes(20)
	spec := &reader{b: r.bytes(int(r.u32()))}
	if r.err != nil || !bytes.Equal(spec.bytes(16), []byte(specIDMagic)) {
		return nil, 0, fmt.Errorf("%w: event log has no crypto-agile Spec ID event", attestation.ErrMalformed)
	}
	spec.bytes(4 + 4) // platformClass, versions, errata, uintnSize
	n := spec.u32()
	if n == 0 || n > 16 {
		return nil, 0, fmt.Errorf("%w: event log declares %d digest algorithms", attestation.ErrMalformed, n)
	}
	sizes := map[uint16]int{}
	for i := uint32(0); i < n; i++ {
		alg, size := spec.u16(), spec.u16()
		if size == 0 || size > 64 {
			return nil, 0, fmt.Errorf("%w: digest size %d", attestation.ErrMalformed, size)
		}
		sizes[alg] = int(size)
	}
	if spec.err != nil {
		return nil, 0, fmt.Errorf("%w: truncated Spec ID event", attestation.ErrMalformed)
	}
	if sizes[algSHA256] != sha256.Size {
		return nil, 0, fmt.Errorf("%w: event log has no SHA-256 digests", attestation.ErrMalformed)
	}
	for r.err == nil && len(r.b) > 0 {
		e := Event{PCR: r.u32(), Type: r.u32()}
		count := r.u32()
		if count > 16 {
			return nil, 0, fmt.Errorf("%w: event with %d digests", attestation.ErrMalformed, count)
		}
		for i := uint32(0); i < count && r.err == nil; i++ {
			alg := r.u16()
			size, ok := sizes[alg]
			if !ok {
				return nil, 0, fmt.Errorf("%w: digest algorithm %#x not declared", attestation.ErrMalformed, alg)
			}
			d := r.bytes(size)
			if alg == algSHA256 {
				e.SHA256 = d
			}
		}
		size := r.u32()
		if size > MaxEventLogSize {
			return nil, 0, fmt.Errorf("%w: event data of %d bytes", attestation.ErrMalformed, size)
		}
		e.Data = r.bytes(int(size))
		if r.err != nil {
			break
		}
		if e.PCR > 23 {
			return nil, 0, fmt.Errorf("%w: event for PCR %d", attestation.ErrMalformed, e.PCR)
		}
		if e.Type == evNoAction {
			if e.PCR == 0 && len(e.Data) == len(localityTag)+1 && bytes.HasPrefix(e.Data, []byte(localityTag)) {
				locality = e.Data[len(localityTag)]
			}
			continue
		}
		if e.SHA256 == nil {
			return nil, 0, fmt.Errorf("%w: event without SHA-256 digest", attestation.ErrMalformed)
		}
		events = append(events, e)
	}
	if r.err != nil {
		return nil, 0, fmt.Errorf("%w: truncated event log", attestation.ErrMalformed)
	}
	return events, locality, nil
}

// ReplayEventLog computes the SHA-256 PCR values the log's events produce, for the PCRs it touches.
func ReplayEventLog(events []Event, locality byte) map[uint32][]byte {
	out := map[uint32][]byte{}
	for _, e := range events {
		cur, ok := out[e.PCR]
		if !ok {
			cur = make([]byte, sha256.Size)
			if e.PCR == 0 {
				cur[sha256.Size-1] = locality
			}
		}
		h := sha256.New()
		h.Write(cur)
		h.Write(e.SHA256)
		out[e.PCR] = h.Sum(nil)
	}
	return out
}

// lastFirmwarePCR is the highest PCR the firmware log is complete for: 0-7 (firmware, boot manager)
// and 8-9 (boot loader) are not extended after the OS starts; 10 and up are (IMA, systemd-pcrphase,
// Berth's lock register) and their events live in other logs.
const lastFirmwarePCR = 9

// verifyEventLog replays log and requires every firmware PCR it touches to equal the quoted value.
func verifyEventLog(log []byte, quoted map[uint32][]byte) error {
	events, locality, err := ParseEventLog(log)
	if err != nil {
		return err
	}
	for pcr, want := range ReplayEventLog(events, locality) {
		got, ok := quoted[pcr]
		if !ok || pcr > lastFirmwarePCR {
			continue // not quoted, or extended after boot by events not in this log
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("%w: event log replays PCR %d to %x, quoted %x", attestation.ErrMeasurementMismatch, pcr, want, got)
		}
	}
	return nil
}

// reader reads little-endian fields and remembers the first short read.
type reader struct {
	b   []byte
	err error
}

func (r *reader) bytes(n int) []byte {
	if r.err != nil || n < 0 || n > len(r.b) {
		r.err = errors.New("short read")
		return nil
	}
	out := r.b[:n:n]
	r.b = r.b[n:]
	return out
}

func (r *reader) u32() uint32 {
	b := r.bytes(4)
	if b == nil {
		return 0
	}
	return binary.LittleEndian.Uint32(b)
}

func (r *reader) u16() uint16 {
	b := r.bytes(2)
	if b == nil {
		return 0
	}
	return binary.LittleEndian.Uint16(b)
}
