package vtpm

import (
	"encoding/binary"
	"fmt"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// TPM2_PCR_Read, encoded and decoded by hand: a node reads its PCRs for every claim it volunteers and
// every quote, and go-tpm's reflective encoding was a fifth of what a refused node spends.

// pcrReadBatch reads the SHA-256 values of at most 8 PCRs in one TPM2_PCR_Read (TPM 2.0 Part 3,
// 22.4): the indices the TPM answered for, ascending, with their values.
func pcrReadBatch(c transport.TPM, batch []uint) ([]uint, [][]byte, error) {
	sel := tpm2.PCClientCompatible.PCRs(batch...)
	cmd := make([]byte, 0, 10+4+3+len(sel))
	cmd = binary.BigEndian.AppendUint16(cmd, uint16(tpm2.TPMSTNoSessions))
	cmd = binary.BigEndian.AppendUint32(cmd, uint32(10+4+2+1+len(sel)))
	cmd = binary.BigEndian.AppendUint32(cmd, uint32(tpm2.TPMCCPCRRead))
	cmd = binary.BigEndian.AppendUint32(cmd, 1) // TPML_PCR_SELECTION: one bank
	cmd = binary.BigEndian.AppendUint16(cmd, uint16(tpm2.TPMAlgSHA256))
	cmd = append(cmd, byte(len(sel)))
	cmd = append(cmd, sel...)
	rsp, err := c.Send(cmd)
	if err != nil {
		return nil, nil, err
	}
	return decodePCRRead(rsp)
}

// decodePCRRead decodes a TPM2_PCR_Read response: the SHA-256 indices selected, ascending, and their
// values, which must be as many (one bank, SHA-256, is all readPCRs asks for). A response code other than success is returned as go-tpm's TPMRC.
func decodePCRRead(rsp []byte) ([]uint, [][]byte, error) {
	r := tpmReader{b: rsp}
	r.u16() // tag
	size := r.u32()
	rc := tpm2.TPMRC(r.u32())
	if r.err != nil || int(size) != len(rsp) {
		return nil, nil, fmt.Errorf("TPM2_PCR_Read response: %w", errShortStructure)
	}
	if rc != tpm2.TPMRCSuccess {
		return nil, nil, fmt.Errorf("TPM2_PCR_Read: %w", rc)
	}
	r.u32() // pcrUpdateCounter
	n := r.u32()
	if n > maxPCRBanks {
		return nil, nil, fmt.Errorf("TPM2_PCR_Read response: %d PCR banks", n)
	}
	var banks []pcrBank
	for range n {
		h := tpm2.TPMIAlgHash(r.u16())
		banks = append(banks, pcrBank{hash: h, bitmap: r.take(int(r.u8()))})
	}
	count := r.u32()
	if count > 8 {
		return nil, nil, fmt.Errorf("TPM2_PCR_Read response: %d values", count)
	}
	values := make([][]byte, 0, count)
	for range count {
		values = append(values, r.sized())
	}
	if err := r.done(); err != nil {
		return nil, nil, fmt.Errorf("TPM2_PCR_Read response: %w", err)
	}
	idx, _ := attestInfo{pcrBanks: banks}.sha256PCRs()
	if len(idx) != len(values) {
		return nil, nil, fmt.Errorf("TPM2_PCR_Read response: %d values for %d selected PCRs", len(values), len(idx))
	}
	return idx, values, nil
}
