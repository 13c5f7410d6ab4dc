// Package loadchart records the requests of a load run by the interval they began in (how many,
// and their latency quantiles) and draws them as a PNG chart: throughput on top, p50 and p99
// latency below, over the run's time. The load harnesses (make bench-join, make bench-webhook) write one next to
// their text output.
//
// A Recorder keeps, per interval, a count and a latency histogram with logarithmic buckets (2 %
// wide, from 1 µs to about 100 s), so memory grows with the run's length, not with its requests,
// and a quantile is exact to within 2 %.
package loadchart

import (
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"strconv"
	"sync"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Histogram buckets: bucket i holds latencies up to minLatency * growth^i.
const (
	minLatency = time.Microsecond
	growth     = 1.02
	numBuckets = 931 // growth^930 * 1 µs is about 100 s; the last bucket holds everything above
)

var (
	// ErrNoPoints means a chart was asked for without a single interval to draw.
	ErrNoPoints = errors.New("no points to draw")
	// ErrInterval means a Recorder was asked for with an interval that is not positive.
	ErrInterval = errors.New("the interval must be positive")
)

// Point is one interval of a run.
type Point struct {
	// T is the interval's start in seconds since the run began.
	T float64 `json:"t"`
	// N is the number of requests that began in the interval, Rate the same per second.
	N    int     `json:"n"`
	Rate float64 `json:"rate"`
	// P50ms and P99ms are latency quantiles of those requests, in milliseconds (0 when N is 0).
	P50ms float64 `json:"p50_ms"`
	P99ms float64 `json:"p99_ms"`
}

// Recorder collects completions by interval. It is safe for concurrent use.
type Recorder struct {
	start    time.Time
	interval time.Duration

	mu        sync.Mutex
	intervals []*[numBuckets]uint32
	end       time.Time
}

// NewRecorder returns a recorder of a run that began at start, with intervals of the given length.
func NewRecorder(start time.Time, interval time.Duration) (*Recorder, error) {
	if interval <= 0 {
		return nil, fmt.Errorf("recording a load run with interval %s: %w", interval, ErrInterval)
	}
	return &Recorder{start: start, interval: interval}, nil
}

// Add records one request that began at start and took latency. A request counts in the interval
// it began in, so that a run's last interval is not cut short by the requests still in flight at
// its end; one that began before the recorder's start counts in the first.
func (r *Recorder) Add(start time.Time, latency time.Duration) {
	i := max(int(start.Sub(r.start)/r.interval), 0)
	b := bucket(latency)
	r.mu.Lock()
	defer r.mu.Unlock()
	for len(r.intervals) <= i {
		r.intervals = append(r.intervals, nil)
	}
	if r.intervals[i] == nil {
		r.intervals[i] = new([numBuckets]uint32)
	}
	r.intervals[i][b]++
}

// bucket is the index of the smallest bucket whose bound is at least d.
func bucket(d time.Duration) int {
	if d <= minLatency {
		return 0
	}
	i := int(math.Ceil(math.Log(float64(d)/float64(minLatency)) / math.Log(growth)))
	return min(i, numBuckets-1)
}

// bound is bucket i's upper bound.
func bound(i int) time.Duration {
	return time.Duration(float64(minLatency) * math.Pow(growth, float64(i)))
}

// Stop says when the run stopped starting requests: the rate of the interval it falls in is its
// count over the part of the interval before end, not over the whole interval.
func (r *Recorder) Stop(end time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.end = end
}

// Points returns every interval from the start to the last one with a request, empty ones
// included (a stall shows as a drop to zero).
func (r *Recorder) Points() []Point {
	r.mu.Lock()
	defer r.mu.Unlock()
	pts := make([]Point, len(r.intervals))
	for i, h := range r.intervals {
		pts[i].T = (time.Duration(i) * r.interval).Seconds()
		if h == nil {
			continue
		}
		var n uint64
		for _, c := range h {
			n += uint64(c)
		}
		pts[i].N = int(n)
		covered := r.interval
		if !r.end.IsZero() {
			if left := r.end.Sub(r.start) - time.Duration(i)*r.interval; left > 0 && left < covered {
				covered = left
			}
		}
		pts[i].Rate = float64(n) / covered.Seconds()
		pts[i].P50ms = ms(quantile(h, n, 0.50))
		pts[i].P99ms = ms(quantile(h, n, 0.99))
	}
	return pts
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// quantile returns the bound of the bucket holding the q-quantile of the n latencies in h.
func quantile(h *[numBuckets]uint32, n uint64, q float64) time.Duration {
	rank := uint64(math.Ceil(q * float64(n)))
	rank = max(rank, 1)
	var seen uint64
	for i, c := range h {
		if seen += uint64(c); seen >= rank {
			return bound(i)
		}
	}
	return bound(numBuckets - 1)
}

// Series is one named line set of a chart: a phase of a run, say.
type Series struct {
	Name   string
	Points []Point
}

// Shift returns the series with every point d seconds later: to draw phases one after the other.
func (s Series) Shift(d float64) Series {
	pts := make([]Point, len(s.Points))
	for i, p := range s.Points {
		p.T += d
		pts[i] = p
	}
	return Series{Name: s.Name, Points: pts}
}

// End is the time (seconds) after the last point's interval, given the interval length.
func (s Series) End(interval time.Duration) float64 {
	if len(s.Points) == 0 {
		return 0
	}
	return s.Points[len(s.Points)-1].T + interval.Seconds()
}

// Chart size.
const (
	width  = 24 * vg.Centimeter
	height = 18 * vg.Centimeter
)

// palette colors the series in turn.
var palette = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
}

// WritePNG draws the series into a PNG file at path: requests per second on top, p50 (dashed) and
// p99 (solid) latency in milliseconds below, both over seconds since the start. Intervals without
// requests have no latency point.
func WritePNG(path, title string, series ...Series) error {
	if len(series) == 0 || !hasPoints(series) {
		return fmt.Errorf("writing chart %s: %w", path, ErrNoPoints)
	}
	rate := plot.New()
	rate.Title.Text = title
	rate.Y.Label.Text = "requests / s"
	rate.Y.Min = 0
	lat := plot.New()
	lat.X.Label.Text = "seconds since start"
	lat.Y.Label.Text = "latency (ms)"
	lat.Y.Min = 0
	for _, p := range []*plot.Plot{rate, lat} {
		p.Add(plotter.NewGrid())
		p.Legend.Top = true
	}
	for i, s := range series {
		c := palette[i%len(palette)]
		rates := make(plotter.XYs, len(s.Points))
		var p50, p99 []plotter.XYs // runs of intervals with completions: a stall breaks the lines
		for j, p := range s.Points {
			rates[j] = plotter.XY{X: p.T, Y: p.Rate}
			if p.N == 0 {
				continue
			}
			if j == 0 || s.Points[j-1].N == 0 {
				p50, p99 = append(p50, nil), append(p99, nil)
			}
			p50[len(p50)-1] = append(p50[len(p50)-1], plotter.XY{X: p.T, Y: p.P50ms})
			p99[len(p99)-1] = append(p99[len(p99)-1], plotter.XY{X: p.T, Y: p.P99ms})
		}
		if err := addLines(rate, []plotter.XYs{rates}, c, false, s.Name); err != nil {
			return fmt.Errorf("writing chart %s: %w", path, err)
		}
		if err := addLines(lat, p50, c, true, s.Name+" p50"); err != nil {
			return fmt.Errorf("writing chart %s: %w", path, err)
		}
		if err := addLines(lat, p99, c, false, s.Name+" p99"); err != nil {
			return fmt.Errorf("writing chart %s: %w", path, err)
		}
	}
	// One time axis for both; headroom above the data for the legend.
	xmax := math.Max(rate.X.Max, lat.X.Max)
	rate.X.Min, lat.X.Min, rate.X.Max, lat.X.Max = 0, 0, xmax, xmax
	for i, p := range []*plot.Plot{rate, lat} {
		// The legend (top right) takes about 5 % of the height per entry: one a series on top, two
		// below.
		entries := (i + 1) * len(series)
		p.Y.Max = math.Max(p.Y.Max, 1e-3) / (1 - 0.05*float64(entries+1))
		p.X.Tick.Marker = niceTicks{}
		p.Y.Tick.Marker = niceTicks{}
	}

	img := vgimg.New(width, height)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Millimeter, PadY: 4 * vg.Millimeter,
		PadTop: 2 * vg.Millimeter, PadBottom: 2 * vg.Millimeter, PadLeft: 2 * vg.Millimeter, PadRight: 4 * vg.Millimeter}
	canvases := plot.Align([][]*plot.Plot{{rate}, {lat}}, tiles, dc)
	rate.Draw(canvases[0][0])
	lat.Draw(canvases[1][0])

	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("writing chart: %w", err)
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("writing chart %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing chart %s: %w", path, err)
	}
	return nil
}

