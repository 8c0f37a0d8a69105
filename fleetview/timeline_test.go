package fleetview

import (
	"strings"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/state"
)

func TestMain(m *testing.M) { wait.VerifyTestMain(m, testenv.LeakOptions()...) }

// TestTimelineScalesToManyPartitions: a switch of a few partitions gets a
// square per partition; one of hundreds, or one whose partitions are kept
// in history/partitions/ chunks, a bar split by translation method, as
// wide as each method's share. Nothing is drawn past the timeline's width.
func TestTimelineScalesToManyPartitions(t *testing.T) {
	at := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	ev := func(epoch int64, n int) state.SwitchEvent {
		e := state.SwitchEvent{Epoch: epoch, From: "A", To: "B", Started: at, Finished: at.Add(time.Second),
			Phases: map[string]float64{"revoke": 0.2, "translate": 0.7, "activate": 0.1}}
		for p := range n {
			method := "fingerprint"
			if p%4 == 3 {
				method = "timestamp"
			}
			e.Partitions = append(e.Partitions, state.PartitionSwitch{Topic: "orders", Partition: int32(p), Method: method})
		}
		return e
	}
	chunked := ev(4, 0)
	chunked.PartitionChunks, chunked.PartitionCount = 8, 8000
	chunked.Methods = map[string]int{"fingerprint": 6000, "checkpoint": 2000}
	tl := timeline([]state.SwitchEvent{ev(2, 12), ev(3, 600), chunked})

	for _, row := range tl.Rows {
		for _, r := range append(row.Phases, row.Partitions...) {
			if r.X+r.W > tl.Width {
				t.Errorf("epoch %d: %q drawn to x=%d, past the timeline's width %d", row.Ev.Epoch, r.Title, r.X+r.W, tl.Width)
			}
		}
	}
	type part struct {
		class string
		w     int
	}
	drawn := func(i int) (ps []part) {
		for _, r := range tl.Rows[i].Partitions {
			ps = append(ps, part{r.Class, r.W})
		}
		return ps
	}
	if ps := drawn(0); len(ps) != 12 || ps[3].class != "m-timestamp" || ps[0].class != "m-fingerprint" {
		t.Errorf("12 partitions drawn as %v, want a square each, by method", ps)
	}
	// 600: 450 by fingerprint, 150 by timestamp, in the bar's 300 units.
	if ps := drawn(1); len(ps) != 2 || ps[0] != (part{"m-fingerprint", 225}) || ps[1] != (part{"m-timestamp", 75}) {
		t.Errorf("600 partitions drawn as %v, want a bar of fingerprint 225 and timestamp 75", ps)
	}
	if note := tl.Rows[1].Note; !strings.Contains(note, "600 partitions: 450 by fingerprint, 150 by timestamp") {
		t.Errorf("600 partitions noted %q, want the counts by method", note)
	}
	if ps := drawn(2); len(ps) != 2 || ps[0] != (part{"m-checkpoint", 75}) || ps[1] != (part{"m-fingerprint", 225}) {
		t.Errorf("8000 partitions in chunks drawn as %v, want a bar of checkpoint 75 and fingerprint 225", ps)
	}
	if note := tl.Rows[2].Note; !strings.Contains(note, "8000 partitions (in history/partitions/): 2000 by checkpoint, 6000 by fingerprint") {
		t.Errorf("8000 partitions in chunks noted %q", note)
	}
	var legend []string
	for _, m := range tl.Methods {
		legend = append(legend, m.Name)
	}
	if strings.Join(legend, ",") != "checkpoint,fingerprint,timestamp" {
		t.Errorf("the legend names %v, want every method drawn", legend)
	}
}
