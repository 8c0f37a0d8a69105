//go:build integration && bench

package integration

import (
	"fmt"
	"html"
	"os"
	"path/filepath"
	"strings"
)

// The charts BENCHMARKS.md shows, written beside it as SVG by hand-made
// plain markup (no dependency): a bar per relay for throughput, and a
// stacked timeline per failover trial.

// chartRow is one bar of the throughput chart.
type chartRow struct {
	label  string
	median float64
	min    float64
	max    float64
	self   bool // kswitch's own bar
}

// throughputSVG draws the median records/s of each relay (20 → 80 %),
// with its range as a whisker.
func throughputSVG(r *benchResults) string {
	var rows []chartRow
	for _, x := range []struct {
		relay     string
		instances int
		label     string
	}{
		{"kswitch", 1, "kswitch, 1 agent"},
		{kswitchExactlyOnce, 1, "kswitch, exactly_once"},
		{"relayloop", 1, "sarama loop, 1"},
		{"franzloop", 1, "franz-go loop (tuned), 1"},
		{"kcat", 1, "kcat -C | kcat -P"},
		{"mirrormaker2", 1, "MirrorMaker 2"},
		{"kswitch", 3, "kswitch, 3 agents"},
		{"relayloop", 3, "sarama loop, 3"},
	} {
		s := statsOf(r.relayRate(x.relay, x.instances))
		if s.N == 0 {
			continue
		}
		rows = append(rows, chartRow{x.label, s.Median, s.Min, s.Max, strings.HasPrefix(x.relay, "kswitch")})
	}
	top := 0.0
	for _, row := range rows {
		top = max(top, row.max)
	}
	if top == 0 {
		return ""
	}
	const left, width, barH, gap = 190, 440, 22, 10
	height := 40 + len(rows)*(barH+gap)
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", left+width+90, height)
	fmt.Fprintf(&b, `<text x="4" y="16" font-weight="bold">Relay throughput, records/s (median, range of trials; 20 → 80 %% of the copy)</text>`+"\n")
	for i, row := range rows {
		y := 30 + i*(barH+gap)
		w := row.median / top * width
		fill := "#8da0cb"
		if row.self {
			fill = "#1b7837"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-6, y+barH/2+4, html.EscapeString(row.label))
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", left, y, w, barH, fill)
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#333"/>`+"\n", left+row.min/top*width, left+row.max/top*width, y+barH/2, y+barH/2)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d">%.0f</text>`+"\n", left+row.max/top*width+6, y+barH/2+4, row.median)
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// failoverSVG draws each failover trial as a timeline from the SIGKILL of
// A's broker: detection, the switch's phases, and the restart until the
// first record from B.
func failoverSVG(r *benchResults) string {
	if len(r.Failover) == 0 {
		return ""
	}
	top := 0.0
	for _, x := range r.Failover {
		top = max(top, x.FirstRecordSeconds)
	}
	if top == 0 {
		return ""
	}
	const left, width, barH, gap = 110, 520, 18, 8
	height := 70 + len(r.Failover)*(barH+gap)
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", left+width+70, height)
	fmt.Fprintf(&b, `<text x="4" y="16" font-weight="bold">Failover: seconds after A's broker is killed (or hung), until the first record from B</text>`+"\n")
	type seg struct {
		name, color string
	}
	segs := []seg{{"detection", "#fdb863"}, {"revoke", "#b2abd2"}, {"translate", "#5e3c99"}, {"activate", "#e66101"}, {"restart", "#1b7837"}}
	for i, s := range segs {
		x := left + i*105
		fmt.Fprintf(&b, `<rect x="%d" y="26" width="12" height="12" fill="%s"/><text x="%d" y="36">%s</text>`+"\n", x, s.color, x+16, s.name)
	}
	px := func(sec float64) float64 { return sec / top * width }
	for i, x := range r.Failover {
		y := 50 + i*(barH+gap)
		label := fmt.Sprintf("trial %d", x.Trial)
		if x.hung() {
			label += ", hung"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-6, y+barH/2+4, label)
		parts := []float64{x.DetectedSeconds, x.Phases["revoke"], x.Phases["translate"], x.Phases["activate"], x.FirstRecordSeconds - x.ActiveSeconds}
		at := 0.0
		for j, d := range parts {
			if d <= 0 {
				continue
			}
			fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s"><title>%s %.3f s</title></rect>`+"\n",
				float64(left)+px(at), y, max(px(d), 1), barH, segs[j].color, segs[j].name, d)
			at += d
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%d">%.2f s</text>`+"\n", float64(left)+px(x.FirstRecordSeconds)+6, y+barH/2+4, x.FirstRecordSeconds)
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// writeCharts writes throughput.svg and failover.svg into dir.
func writeCharts(dir string, r *benchResults) error {
	for name, svg := range map[string]string{"throughput.svg": throughputSVG(r), "failover.svg": failoverSVG(r)} {
		if svg == "" {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(svg), 0o644); err != nil {
			return err
		}
	}
	return nil
}