func hasPoints(series []Series) bool {
	for _, s := range series {
		if len(s.Points) > 0 {
			return true
		}
	}
	return false
}

// addLines adds each run of points as a line (dashed if asked), with one legend entry.
func addLines(p *plot.Plot, runs []plotter.XYs, c color.Color, dashed bool, name string) error {
	for i, xys := range runs {
		l, err := plotter.NewLine(xys)
		if err != nil {
			return err
		}
		l.Color = c
		l.Width = vg.Points(1.2)
		if dashed {
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		p.Add(l)
		if i == 0 {
			p.Legend.Add(name, l)
		}
	}
	return nil
}

// niceTicks labels about every tenth of the axis at 1, 2 or 5 times a power of ten, with a minor
// tick halfway.
type niceTicks struct{}

func (niceTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(hi > lo) {
		return []plot.Tick{{Value: lo, Label: label(lo)}}
	}
	raw := (hi - lo) / 10
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	step := mag
	for _, m := range []float64{1, 2, 5, 10} {
		if step = m * mag; step >= raw {
			break
		}
	}
	var ticks []plot.Tick
	for v := math.Ceil(lo/step) * step; v <= hi+step/1e9; v += step {
		ticks = append(ticks, plot.Tick{Value: v, Label: label(v)})
		if m := v + step/2; m <= hi {
			ticks = append(ticks, plot.Tick{Value: m})
		}
	}
	return ticks
}

// label writes a tick value without exponent and without the float noise of adding up steps.
func label(v float64) string {
	return strconv.FormatFloat(math.Round(v*1e6)/1e6, 'f', -1, 64)
}
