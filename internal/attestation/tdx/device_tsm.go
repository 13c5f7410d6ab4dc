package tdx

import (
	"context"
	"crypto/rand"
	"crypto/sha512"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/spf13/afero"
)

// tsmProviderTDX is what configfs-tsm's provider attribute reads on a TDX guest.
const tsmProviderTDX = "tdx_guest"

// maxOutblobSize is configfs-tsm's limit on a report (32 KiB).
const maxOutblobSize = 32 << 10

// tsmDevice produces quotes through configfs-tsm and reaches RTMRs through the measurement-register sysfs files.
//
// Report flow (Documentation/ABI/testing/configfs-tsm): create a directory under the report directory, read
// its generation, write the 64-byte report data to inblob, read the quote from outblob, read generation again
// (it must have advanced by exactly one write: anything else means another writer raced us), remove the
// directory.
type tsmDevice struct {
	fs        afero.Fs
	reportDir string
	mrDir     string
}

// OpenTSM returns an OpenFunc for configfs-tsm rooted at reportDir (normally TSMReportDir), with measurement
// registers at mrDir (normally MeasurementsDir). fs is the real filesystem in production (afero.NewOsFs()).
func OpenTSM(fs afero.Fs, reportDir, mrDir string) OpenFunc {
	return func() (Device, error) {
		ok, err := afero.DirExists(fs, reportDir)
		if err != nil || !ok {
			return nil, fmt.Errorf("opening configfs-tsm at %s: %w", reportDir, ErrNoDevice)
		}
		return &tsmDevice{fs: fs, reportDir: reportDir, mrDir: mrDir}, nil
	}
}

// Quote implements Device.
func (d *tsmDevice) Quote(ctx context.Context, reportData [ReportDataSize]byte) (quote []byte, err error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("generating TDX quote: %w", err)
	}
	var suffix [8]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		return nil, fmt.Errorf("naming configfs-tsm report: %w", err)
	}
	dir := path.Join(d.reportDir, "berth-"+hex.EncodeToString(suffix[:]))
	if err := d.fs.Mkdir(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating configfs-tsm report: %w", err)
	}
	defer func() {
		if rmErr := d.fs.Remove(dir); rmErr != nil && err == nil {
			err = fmt.Errorf("removing configfs-tsm report: %w", rmErr)
		}
	}()

	provider, err := afero.ReadFile(d.fs, path.Join(dir, "provider"))
	if err != nil {
		return nil, fmt.Errorf("reading configfs-tsm provider: %w", err)
	}
	if p := strings.TrimSpace(string(provider)); p != tsmProviderTDX {
		return nil, fmt.Errorf("checking configfs-tsm provider: %q is not %s", p, tsmProviderTDX)
	}
	gen0, err := d.generation(dir)
	if err != nil {
		return nil, err
	}
	if err := writeAttr(d.fs, path.Join(dir, "inblob"), reportData[:]); err != nil {
		return nil, fmt.Errorf("writing configfs-tsm inblob: %w", err)
	}
	out, err := readLimited(d.fs, path.Join(dir, "outblob"), maxOutblobSize)
	if err != nil {
		return nil, fmt.Errorf("reading configfs-tsm outblob: %w", err)
	}
	gen1, err := d.generation(dir)
	if err != nil {
		return nil, err
	}
	if gen1 != gen0+1 {
		return nil, fmt.Errorf("generating TDX quote: configfs-tsm generation went from %d to %d, the report was changed concurrently", gen0, gen1)
	}
	if len(out) == 0 {
		return nil, errors.New("generating TDX quote: configfs-tsm returned an empty outblob")
	}
	return out, nil
}

func (d *tsmDevice) generation(dir string) (uint64, error) {
	b, err := afero.ReadFile(d.fs, path.Join(dir, "generation"))
	if err != nil {
		return 0, fmt.Errorf("reading configfs-tsm generation: %w", err)
	}
	g, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parsing configfs-tsm generation: %w", err)
	}
	return g, nil
}

// ExtendRTMR implements Device: it writes SHA-384(data) to the RTMR's sysfs file, which the kernel extends into
// the register.
func (d *tsmDevice) ExtendRTMR(ctx context.Context, index int, data []byte) error {
	if err := checkRTMRIndex(index); err != nil {
		return fmt.Errorf("extending RTMR: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("extending RTMR: %w", err)
	}
	digest := sha512.Sum384(data)
	if err := writeAttr(d.fs, d.mrFile(fmt.Sprintf("rtmr%d", index)), digest[:]); err != nil {
		return fmt.Errorf("extending RTMR %d: %w", index, err)
	}
	return nil
}

// Measurements implements Device. It reads the sysfs measurement registers where the kernel has them and
// otherwise takes them from a fresh quote over zero report data.
func (d *tsmDevice) Measurements(ctx context.Context) ([5][MeasurementSize]byte, error) {
	var out [5][MeasurementSize]byte
	names := []string{"mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3"}
	if ok, _ := afero.Exists(d.fs, d.mrFile(names[0])); ok {
		for i, n := range names {
			b, err := readLimited(d.fs, d.mrFile(n), MeasurementSize+1)
			if err != nil {
				return out, fmt.Errorf("reading %s: %w", n, err)
			}
			if len(b) != MeasurementSize {
				return out, fmt.Errorf("reading %s: %d bytes, want %d", n, len(b), MeasurementSize)
			}
			copy(out[i][:], b)
		}
		return out, nil
	}
	raw, err := d.Quote(ctx, [ReportDataSize]byte{})
	if err != nil {
		return out, fmt.Errorf("reading TDX measurements: %w", err)
	}
	q, err := ParseQuote(raw)
	if err != nil {
		return out, fmt.Errorf("reading TDX measurements: %w", err)
	}
	return q.Measurements(), nil
}

func (d *tsmDevice) mrFile(name string) string {
	return path.Join(d.mrDir, name+":sha384")
}

// Close implements Device; configfs-tsm holds nothing open between calls.
func (d *tsmDevice) Close() error { return nil }

// writeAttr writes b to a configfs or sysfs attribute in one write, without truncating or creating it.
func writeAttr(fs afero.Fs, name string, b []byte) error {
	f, err := fs.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// readLimited reads at most limit bytes of an attribute and fails if there are more.
func readLimited(fs afero.Fs, name string, limit int64) ([]byte, error) {
	f, err := fs.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s holds more than %d bytes", name, limit)
	}
	return b, nil
}
