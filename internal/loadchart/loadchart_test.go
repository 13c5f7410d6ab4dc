package loadchart

import (
	"errors"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// synthetic is a 20 s run: 200/s at 1 ms for 8 s, nothing for 2 s (a stall), then 100/s with 98 %
// at 5 ms and 2 % at 50 ms.
func synthetic(t *testing.T) *Recorder {
	t.Helper()
	t0 := time.Unix(1_700_000_000, 0)
	r, err := NewRecorder(t0, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for s := range 20 {
		wg.Add(1)
		go func() { // concurrent adders, as the harnesses' clients
			defer wg.Done()
			switch {
			case s < 8:
				for i := range 200 {
					r.Add(t0.Add(time.Duration(s)*time.Second+time.Duration(i)*5*time.Millisecond), time.Millisecond)
				}
			case s >= 10:
				for i := range 100 {
					lat := 5 * time.Millisecond
					if i%50 == 0 {
						lat = 50 * time.Millisecond
					}
					r.Add(t0.Add(time.Duration(s)*time.Second+time.Duration(i)*10*time.Millisecond), lat)
				}
			}
		}()
	}
	wg.Wait()
	return r
}

func near(got, want float64) bool { return math.Abs(got-want) <= 0.02*want }

func TestPoints(t *testing.T) {
	pts := synthetic(t).Points()
	if len(pts) != 20 {
		t.Fatalf("%d points, want 20", len(pts))
	}
	for i, p := range pts {
		if p.T != float64(i) {
			t.Errorf("point %d at t=%v", i, p.T)
		}
		switch {
		case i < 8:
			if p.N != 200 || p.Rate != 200 || !near(p.P50ms, 1) || !near(p.P99ms, 1) {
				t.Errorf("point %d = %+v, want 200/s at 1 ms", i, p)
			}
		case i < 10:
			if p.N != 0 || p.Rate != 0 || p.P50ms != 0 || p.P99ms != 0 {
				t.Errorf("point %d = %+v, want the stall", i, p)
			}
		default:
			// 2 of 100 at 50 ms: the 99th of 100 is one of them, the median is 5 ms.
			if p.N != 100 || !near(p.P50ms, 5) || !near(p.P99ms, 50) {
				t.Errorf("point %d = %+v, want 100/s, p50 5 ms, p99 50 ms", i, p)
			}
		}
	}
}

// TestStop checks that a run that stops within an interval gets that interval's rate over the part
// it ran: 50 requests in the first half second of the last interval are 100/s, not 50/s.
func TestStop(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	r, err := NewRecorder(t0, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 150 {
		r.Add(t0.Add(time.Duration(i)*10*time.Millisecond), time.Millisecond)
	}
	if pts := r.Points(); len(pts) != 2 || pts[1].Rate != 50 {
		t.Fatalf("without Stop: %+v", pts)
	}
	r.Stop(t0.Add(1500 * time.Millisecond))
	if pts := r.Points(); len(pts) != 2 || pts[0].Rate != 100 || pts[1].Rate != 100 {
		t.Fatalf("stopped after 1.5 s: %+v", pts)
	}
}

func TestBuckets(t *testing.T) {
	for _, d := range []time.Duration{0, 500 * time.Nanosecond, time.Microsecond, 1234 * time.Microsecond, 3 * time.Second, time.Hour} {
		b := bucket(d)
		if b < 0 || b >= numBuckets {
			t.Fatalf("bucket(%s) = %d", d, b)
		}
		if d > minLatency && b < numBuckets-1 && (bound(b) < d || float64(bound(b)) > float64(d)*growth*1.0001) {
			t.Errorf("bucket(%s) = %d with bound %s: not the smallest bound >= d", d, b, bound(b))
		}
	}
	if bucket(time.Hour) != numBuckets-1 {
		t.Error("an hour is not in the last bucket")
	}
}

func TestBadInput(t *testing.T) {
	if _, err := NewRecorder(time.Now(), 0); !errors.Is(err, ErrInterval) {
		t.Errorf("interval 0: %v", err)
	}
	path := filepath.Join(t.TempDir(), "x.png")
	if err := WritePNG(path, "empty"); !errors.Is(err, ErrNoPoints) {
		t.Errorf("no series: %v", err)
	}
	if err := WritePNG(path, "empty", Series{Name: "a"}); !errors.Is(err, ErrNoPoints) {
		t.Errorf("an empty series: %v", err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed chart left a file: %v", err)
	}
	if err := WritePNG(filepath.Join(t.TempDir(), "missing", "x.png"), "t", Series{Name: "a", Points: []Point{{N: 1, Rate: 1}}}); err == nil {
		t.Error("writing into a missing directory succeeded")
	}
}

func TestShift(t *testing.T) {
	s := Series{Name: "a", Points: []Point{{T: 0}, {T: 1}}}
	sh := s.Shift(10)
	if sh.Points[0].T != 10 || sh.Points[1].T != 11 || s.Points[0].T != 0 {
		t.Fatalf("shifted %+v from %+v", sh.Points, s.Points)
	}
	if s.End(time.Second) != 2 || (Series{}).End(time.Second) != 0 {
		t.Fatal("End")
	}
}

// TestWritePNG draws the synthetic run as two phases and checks the image: its size, and that both
// series' colors are in it. LOADCHART_KEEP=DIR keeps the PNG there to look at.
func TestWritePNG(t *testing.T) {
	dir := t.TempDir()
	if keep := os.Getenv("LOADCHART_KEEP"); keep != "" {
		dir = keep
	}
	path := filepath.Join(dir, "synthetic.png")
	pts := synthetic(t).Points()
	first := Series{Name: "accepted", Points: pts}
	second := Series{Name: "rejected", Points: pts[10:]}.Shift(first.End(time.Second) - 10)
	if err := WritePNG(path, "synthetic run", first, second); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("not a PNG: %v", err)
	}
	b := img.Bounds()
	if b.Dx() < 600 || b.Dy() < 400 {
		t.Fatalf("image is %dx%d", b.Dx(), b.Dy())
	}
	found := map[color.RGBA]int{}
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			c := color.RGBA{R: uint8(r >> 8), G: uint8(g >> 8), B: uint8(bl >> 8), A: 0xff}
			for _, p := range palette[:2] {
				if c == p.(color.RGBA) {
					found[c]++
				}
			}
		}
	}
	for _, p := range palette[:2] {
		if found[p.(color.RGBA)] < 100 {
			t.Errorf("color %v drawn in %d pixels: a series is missing", p, found[p.(color.RGBA)])
		}
	}
}
