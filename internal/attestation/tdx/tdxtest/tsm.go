package tdxtest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/attestation/tdx"
	"github.com/berth-k8s/berth/internal/prereq"
)

// Unmount retries: the kernel refuses (EBUSY) while a process still has a file of the mount open.
const (
	unmountPoll    = 50 * time.Millisecond
	unmountTimeout = 10 * time.Second
)

// ServeTSM serves td through a configfs-tsm report directory at root/sys/kernel/config/tsm/report, a FUSE file
// system in this process, so that another process quotes through tdx.OpenAutoUnder(root) with the same file
// operations it makes on a TDX guest kernel: mkdir of a report, provider and generation reads, one write of the
// report data to inblob, the quote read from outblob, rmdir. Each report counts its inblob writes in generation,
// as the kernel does. Quotes come from td at the time outblob is opened.
//
// It skips t where FUSE cannot be mounted (no /dev/fuse, or not allowed to mount). The file system is unmounted at
// t's cleanup: start processes that use it after calling ServeTSM, so that they are stopped first.
func ServeTSM(t testing.TB, td *TD, root string) {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		prereq.Missing(t, "serving configfs-tsm needs FUSE: %v", err)
	}
	dir := filepath.Join(root, tdx.TSMReportDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	zero := time.Duration(0)
	server, err := fs.Mount(dir, &reportDir{td: td}, &fs.Options{
		MountOptions: fuse.MountOptions{DirectMountStrict: true, FsName: "tdxtest-tsm", Name: "configfs-tsm"},
		// configfs attributes change under the reader: nothing may be cached.
		EntryTimeout: &zero, AttrTimeout: &zero, NegativeTimeout: &zero,
	})
	if err != nil {
		if errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EACCES) {
			prereq.Missing(t, "serving configfs-tsm needs permission to mount FUSE: %v", err)
		}
		t.Fatalf("mounting configfs-tsm at %s: %v", dir, err)
	}
	t.Cleanup(func() {
		err := wait.PollUntilContextTimeout(context.Background(), unmountPoll, unmountTimeout, true, func(context.Context) (bool, error) {
			return server.Unmount() == nil, nil
		})
		if err != nil {
			// Detach it so the test's temporary directory can go; the serve loop ends with the detach.
			t.Errorf("unmounting configfs-tsm at %s: %v", dir, err)
			_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		}
		server.Wait()
	})
}

// reportDir is configfs-tsm's report directory: every directory made in it is a report.
type reportDir struct {
	fs.Inode
	td *TD
}

var (
	_ fs.NodeMkdirer   = (*reportDir)(nil)
	_ fs.NodeGetattrer = (*reportDir)(nil)
)

func (d *reportDir) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFDIR | 0o755
	return 0
}

// Mkdir creates a report with its attributes.
func (d *reportDir) Mkdir(ctx context.Context, _ string, _ uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	r := &report{td: d.td}
	node := d.NewPersistentInode(ctx, r, fs.StableAttr{Mode: fuse.S_IFDIR})
	for name, mode := range map[string]uint32{"provider": 0o444, "generation": 0o444, "inblob": 0o200, "outblob": 0o444} {
		attr := node.NewPersistentInode(ctx, &attribute{r: r, name: name, mode: mode}, fs.StableAttr{Mode: fuse.S_IFREG})
		node.AddChild(name, attr, false)
	}
	out.Mode = fuse.S_IFDIR | 0o700
	return node, 0
}

// report is one report directory: the committed report data and the count of inblob writes.
type report struct {
	fs.Inode
	td *TD

	mu         sync.Mutex
	inblob     [tdx.ReportDataSize]byte
	generation uint64
}

var _ fs.NodeGetattrer = (*report)(nil)

func (r *report) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFDIR | 0o700
	return 0
}

// attribute is one file of a report.
type attribute struct {
	fs.Inode
	r    *report
	name string
	mode uint32
}

var (
	_ fs.NodeOpener    = (*attribute)(nil)
	_ fs.NodeGetattrer = (*attribute)(nil)
)

func (a *attribute) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFREG | a.mode
	return 0
}

// Open snapshots what a read returns (read-only attributes) or starts a write (inblob). Direct I/O keeps the
// kernel from caching any of it.
func (a *attribute) Open(_ context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	writing := flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0
	if writing != (a.name == "inblob") {
		return nil, 0, syscall.EACCES
	}
	r := a.r
	switch a.name {
	case "inblob":
		return &inblobHandle{r: r}, fuse.FOPEN_DIRECT_IO, 0
	case "provider":
		return &readHandle{content: []byte("tdx_guest\n")}, fuse.FOPEN_DIRECT_IO, 0
	case "generation":
		r.mu.Lock()
		g := r.generation
		r.mu.Unlock()
		return &readHandle{content: []byte(strconv.FormatUint(g, 10) + "\n")}, fuse.FOPEN_DIRECT_IO, 0
	case "outblob":
		r.mu.Lock()
		rd := r.inblob
		r.mu.Unlock()
		q, err := r.td.Quote(rd)
		if err != nil {
			return nil, 0, syscall.EIO
		}
		return &readHandle{content: q}, fuse.FOPEN_DIRECT_IO, 0
	}
	return nil, 0, syscall.ENOENT
}

// readHandle reads a snapshot.
type readHandle struct {
	content []byte
}

var _ fs.FileReader = (*readHandle)(nil)

func (h *readHandle) Read(_ context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if off >= int64(len(h.content)) {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), int64(len(h.content)))
	return fuse.ReadResultData(h.content[off:end]), 0
}

// inblobHandle collects a write of report data and commits it when the file is closed, the way configfs commits a
// binary attribute: the report data becomes the report's and generation counts the write.
type inblobHandle struct {
	r *report

	mu  sync.Mutex
	buf []byte
}

var (
	_ fs.FileWriter  = (*inblobHandle)(nil)
	_ fs.FileFlusher = (*inblobHandle)(nil)
)

func (h *inblobHandle) Write(_ context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if off != int64(len(h.buf)) || len(h.buf)+len(data) > tdx.ReportDataSize {
		return 0, syscall.EINVAL
	}
	h.buf = append(h.buf, data...)
	return uint32(len(data)), 0
}

func (h *inblobHandle) Flush(context.Context) syscall.Errno {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.buf == nil {
		return 0
	}
	h.r.mu.Lock()
	h.r.inblob = [tdx.ReportDataSize]byte{}
	copy(h.r.inblob[:], h.buf)
	h.r.generation++
	h.r.mu.Unlock()
	h.buf = nil
	return 0
}
