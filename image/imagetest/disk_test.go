package imagetest

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/prereq"
)

// diskTools skips, or fails under CI=true, without what image/disk.sh runs.
func diskTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"sfdisk", "mkfs.vfat", "mmd", "mcopy", "mtype"} {
		if _, err := exec.LookPath(tool); err != nil {
			prereq.Missing(t, "%s is not installed (fdisk, dosfstools, mtools): cannot build a disk image", tool)
		}
	}
}

type partition struct {
	Start int64  `json:"start"`
	Size  int64  `json:"size"`
	Type  string `json:"type"`
	Name  string `json:"name"`
	Attrs string `json:"attrs"`
}

// runDisk runs image/disk.sh on the given inputs and returns the raw disk's bytes and partitions,
// or disk.sh's error and output.
func runDisk(t *testing.T, dir string, uki, data, hash []byte, env ...string) ([]byte, []partition, string, error) {
	t.Helper()
	files := map[string][]byte{"uki.efi": uki, "root.squashfs": data, "root.verity": hash}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	raw := filepath.Join(dir, "disk.raw")
	cmd := exec.Command("../disk.sh", filepath.Join(dir, "uki.efi"), filepath.Join(dir, "root.squashfs"), filepath.Join(dir, "root.verity"), raw)
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, nil, string(out), err
	}
	out, err := exec.Command("sfdisk", "-J", raw).Output()
	if err != nil {
		t.Fatalf("sfdisk -J: %v", err)
	}
	var table struct {
		PartitionTable struct {
			Label      string      `json:"label"`
			Partitions []partition `json:"partitions"`
		} `json:"partitiontable"`
	}
	if err := json.Unmarshal(out, &table); err != nil {
		t.Fatalf("sfdisk -J: %v: %s", err, out)
	}
	if table.PartitionTable.Label != "gpt" {
		t.Fatalf("label %q, want gpt", table.PartitionTable.Label)
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	return b, table.PartitionTable.Partitions, "", nil
}

