package tdx

import (
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"fmt"
)

// Intel's SGX extension in PCK certificates (OID 1.2.840.113741.1.13.1) and the entries Berth reads from it.
var (
	oidSGXExtension = asn1.ObjectIdentifier{1, 2, 840, 113741, 1, 13, 1}
	oidSGXTCB       = asn1.ObjectIdentifier{1, 2, 840, 113741, 1, 13, 1, 2}
	oidSGXPCEID     = asn1.ObjectIdentifier{1, 2, 840, 113741, 1, 13, 1, 3}
	oidSGXFMSPC     = asn1.ObjectIdentifier{1, 2, 840, 113741, 1, 13, 1, 4}
)

// Common names of the CAs that issue PCK certificates; they select which PCK CRL applies.
const (
	pckPlatformCACN  = "Intel SGX PCK Platform CA"
	pckProcessorCACN = "Intel SGX PCK Processor CA"
)

// PCK CA names as used to request a PCK CRL.
const (
	PCKCAPlatform  = "platform"
	PCKCAProcessor = "processor"
)

// pckExtensions are the platform facts a PCK certificate attests.
type pckExtensions struct {
	// CPUSVNComponents are the 16 SGX TCB component SVNs.
	CPUSVNComponents [16]byte
	PCESVN           uint16
	PCEID            [2]byte
	FMSPC            [6]byte
}

type asn1Entry struct {
	ID    asn1.ObjectIdentifier
	Value asn1.RawValue
}

// parsePCKExtensions reads the SGX extension of a PCK certificate.
func parsePCKExtensions(cert *x509.Certificate) (*pckExtensions, error) {
	var raw []byte
	for _, ext := range cert.Extensions {
		if ext.Id.Equal(oidSGXExtension) {
			raw = ext.Value
			break
		}
	}
	if raw == nil {
		return nil, errors.New("PCK certificate has no SGX extension")
	}
	var entries []asn1Entry
	if rest, err := asn1.Unmarshal(raw, &entries); err != nil {
		return nil, fmt.Errorf("decoding SGX extension: %w", err)
	} else if len(rest) != 0 {
		return nil, errors.New("decoding SGX extension: trailing data")
	}
	out := &pckExtensions{}
	var haveTCB, havePCEID, haveFMSPC bool
	for _, e := range entries {
		switch {
		case e.ID.Equal(oidSGXTCB):
			if err := parseTCBEntry(e.Value.FullBytes, out); err != nil {
				return nil, err
			}
			haveTCB = true
		case e.ID.Equal(oidSGXPCEID):
			if err := octets(e.Value, out.PCEID[:], "PCE-ID"); err != nil {
				return nil, err
			}
			havePCEID = true
		case e.ID.Equal(oidSGXFMSPC):
			if err := octets(e.Value, out.FMSPC[:], "FMSPC"); err != nil {
				return nil, err
			}
			haveFMSPC = true
		}
	}
	if !haveTCB || !havePCEID || !haveFMSPC {
		return nil, errors.New("SGX extension lacks TCB, PCE-ID or FMSPC")
	}
	return out, nil
}

func octets(v asn1.RawValue, dst []byte, field string) error {
	var b []byte
	if _, err := asn1.Unmarshal(v.FullBytes, &b); err != nil {
		return fmt.Errorf("decoding %s: %w", field, err)
	}
	if len(b) != len(dst) {
		return fmt.Errorf("decoding %s: %d bytes, want %d", field, len(b), len(dst))
	}
	copy(dst, b)
	return nil
}

// parseTCBEntry decodes the TCB sequence: component SVNs 1..16 (sub-OIDs .1..16), PCESVN (.17), CPUSVN (.18).
func parseTCBEntry(der []byte, out *pckExtensions) error {
	var entries []asn1Entry
	if _, err := asn1.Unmarshal(der, &entries); err != nil {
		return fmt.Errorf("decoding SGX TCB: %w", err)
	}
	seen := 0
	for _, e := range entries {
		if len(e.ID) != len(oidSGXTCB)+1 || !e.ID[:len(oidSGXTCB)].Equal(oidSGXTCB) {
			continue
		}
		n := e.ID[len(oidSGXTCB)]
		if n < 1 || n > 17 {
			continue // 18 is the raw CPUSVN, which repeats components 1..16
		}
		var v int
		if _, err := asn1.Unmarshal(e.Value.FullBytes, &v); err != nil {
			return fmt.Errorf("decoding SGX TCB component %d: %w", n, err)
		}
		if n == 17 {
			if v < 0 || v > 0xffff {
				return fmt.Errorf("decoding PCESVN: %d out of range", v)
			}
			out.PCESVN = uint16(v)
		} else {
			if v < 0 || v > 0xff {
				return fmt.Errorf("decoding SGX TCB component %d: %d out of range", n, v)
			}
			out.CPUSVNComponents[n-1] = byte(v)
		}
		seen++
	}
	if seen != 17 {
		return fmt.Errorf("decoding SGX TCB: %d of 17 entries present", seen)
	}
	return nil
}
