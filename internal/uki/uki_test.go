package uki

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"unicode/utf16"

	"github.com/berth-k8s/berth/internal/prereq"
)

// stubPath is systemd-stub as Debian's systemd-boot-efi ships it.
const stubPath = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub"

// needTools skips, or fails under CI=true, without objcopy and the stub.
func needTools(t *testing.T) {
	t.Helper()
	for _, p := range []string{stubPath} {
		if _, err := os.Stat(p); err != nil {
			unavailable(t, "needs "+p+" (Debian package systemd-boot-efi)")
		}
	}
	if _, err := exec.LookPath("objcopy"); err != nil {
		unavailable(t, "needs objcopy (Debian package binutils)")
	}
}

func unavailable(t *testing.T, why string) {
	t.Helper()
	prereq.Missing(t, "%s", why)
}

// build assembles a UKI the way image/build.sh does (objcopy onto systemd-stub). The kernel is a copy
// of the stub: any PE image will do for the measurements.
func build(t *testing.T, cmdline string) (dir, path string) {
	t.Helper()
	dir = t.TempDir()
	files := map[string][]byte{"osrel": []byte("ID=berth\nVERSION_ID=test\n"), "cmdline": []byte(cmdline), "initrd": bytes.Repeat([]byte("initrd"), 1000)}
	stub, err := os.ReadFile(stubPath)
	if err != nil {
		t.Fatal(err)
	}
	files["linux"] = stub
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	path = filepath.Join(dir, "uki.efi")
	out, err := exec.CommandContext(t.Context(), "objcopy",
		"--add-section", ".osrel="+filepath.Join(dir, "osrel"), "--change-section-vma", ".osrel=0x20000",
		"--add-section", ".cmdline="+filepath.Join(dir, "cmdline"), "--change-section-vma", ".cmdline=0x30000",
		"--add-section", ".linux="+filepath.Join(dir, "linux"), "--change-section-vma", ".linux=0x2000000",
		"--add-section", ".initrd="+filepath.Join(dir, "initrd"), "--change-section-vma", ".initrd=0x3000000",
		stubPath, path).CombinedOutput()
	if err != nil {
		t.Fatalf("objcopy: %v: %s", err, out)
	}
	return dir, path
}

func predict(t *testing.T, path string) *Prediction {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Predict(b)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// PCR 11 as systemd's own calculator has it, before any boot phase.
func TestPCR11MatchesSystemdMeasure(t *testing.T) {
	needTools(t)
	measure := "/usr/lib/systemd/systemd-measure"
	if _, err := os.Stat(measure); err != nil {
		unavailable(t, "needs "+measure+" (Debian package systemd)")
	}
	dir, path := build(t, "root=LABEL=berth-root rw console=ttyS0")
	p := predict(t, path)
	out, err := exec.CommandContext(t.Context(), measure, "calculate", "--bank=sha256", "--phase=",
		"--linux="+filepath.Join(dir, "linux"), "--osrel="+filepath.Join(dir, "osrel"),
		"--cmdline="+filepath.Join(dir, "cmdline"), "--initrd="+filepath.Join(dir, "initrd")).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-measure: %v: %s", err, out)
	}
	m := regexp.MustCompile(`11:sha256=([0-9a-f]{64})`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no PCR 11 in systemd-measure's output: %s", out)
	}
	got := p.PCRs[11]
	if hex.EncodeToString(got[:]) != string(m[1]) {
		t.Fatalf("PCR 11 = %x, systemd-measure says %s", got, m[1])
	}
}