func random(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// The disk has the ESP with the UKI as the default boot entry, the root and its hash tree byte for
// byte at their partitions, and an empty berth-state partition; the same inputs give the same bytes.
func TestDiskLayout(t *testing.T) {
	diskTools(t)
	uki, data, hash := random(t, 3<<20), random(t, 5<<20+17), random(t, 70<<10)
	dir := t.TempDir()
	disk, parts, out, err := runDisk(t, dir, uki, data, hash, "IMAGE_STATE_SIZE=8", "IMAGE_ESP_SIZE=40")
	if err != nil {
		t.Fatalf("disk.sh: %v: %s", err, out)
	}
	want := []struct {
		name, typ string
		content   []byte
		mib       int64
	}{
		{"berth-esp", "C12A7328-F817-11D2-BA4B-00A0C93EC3B8", nil, 40},
		{"berth-root", "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709", data, 6},
		{"berth-root-verity", "2C7357ED-EBD2-46D9-AEC1-23D437EC2BF5", hash, 1},
		{"berth-state", "0FC63DAF-8483-4772-8E79-3D69D8477DE4", nil, 8},
	}
	if len(parts) != len(want) {
		t.Fatalf("%d partitions, want %d: %+v", len(parts), len(want), parts)
	}
	for i, w := range want {
		p := parts[i]
		if p.Name != w.name || p.Type != w.typ || p.Size != w.mib*2048 {
			t.Errorf("partition %d = %+v, want name %s, type %s, %d MiB", i+1, p, w.name, w.typ, w.mib)
		}
		got := disk[p.Start*512 : (p.Start+p.Size)*512]
		if w.content != nil && (!bytes.Equal(got[:len(w.content)], w.content) || bytes.ContainsFunc(got[len(w.content):], func(r rune) bool { return r != 0 })) {
			t.Errorf("partition %s does not hold its content followed by zeros", w.name)
		}
		if w.name == "berth-state" && bytes.ContainsFunc(got, func(r rune) bool { return r != 0 }) {
			t.Error("the berth-state partition is not empty")
		}
	}
	// The UKI is \EFI\BOOT\BOOTX64.EFI on the ESP.
	esp := filepath.Join(dir, "esp.img")
	if err := os.WriteFile(esp, disk[parts[0].Start*512:(parts[0].Start+parts[0].Size)*512], 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("mtype", "-i", esp, "::/EFI/BOOT/BOOTX64.EFI")
	cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
	got, err := cmd.Output()
	if err != nil || !bytes.Equal(got, uki) {
		t.Errorf("BOOTX64.EFI on the ESP is not the UKI (%v, %d bytes)", err, len(got))
	}
	// Reproducible.
	again, _, _, err := runDisk(t, t.TempDir(), uki, data, hash, "IMAGE_STATE_SIZE=8", "IMAGE_ESP_SIZE=40")
	if err != nil || !bytes.Equal(again, disk) {
		t.Errorf("a second build of the same inputs differs (%v)", err)
	}
}

// A UKI that does not fit the ESP is refused with a named error, and no disk is left behind.
func TestDiskUKITooLarge(t *testing.T) {
	diskTools(t)
	dir := t.TempDir()
	_, _, out, err := runDisk(t, dir, random(t, 39<<20), random(t, 1<<20), random(t, 4096), "IMAGE_ESP_SIZE=40")
	if err == nil {
		t.Fatal("disk.sh accepted a 39 MiB UKI for a 40 MiB ESP")
	}
	if !strings.Contains(out, "does not fit an EFI system partition") {
		t.Errorf("error %q does not name the problem", out)
	}
	if _, statErr := os.Stat(filepath.Join(dir, "disk.raw")); !os.IsNotExist(statErr) {
		t.Error("a disk image was left behind")
	}
}

// The built root matches the root hash in the UKI's command line, and one byte changed in
// /usr/bin/bootstrapper's data does not: veritysetup verify (user space, no device-mapper) checks the
// same hash tree the guest kernel does.
func TestVerityRoot(t *testing.T) {
	root := imageRoot(t)
	for _, tool := range []string{"veritysetup", "rdsquashfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			prereq.Missing(t, "%s is not installed (cryptsetup-bin, squashfs-tools-ng)", tool)
		}
	}
	info := buildInfo(t, root)
	hash := info["IMAGE_ROOTHASH"]
	if len(hash) != 64 || !strings.Contains(info["IMAGE_CMDLINE"], "berth.verity="+hash) {
		t.Fatalf("the build's command line %q does not carry its root hash %q", info["IMAGE_CMDLINE"], hash)
	}
	out := filepath.Dir(root)
	data, tree := filepath.Join(out, "berth-root.squashfs"), filepath.Join(out, "berth-root.verity")
	if b, err := exec.Command("veritysetup", "verify", data, tree, hash).CombinedOutput(); err != nil {
		t.Fatalf("the built root does not verify against its root hash: %v: %s", err, b)
	}
	stat, err := exec.Command("rdsquashfs", "--stat", "/usr/bin/bootstrapper", data).Output()
	if err != nil {
		t.Fatalf("rdsquashfs --stat: %v", err)
	}
	var start int64
	for line := range strings.SplitSeq(string(stat), "\n") {
		if v, ok := strings.CutPrefix(line, "Blocks start:"); ok {
			if _, err := fmt.Sscan(v, &start); err != nil {
				t.Fatalf("parsing %q: %v", line, err)
			}
		}
	}
	if start == 0 {
		t.Fatalf("no data offset for /usr/bin/bootstrapper in: %s", stat)
	}
	tampered := filepath.Join(t.TempDir(), "root.squashfs")
	if b, err := exec.Command("cp", "--reflink=auto", data, tampered).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, b)
	}
	f, err := os.OpenFile(tampered, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	one := make([]byte, 1)
	if _, err := f.ReadAt(one, start+100); err != nil {
		t.Fatal(err)
	}
	one[0] ^= 1
	if _, err := f.WriteAt(one, start+100); err != nil {
		t.Fatal(err)
	}
	b, err := exec.Command("veritysetup", "verify", tampered, tree, hash).CombinedOutput()
	if err == nil {
		t.Fatalf("a root with one byte of the bootstrapper changed verified: %s", b)
	}
	t.Logf("one byte changed at %d: veritysetup verify refused it: %s", start+100, strings.TrimSpace(string(b)))
}
