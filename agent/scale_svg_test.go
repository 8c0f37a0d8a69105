package agent_test

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// scaleKey is a point of BenchmarkScale's grid.
type scaleKey struct{ partitions, agents int }

// scaleSeries is one line of a chart: a value per partition count.
type scaleSeries struct {
	name   string
	color  string
	dashed bool
	points map[int]float64 // partitions → value
}

// writeScaleSVG draws BenchmarkScale's grid as two charts against the
// partition count (log scale): a failover's and a kill's rebalance time,
// and the etcd bytes per second of the steady flow against the budget.
func writeScaleSVG(path string, got map[scaleKey]scalePoint, budget float64) error {
	series := func(agents int, name, color string, dashed bool, v func(scalePoint) float64) scaleSeries {
		s := scaleSeries{name: name, color: color, dashed: dashed, points: map[int]float64{}}
		for k, pt := range got {
			if k.agents == agents {
				s.points[k.partitions] = v(pt)
			}
		}
		return s
	}
	var b strings.Builder
	b.WriteString(`<svg xmlns="http://www.w3.org/2000/svg" width="1000" height="340" font-family="sans-serif" font-size="12">` + "\n")
	b.WriteString(`<rect width="1000" height="340" fill="white"/>` + "\n")
	chart(&b, 0, "Seconds until every partition is consumed again", "s", []scaleSeries{
		series(3, "failover, 3 agents", "#1f77b4", false, func(p scalePoint) float64 { return p.failover.Seconds() }),
		series(10, "failover, 10 agents", "#ff7f0e", false, func(p scalePoint) float64 { return p.failover.Seconds() }),
		series(3, "kill, 3 agents", "#1f77b4", true, func(p scalePoint) float64 { return p.kill.Seconds() }),
		series(10, "kill, 10 agents", "#ff7f0e", true, func(p scalePoint) float64 { return p.kill.Seconds() }),
	}, 0)
	chart(&b, 480, "etcd kB/s of positions while every partition is busy", "kB/s", []scaleSeries{
		series(3, "3 agents", "#1f77b4", false, func(p scalePoint) float64 { return p.offsetBytes / 1e3 }),
		series(10, "10 agents", "#ff7f0e", false, func(p scalePoint) float64 { return p.offsetBytes / 1e3 }),
	}, budget/1e3)
	b.WriteString("</svg>\n")
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// chart draws one chart at x offset left; limit, when positive, is a
// horizontal line (the budget).
func chart(b *strings.Builder, left float64, title, unit string, ss []scaleSeries, limit float64) {
	const w, h, padL, padT, padB = 440.0, 240.0, 50.0, 30.0, 70.0
	top := 0.0
	var xs []int
	for _, s := range ss {
		for p, v := range s.points {
			top = max(top, v)
			if !slices.Contains(xs, p) {
				xs = append(xs, p)
			}
		}
	}
	top = max(top, limit) * 1.15
	if top == 0 || len(xs) == 0 {
		return
	}
	slices.Sort(xs)
	lo, hi := math.Log10(float64(xs[0])), math.Log10(float64(xs[len(xs)-1]))
	px := func(p int) float64 {
		if hi == lo {
			return left + padL + w/2
		}
		return left + padL + (math.Log10(float64(p))-lo)/(hi-lo)*(w-20)
	}
	py := func(v float64) float64 { return padT + h - v/top*h }
	fmt.Fprintf(b, `<text x="%.0f" y="18" font-weight="bold">%s</text>`+"\n", left+padL, title)
	fmt.Fprintf(b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#444"/>`+"\n", left+padL, py(0), left+padL+w, py(0))
	fmt.Fprintf(b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#444"/>`+"\n", left+padL, py(0), left+padL, padT)
	for i := 0; i <= 4; i++ {
		v := top / 1.15 * float64(i) / 4
		fmt.Fprintf(b, `<text x="%.0f" y="%.0f" text-anchor="end">%.3g</text>`+"\n", left+padL-4, py(v)+4, v)
		fmt.Fprintf(b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="#eee"/>`+"\n", left+padL, py(v), left+padL+w, py(v))
	}
	fmt.Fprintf(b, `<text x="%.0f" y="%.0f" text-anchor="middle">%s</text>`+"\n", left+14, padT-8, unit)
	for _, p := range xs {
		fmt.Fprintf(b, `<text x="%.0f" y="%.0f" text-anchor="middle">%d</text>`+"\n", px(p), py(0)+16, p)
	}
	fmt.Fprintf(b, `<text x="%.0f" y="%.0f" text-anchor="middle">partitions</text>`+"\n", left+padL+w/2, py(0)+32)
	if limit > 0 {
		fmt.Fprintf(b, `<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#d62728" stroke-dasharray="6 3"/>`+"\n", left+padL, py(limit), left+padL+w, py(limit))
		fmt.Fprintf(b, `<text x="%.0f" y="%.1f" fill="#d62728" text-anchor="end">budget %.0f kB/s</text>`+"\n", left+padL+w, py(limit)-4, limit)
	}
	for i, s := range ss {
		ps := slices.Sorted(maps.Keys(s.points))
		var pts []string
		for _, p := range ps {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(p), py(s.points[p])))
		}
		dash := ""
		if s.dashed {
			dash = ` stroke-dasharray="4 3"`
		}
		fmt.Fprintf(b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s/>`+"\n", strings.Join(pts, " "), s.color, dash)
		for _, p := range ps {
			fmt.Fprintf(b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(p), py(s.points[p]), s.color)
		}
		lx, ly := left+padL+float64(i%2)*220, py(0)+48+float64(i/2)*16
		fmt.Fprintf(b, `<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="%s" stroke-width="2"%s/>`+"\n", lx, ly-4, lx+24, ly-4, s.color, dash)
		fmt.Fprintf(b, `<text x="%.0f" y="%.0f">%s</text>`+"\n", lx+30, ly, s.name)
	}
}

// TestScaleSVGIsWellFormed: the chart of a grid is well-formed SVG with a
// line for each series and the budget.
func TestScaleSVGIsWellFormed(t *testing.T) {
	t.Parallel()
	got := map[scaleKey]scalePoint{}
	for _, p := range []int{12, 120, 1200} {
		for _, a := range []int{3, 10} {
			got[scaleKey{p, a}] = scalePoint{failover: time.Duration(p) * time.Millisecond, kill: 2 * time.Second, offsetBytes: float64(p * 100)}
		}
	}
	path := filepath.Join(t.TempDir(), "scale.svg")
	if err := writeScaleSVG(path, got, 262144); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	d := xml.NewDecoder(bytes.NewReader(b))
	lines := 0
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("scale.svg is not well-formed: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "polyline" {
			lines++
		}
	}
	if lines != 6 || !strings.Contains(string(b), "budget 262 kB/s") {
		t.Errorf("scale.svg has %d lines (want 6) or no budget:\n%s", lines, b)
	}
}
