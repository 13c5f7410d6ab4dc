package vtpm_test

import (
	"bytes"
	"context"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

type logEvent struct {
	pcr, typ uint32
	data     []byte
}

// buildEventLog encodes a crypto-agile log with SHA-1 and SHA-256 digests of each event's data.
func buildEventLog(events []logEvent) []byte {
	var b bytes.Buffer
	w := func(v any) { _ = binary.Write(&b, binary.LittleEndian, v) }
	var spec bytes.Buffer
	spec.WriteString("Spec ID Event03\x00")
	_ = binary.Write(&spec, binary.LittleEndian, uint32(0)) // platform class
	spec.Write([]byte{0, 2, 0, 2})                          // minor, major, errata, uintnSize
	_ = binary.Write(&spec, binary.LittleEndian, uint32(2))
	_ = binary.Write(&spec, binary.LittleEndian, []uint16{0x0004, 20, 0x000b, 32})
	spec.WriteByte(0) // vendor info size
	w(uint32(0))
	w(uint32(3))
	b.Write(make([]byte, 20))
	w(uint32(spec.Len()))
	b.Write(spec.Bytes())
	for _, e := range events {
		w(e.pcr)
		w(e.typ)
		w(uint32(2))
		s1 := sha1Sum(e.data)
		w(uint16(0x0004))
		b.Write(s1)
		s256 := sha256.Sum256(e.data)
		w(uint16(0x000b))
		b.Write(s256[:])
		w(uint32(len(e.data)))
		b.Write(e.data)
	}
	return b.Bytes()
}

var sampleEvents = []logEvent{
	{pcr: 0, typ: 0x8, data: []byte("firmware version 1.2")},       // EV_S_CRTM_VERSION
	{pcr: 4, typ: 0x80000003, data: []byte("boot loader image")},   // EV_EFI_BOOT_SERVICES_APPLICATION
	{pcr: 7, typ: 0x800000e0, data: []byte("secure boot enabled")}, // EV_EFI_VARIABLE_DRIVER_CONFIG
	{pcr: 4, typ: 0x80000003, data: []byte("kernel image")},
	{pcr: 4, typ: 0x3, data: []byte("no action events are not extended")},
}

// extendLikeFirmware extends the simulator's SHA-256 bank with the events, as firmware would.
func extendLikeFirmware(t *testing.T, open vtpm.OpenFunc, events []logEvent) {
	t.Helper()
	rwc, err := open(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer rwc.Close()
	tpm := transport.FromReadWriter(rwc)
	for _, e := range events {
		if e.typ == 0x3 {
			continue
		}
		d := sha256.Sum256(e.data)
		if _, err := (tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(e.pcr), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: d[:]}}},
		}).Execute(tpm); err != nil {
			t.Fatal(err)
		}
	}
}

func TestEventLogReplay(t *testing.T) {
	open, ca, _ := newSimulator(t)
	extendLikeFirmware(t, open, sampleEvents)
	log := buildEventLog(sampleEvents)
	tampered := buildEventLog(append(append([]logEvent{}, sampleEvents[:3]...), logEvent{pcr: 4, typ: 0x80000003, data: []byte("another kernel")}))
	ctx := context.Background()
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.PEM()}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	testCases := map[string]struct {
		log     []byte
		wantErr error
	}{
		"log replays":         {log: log},
		"log tampered":        {log: tampered, wantErr: attestation.ErrMeasurementMismatch},
		"log truncated":       {log: log[:len(log)-5], wantErr: attestation.ErrMalformed},
		"log is not a log":    {log: []byte("garbage garbage garbage garbage"), wantErr: attestation.ErrMalformed},
		"machine without log": {log: nil},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			issuer := vtpm.NewIssuer(open, zap.NewNop(), vtpm.WithEventLog(func() ([]byte, error) { return tc.log, nil }))
			raw, err := issuer.Issue(ctx, nil, []byte("n"))
			if err != nil {
				t.Fatal(err)
			}
			_, err = v.Validate(ctx, raw, []byte("n"))
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("got %v, want %v", err, tc.wantErr)
			}
		})
	}
}

func TestParseEventLog(t *testing.T) {
	events, locality, err := vtpm.ParseEventLog(buildEventLog(sampleEvents))
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 4 || locality != 0 {
		t.Fatalf("got %d events, locality %d; want 4, 0", len(events), locality)
	}
	pcrs := vtpm.ReplayEventLog(events, locality)
	want := make([]byte, 32)
	for _, e := range sampleEvents[1:4] {
		if e.pcr == 4 {
			d := sha256.Sum256(e.data)
			h := sha256.Sum256(append(want, d[:]...))
			want = h[:]
		}
	}
	if !bytes.Equal(pcrs[4], want) {
		t.Fatalf("PCR 4 replays to %x, want %x", pcrs[4], want)
	}
}

func FuzzParseEventLog(f *testing.F) {
	f.Add(buildEventLog(sampleEvents))
	f.Add(buildEventLog(nil))
	f.Fuzz(func(t *testing.T, log []byte) {
		events, locality, err := vtpm.ParseEventLog(log)
		if err != nil {
			if !errors.Is(err, attestation.ErrMalformed) {
				t.Fatalf("error %v is not ErrMalformed", err)
			}
			return
		}
		_ = vtpm.ReplayEventLog(events, locality)
	})
}

func sha1Sum(b []byte) []byte {
	s := sha1.Sum(b)
	return s[:]
}
