package agent

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kswitch/kswitch/state"
)

func pcpart(p int32) cpart {
	return cpart{Cluster: "A", TopicPartition: state.TopicPartition{Topic: "orders", Partition: p}}
}

// TestPacerKeepsTheShareWhateverThePartitionCount: an agent with 10, 100
// or 5 000 busy partitions, each position 300 bytes, committing every
// 200 ms for a simulated minute or two rounds of its partitions, writes at
// most its share per second (one bucket of burst beyond), and every
// partition is committed, at intervals that grow with the partitions:
// none starves.
func TestPacerKeepsTheShareWhateverThePartitionCount(t *testing.T) {
	const (
		each     = 300
		interval = 200 * time.Millisecond
		fleet    = 64 * 1024 // bytes/s for the fleet
	)
	for _, n := range []int{10, 100, 5_000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			p := commitPacer{interval: interval}
			// Two agents of equal share: this one owns half.
			p.share(fleet, n, 2*n)
			if p.rate != fleet/2 {
				t.Fatalf("share of half the partitions = %v B/s, want %v", p.rate, fleet/2)
			}
			span := max(time.Minute, 2*time.Duration(float64(n*each)/p.rate*float64(time.Second)))
			last := map[cpart]time.Time{}
			longest := time.Duration(0)
			start := time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
			written := 0
			for now := start; now.Before(start.Add(span)); now = now.Add(interval) {
				due := make([]dueCommit, n) // every partition busy
				for i := range due {
					due[i] = dueCommit{part: pcpart(int32(i)), last: last[pcpart(int32(i))]}
				}
				tps, waiting := pick(due, p.refill(now), each)
				if len(tps)+waiting != n {
					t.Fatalf("pick returned %d and %d waiting of %d", len(tps), waiting, n)
				}
				for _, cp := range tps {
					if l, ok := last[cp]; ok {
						longest = max(longest, now.Sub(l))
					}
					last[cp] = now
				}
				p.charge(int64(len(tps) * each))
				written += len(tps) * each
			}
			bound := p.rate*span.Seconds() + p.bucket() + each
			if float64(written) > bound {
				t.Errorf("%d partitions: wrote %d bytes in %v, more than the share's %.0f", n, written, span, bound)
			}
			if len(last) != n {
				t.Errorf("%d partitions: only %d were ever committed", n, len(last))
			}
			// Round robin: a partition waits for all the others, at the
			// share's rate, and at least an interval.
			want := max(interval, time.Duration(float64(n*each)/p.rate*float64(time.Second))+interval)
			if longest > want {
				t.Errorf("%d partitions: a position waited %v between commits, want <= %v", n, longest, want)
			}
			t.Logf("%d partitions: %.0f B/s (share %.0f), longest wait between commits %v", n, float64(written)/span.Seconds(), p.rate, longest)
		})
	}
}

// TestPacerUnboundedCommitsEverything: without a budget every changed
// position is committed every tick.
func TestPacerUnboundedCommitsEverything(t *testing.T) {
	t.Parallel()
	p := commitPacer{interval: time.Second}
	p.share(0, 3, 10)
	due := []dueCommit{{part: pcpart(2)}, {part: pcpart(0)}, {part: pcpart(1)}}
	tps, waiting := pick(due, p.refill(time.Now()), 300)
	if waiting != 0 || !slices.Equal(tps, []cpart{pcpart(0), pcpart(1), pcpart(2)}) {
		t.Fatalf("pick without a budget = %v, %d waiting", tps, waiting)
	}
	if !math.IsInf(p.refill(time.Now()), 1) {
		t.Fatal("an unbounded pacer has a finite bucket")
	}
}

// TestPacerOrder: the never-committed first, then the longest
// uncommitted; a final commit that overdraws the bucket holds periodic
// commits until it is repaid, and the agent that owns nothing keeps a
// sliver for its releases.
func TestPacerOrder(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
	due := []dueCommit{
		{part: pcpart(0), last: t0.Add(2 * time.Second)},
		{part: pcpart(1), last: t0},
		{part: pcpart(2)},
		{part: pcpart(3), last: t0.Add(time.Second)},
	}
	tps, waiting := pick(due, 550, 300)
	if waiting != 2 || !slices.Equal(tps, []cpart{pcpart(2), pcpart(1)}) {
		t.Fatalf("pick of 2 = %v, %d waiting; want the never committed, then the oldest", tps, waiting)
	}
	if tps, _ := pick(due, 10, 300); len(tps) != 1 {
		t.Fatalf("a positive bucket smaller than a position let %d through, want 1", len(tps))
	}

	p := commitPacer{interval: time.Second}
	p.share(1000, 1, 1)
	p.refill(t0)
	p.charge(3000) // a release of 10 partitions
	if avail := p.refill(t0.Add(time.Second)); avail >= 0 {
		t.Fatalf("a second after overdrawing by 2000 B at 1000 B/s: %v available, want < 0", avail)
	}
	if tps, waiting := pick(due, p.refill(t0.Add(time.Second)), 300); len(tps) != 0 || waiting != 4 {
		t.Fatalf("an overdrawn bucket let %v through", tps)
	}
	if avail := p.refill(t0.Add(2 * time.Second)); avail != 0 {
		t.Fatalf("repaid after 2 s: %v available, want 0", avail)
	}
	if avail := p.refill(t0.Add(10 * time.Second)); avail != p.bucket() {
		t.Fatalf("after a long idle: %v available, want the bucket %v", avail, p.bucket())
	}
	p.share(1000, 0, 100)
	if p.rate != 10 {
		t.Fatalf("share of an agent that owns nothing = %v, want one partition's (10)", p.rate)
	}
}
