package vtpm_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/berth-k8s/berth/internal/attestation/vtpm"
)

// TestReadPCRsAsGoTPM: the hand-coded TPM2_PCR_Read reads what go-tpm's reads, on the reference
// simulator, for all 24 PCRs (three commands of at most 8) after some were extended.
func TestReadPCRsAsGoTPM(t *testing.T) {
	open, _, _ := newSimulator(t)
	ctx := t.Context()
	rwc, err := open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tpm := transport.FromReadWriter(rwc)
	for _, pcr := range []uint32{4, 9, 15, 23} {
		ext := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(pcr), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: bytes.Repeat([]byte{byte(pcr)}, sha256.Size)}}},
		}
		if _, err := ext.Execute(tpm); err != nil {
			t.Fatal(err)
		}
	}
	want := map[uint32][]byte{}
	for first := uint(0); first < 24; first += 8 {
		batch := []uint{first, first + 1, first + 2, first + 3, first + 4, first + 5, first + 6, first + 7}
		rsp, err := tpm2.PCRRead{PCRSelectionIn: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
			Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(batch...),
		}}}}.Execute(tpm)
		if err != nil {
			t.Fatal(err)
		}
		for k, d := range rsp.PCRValues.Digests {
			want[uint32(batch[k])] = d.Buffer
		}
	}
	_ = rwc.Close()
	all := make([]uint, 24)
	for i := range all {
		all[i] = uint(i)
	}
	got, err := vtpm.ReadPCRs(ctx, open, all)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 24 || len(want) != 24 {
		t.Fatalf("read %d PCRs, go-tpm %d; want 24", len(got), len(want))
	}
	for i, w := range want {
		if !bytes.Equal(got[i], w) {
			t.Errorf("PCR %d: read %x, go-tpm reads %x", i, got[i], w)
		}
	}
	if bytes.Equal(got[4], make([]byte, sha256.Size)) {
		t.Error("PCR 4 reads as never extended")
	}
}

// TestDecodePCRReadRefusesBadResponses: a response that is cut short, longer than it says, carries
// values the selection does not account for or a TPM error is refused, never read as values.
func TestDecodePCRReadRefusesBadResponses(t *testing.T) {
	value := bytes.Repeat([]byte{0xab}, sha256.Size)
	build := func(rc uint32, sel []byte, values ...[]byte) []byte {
		var body []byte
		body = binary.BigEndian.AppendUint32(body, 7) // pcrUpdateCounter
		body = binary.BigEndian.AppendUint32(body, 1)
		body = binary.BigEndian.AppendUint16(body, uint16(tpm2.TPMAlgSHA256))
		body = append(body, byte(len(sel)))
		body = append(body, sel...)
		body = binary.BigEndian.AppendUint32(body, uint32(len(values)))
		for _, v := range values {
			body = binary.BigEndian.AppendUint16(body, uint16(len(v)))
			body = append(body, v...)
		}
		if rc != 0 {
			body = nil
		}
		out := binary.BigEndian.AppendUint16(nil, uint16(tpm2.TPMSTNoSessions))
		out = binary.BigEndian.AppendUint32(out, uint32(10+len(body)))
		out = binary.BigEndian.AppendUint32(out, rc)
		return append(out, body...)
	}
	good := build(0, []byte{0x10, 0, 0}, value) // PCR 4
	idx, vals, err := vtpm.DecodePCRRead(good)
	if err != nil || len(idx) != 1 || idx[0] != 4 || len(vals) != 1 || !bytes.Equal(vals[0], value) {
		t.Fatalf("a good response: %v %x %v", idx, vals, err)
	}
	longer := append(append([]byte(nil), good...), 0)
	binary.BigEndian.PutUint32(longer[2:], uint32(len(longer)))
	for name, rsp := range map[string][]byte{
		"cut short":            good[:len(good)-1],
		"size field disagrees": append(append([]byte(nil), good...), 0),
		"trailing bytes":       longer,
		"a TPM error":          build(uint32(tpm2.TPMRCValue), nil),
		"empty":                nil,
		"header only":          good[:10],
		"a value too many":     build(0, []byte{0x10, 0, 0}, value, value),
		"a value too few":      build(0, []byte{0x30, 0, 0}, value),
	} {
		if idx, vals, err := vtpm.DecodePCRRead(rsp); err == nil {
			t.Errorf("%s: decoded %v %x, want an error", name, idx, vals)
		}
	}
	if _, _, err := vtpm.DecodePCRRead(build(uint32(tpm2.TPMRCValue), nil)); !errors.Is(err, tpm2.TPMRCValue) {
		t.Errorf("a TPM error: %v, want the TPM's response code", err)
	}
}
