// Package uki predicts the TPM PCR values a unified kernel image (UKI: systemd-stub with the kernel,
// initrd, command line and os-release as PE sections) produces when UEFI firmware boots it directly,
// so that a policy can expect them before the image ever boots.
//
// What is predicted, and from what:
//
//	PCR 4   the firmware's boot-manager events (TCG PC Client spec): EV_EFI_ACTION "Calling EFI
//	        Application from Boot Option", the EV_SEPARATOR, then EV_EFI_BOOT_SERVICES_APPLICATION
//	        with the Authenticode SHA-256 of each PE image started: the UKI, then the kernel that
//	        systemd-stub starts from its .linux section (LoadImage from memory)
//	PCR 11  systemd-stub's measurement of its own sections, in its fixed order (.linux, .osrel,
//	        .cmdline, .initrd, .splash, .dtb, .pcrpkey; .pcrsig is never measured): for each present
//	        section first its name with the terminating NUL, then its content (VirtualSize bytes)
//	PCR 9   the Linux EFI stub's tagged events (kernel 6.1 and later): first the kernel's load
//	        options, which systemd-stub sets to the .cmdline section as UTF-16LE with its
//	        terminating NUL, then the initrd the stub hands over (the .initrd section as it is, when
//	        no credential or system extension is added to it)
//	PCR 12  nothing: systemd-stub (252) measures into it only a command line taken from the boot
//	        option's load options instead of .cmdline, and credentials it picked up from the EFI
//	        system partition. A UKI booted with neither leaves it at zero; any override changes it.
//
// PCR 4 holds only for a UKI the firmware starts as the first boot option, with no boot loader or
// shim before it; PCR 11 holds as long as nothing measures into it after the stub (systemd-pcrphase
// does: the Berth image masks it). Firmware PCRs 0-3 and 5-7 depend on the firmware build and the
// machine and are not predicted here.
package uki

import (
	"bytes"
	"crypto/sha256"
	"debug/pe"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
)

// ErrNotUKI is returned for a file that is not a PE image with a .linux section.
var ErrNotUKI = errors.New("not a unified kernel image")

// Stub sections in the order systemd-stub measures them into PCR 11 (systemd 252 and later).
var measuredSections = []string{".linux", ".osrel", ".cmdline", ".initrd", ".splash", ".dtb", ".pcrpkey"}

// Firmware event data of the boot-manager events in PCR 4.
var (
	callingEFIApplication = []byte("Calling EFI Application from Boot Option")
	separator             = []byte{0, 0, 0, 0}
)

// Event is one predicted measurement.
type Event struct {
	PCR         int
	Description string
	Digest      [sha256.Size]byte
}

// Prediction is the expected SHA-256 bank values of the predicted PCRs and the events behind them.
type Prediction struct {
	PCRs   map[int][sha256.Size]byte
	Events []Event
}

// Predicted lists the PCRs Predict computes.
var Predicted = []int{4, 9, 11, 12}

// Predict reads a UKI and predicts its PCRs 4, 9, 11 and 12 (SHA-256 bank) for a boot with no
// command line override, credentials or add-ons.
func Predict(image []byte) (*Prediction, error) {
	sections, err := Sections(image)
	if err != nil {
		return nil, err
	}
	ukiHash, err := Authenticode(image)
	if err != nil {
		return nil, fmt.Errorf("hashing the UKI: %w", err)
	}
	kernelHash, err := Authenticode(sections[".linux"])
	if err != nil {
		return nil, fmt.Errorf("hashing the kernel in .linux: %w", err)
	}
	var events []Event
	add := func(pcr int, desc string, digest [sha256.Size]byte) {
		events = append(events, Event{PCR: pcr, Description: desc, Digest: digest})
	}
	add(4, "EV_EFI_ACTION Calling EFI Application from Boot Option", sha256.Sum256(callingEFIApplication))
	add(4, "EV_SEPARATOR", sha256.Sum256(separator))
	add(4, "EV_EFI_BOOT_SERVICES_APPLICATION the UKI", ukiHash)
	add(4, "EV_EFI_BOOT_SERVICES_APPLICATION the kernel (.linux)", kernelHash)
	for _, name := range measuredSections {
		data, ok := sections[name]
		if !ok {
			continue
		}
		add(11, "section name "+name, sha256.Sum256(append([]byte(name), 0)))
		add(11, "section "+name, sha256.Sum256(data))
	}
	if cmdline, ok := sections[".cmdline"]; ok {
		add(9, "EV_EVENT_TAG LOADED_IMAGE::LoadOptions (.cmdline as UTF-16LE)", sha256.Sum256(LoadOptions(cmdline)))
	}
	if initrd, ok := sections[".initrd"]; ok {
		add(9, "EV_EVENT_TAG Linux initrd (.initrd)", sha256.Sum256(initrd))
	}
	// PCR 12 has no event: its expected value is the reset value.
	p := &Prediction{PCRs: map[int][sha256.Size]byte{12: {}}, Events: events}
	for _, e := range events {
		p.PCRs[e.PCR] = extend(p.PCRs[e.PCR], e.Digest)
	}
	return p, nil
}