// A one-byte change of the command line changes the predicted PCRs 4, 9 and 11: the check can fail.
// PCR 12 is zero for both (no override).
func TestCmdlineChangesPCRs(t *testing.T) {
	needTools(t)
	_, a := build(t, "root=LABEL=berth-root rw console=ttyS0")
	_, b := build(t, "root=LABEL=berth-root rw console=ttyS1")
	pa, pb := predict(t, a), predict(t, b)
	for _, pcr := range []int{4, 9, 11} {
		if pa.PCRs[pcr] == pb.PCRs[pcr] {
			t.Errorf("PCR %d is the same for two command lines", pcr)
		}
	}
	for _, p := range []*Prediction{pa, pb} {
		if v, ok := p.PCRs[12]; !ok || v != [32]byte{} {
			t.Errorf("PCR 12 predicted %x (present %v), want zero", v, ok)
		}
		if len(p.PCRs) != len(Predicted) {
			t.Errorf("%d PCRs predicted, want %v", len(p.PCRs), Predicted)
		}
	}
	if len(pa.Events) != 4+2*4+2 { // 4 firmware events, name and content of 4 sections, 2 kernel events
		t.Errorf("%d events, want 14", len(pa.Events))
	}
}

// PCR 9 as the kernel's EFI stub extends it: the UTF-16LE load options with their NUL, then the
// initrd, each as a plain SHA-256 of the bytes. Computed here independently of Predict's helpers.
func TestPCR9(t *testing.T) {
	needTools(t)
	cmdline := "root=/dev/mapper/berth-root ro berth.verity=00ff console=ttyS0"
	_, path := build(t, cmdline)
	p := predict(t, path)
	u16 := utf16.Encode([]rune(cmdline + "\x00"))
	opts := make([]byte, 2*len(u16))
	for i, c := range u16 {
		binary.LittleEndian.PutUint16(opts[2*i:], c)
	}
	var pcr [32]byte
	for _, data := range [][]byte{opts, bytes.Repeat([]byte("initrd"), 1000)} {
		d := sha256.Sum256(data)
		pcr = sha256.Sum256(append(pcr[:], d[:]...))
	}
	if p.PCRs[9] != pcr {
		t.Fatalf("PCR 9 = %x, want %x", p.PCRs[9], pcr)
	}
	_, other := build(t, cmdline+" ")
	if predict(t, other).PCRs[9] == pcr {
		t.Error("PCR 9 is the same for a command line with one more byte")
	}
}

// The Authenticode digest leaves out the checksum, the certificate table entry and the certificate
// table itself, and covers everything else.
func TestAuthenticode(t *testing.T) {
	needTools(t)
	_, path := build(t, "x")
	img, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want, err := Authenticode(img)
	if err != nil {
		t.Fatal(err)
	}
	peOff := int(binary.LittleEndian.Uint32(img[0x3c:]))
	opt := peOff + 24

	changed := bytes.Clone(img)
	binary.LittleEndian.PutUint32(changed[opt+64:], 0xdeadbeef) // checksum
	if got, _ := Authenticode(changed); got != want {
		t.Error("the checksum field changed the digest")
	}
	// A signature appended as the certificate table (what sbsign does) is left out.
	signed := append(bytes.Clone(img), bytes.Repeat([]byte{0xaa}, 64)...)
	binary.LittleEndian.PutUint32(signed[opt+112+32:], uint32(len(img)))
	binary.LittleEndian.PutUint32(signed[opt+112+36:], 64)
	if got, err := Authenticode(signed); err != nil || got != want {
		t.Errorf("an appended certificate table changed the digest (%v)", err)
	}
	// Any byte of a section changes it.
	sections, err := Sections(img)
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(img, sections[".osrel"])
	changed = bytes.Clone(img)
	changed[i] ^= 1
	if got, _ := Authenticode(changed); got == want {
		t.Error("a changed section byte kept the digest")
	}
}

func TestNotUKI(t *testing.T) {
	if _, err := Predict([]byte("MZ not really")); !errors.Is(err, ErrNotUKI) {
		t.Fatalf("Predict(garbage) = %v, want ErrNotUKI", err)
	}
	needTools(t)
	stub, err := os.ReadFile(stubPath)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Predict(stub); !errors.Is(err, ErrNotUKI) {
		t.Fatalf("Predict(the bare stub) = %v, want ErrNotUKI (no .linux)", err)
	}
}