// LoadOptions returns the kernel load options systemd-stub sets for a .cmdline section: the text
// (up to a NUL, if any) as UTF-16LE with a terminating NUL character. Each byte becomes one
// character, as the stub converts it (the command line is ASCII).
func LoadOptions(cmdline []byte) []byte {
	if i := bytes.IndexByte(cmdline, 0); i >= 0 {
		cmdline = cmdline[:i]
	}
	out := make([]byte, 0, 2*len(cmdline)+2)
	for _, c := range cmdline {
		out = append(out, c, 0)
	}
	return append(out, 0, 0)
}

func extend(pcr, digest [sha256.Size]byte) [sha256.Size]byte {
	return sha256.Sum256(append(pcr[:], digest[:]...))
}

// Sections returns the content of a UKI's sections by name, each cut to its VirtualSize (what
// systemd-stub measures and uses). It fails with ErrNotUKI without a .linux section.
func Sections(image []byte) (map[string][]byte, error) {
	f, err := pe.NewFile(bytes.NewReader(image))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotUKI, err)
	}
	defer func() { _ = f.Close() }()
	out := map[string][]byte{}
	for _, s := range f.Sections {
		data, err := s.Data()
		if err != nil {
			return nil, fmt.Errorf("reading section %s: %w", s.Name, err)
		}
		if s.VirtualSize != 0 && uint32(len(data)) > s.VirtualSize {
			data = data[:s.VirtualSize]
		}
		out[s.Name] = data
	}
	if _, ok := out[".linux"]; !ok {
		return nil, fmt.Errorf("%w: no .linux section", ErrNotUKI)
	}
	return out, nil
}

// Authenticode returns the SHA-256 Authenticode digest of a PE image, as UEFI firmware measures it:
// the headers without the checksum and the certificate table entry, the sections in file order, and
// the data after them up to the certificate table.
func Authenticode(image []byte) ([sha256.Size]byte, error) {
	var zero [sha256.Size]byte
	f, err := pe.NewFile(bytes.NewReader(image))
	if err != nil {
		return zero, fmt.Errorf("parsing PE: %w", err)
	}
	defer func() { _ = f.Close() }()
	if len(image) < 0x40 {
		return zero, errors.New("parsing PE: too short")
	}
	peOff := int(binary.LittleEndian.Uint32(image[0x3c:]))
	opt := peOff + 4 + 20 // optional header
	var certDirOff, sizeOfHeaders int
	var certOff, certSize uint32
	switch h := f.OptionalHeader.(type) {
	case *pe.OptionalHeader64:
		certDirOff = opt + 112 + 4*8
		sizeOfHeaders = int(h.SizeOfHeaders)
		if h.NumberOfRvaAndSizes > 4 {
			certOff, certSize = h.DataDirectory[4].VirtualAddress, h.DataDirectory[4].Size
		}
	case *pe.OptionalHeader32:
		certDirOff = opt + 96 + 4*8
		sizeOfHeaders = int(h.SizeOfHeaders)
		if h.NumberOfRvaAndSizes > 4 {
			certOff, certSize = h.DataDirectory[4].VirtualAddress, h.DataDirectory[4].Size
		}
	default:
		return zero, errors.New("parsing PE: no optional header")
	}
	checksumOff := opt + 64
	if sizeOfHeaders > len(image) || certDirOff+8 > sizeOfHeaders {
		return zero, errors.New("parsing PE: headers out of range")
	}
	h := sha256.New()
	h.Write(image[:checksumOff])
	h.Write(image[checksumOff+4 : certDirOff])
	h.Write(image[certDirOff+8 : sizeOfHeaders])
	sections := append([]*pe.Section(nil), f.Sections...)
	sort.SliceStable(sections, func(i, j int) bool { return sections[i].Offset < sections[j].Offset })
	hashed := sizeOfHeaders
	for _, s := range sections {
		if s.Size == 0 {
			continue
		}
		end := int(s.Offset) + int(s.Size)
		if end > len(image) {
			return zero, fmt.Errorf("parsing PE: section %s out of range", s.Name)
		}
		h.Write(image[s.Offset:end])
		hashed += int(s.Size)
	}
	end := len(image)
	if certSize != 0 {
		if int(certOff)+int(certSize) > len(image) {
			return zero, errors.New("parsing PE: certificate table out of range")
		}
		end -= int(certSize)
	}
	if end > hashed {
		h.Write(image[hashed:end])
	}
	var sum [sha256.Size]byte
	copy(sum[:], h.Sum(nil))
	return sum, nil
}
