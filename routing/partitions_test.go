package routing

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// timedFeed offers records of one source topic to a router, a goroutine
// per source partition, as the agent does (again after an error), and
// times every Handle call.
type timedFeed struct {
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	mu      sync.Mutex
	taken   []int64
	calls   int
	longest time.Duration
}

func feedTimed(r *Router, topic string, n int, pace time.Duration) *timedFeed {
	ctx, cancel := context.WithCancel(context.Background())
	f := &timedFeed{taken: make([]int64, n), cancel: cancel}
	for p := range n {
		f.wg.Go(func() {
			for off := int64(0); ; off++ {
				rec := testRecord(topic, int32(p), off, "")
				for {
					start := time.Now()
					err := r.Handle(ctx, rec)
					d := time.Since(start)
					f.mu.Lock()
					f.calls++
					f.longest = max(f.longest, d)
					f.mu.Unlock()
					if err == nil {
						break
					}
					if ctx.Err() != nil {
						return
					}
					time.Sleep(20 * time.Millisecond)
				}
				f.mu.Lock()
				f.taken[p] = off + 1
				f.mu.Unlock()
				if ctx.Err() != nil {
					return
				}
				time.Sleep(pace)
			}
		})
	}
	return f
}

// state returns the Handle calls made, the longest, and the records
// taken so far.
func (f *timedFeed) state() (calls int, longest time.Duration, taken int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, t := range f.taken {
		taken += t
	}
	return f.calls, f.longest, taken
}

func (f *timedFeed) stop() []int64 {
	f.cancel()
	f.wg.Wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]int64(nil), f.taken...)
}

// TestUnknownTopicOnAHungClusterDoesNotBlockHandle: channel d's topic is
// created after the cluster's producer opened, so the producer has never seen it, and the
// cluster hangs. Handle never waits on the network for the topic's
// partition count: the count is looked up by the producer in the
// background, the first records are held and the channel is failing, so
// every call returns at once (a metadata request on the hung cluster
// would take the client's 5 s timeout). Once the cluster answers again
// the count is known, the held records are sent, and every record
// reaches the channel once, in order per partition.
func TestUnknownTopicOnAHungClusterDoesNotBlockHandle(t *testing.T) {
	t.Parallel()
	w, r, f := orderedWorld(t, nil, func(c *Config) {
		c.Rules[0].Match = `topic == "orders"`
		c.Rules = append(c.Rules, Rule{Name: "news", Match: `topic == "news"`, Channels: []string{"d"}})
		c.Channels["d"] = Channel{Cluster: "C", Topic: "d", Partitioner: PartitionerManual}
	})
	c := w.kafkas["C"]
	if err := c.CreateTopic("d", 3); err != nil {
		t.Fatal(err)
	}
	c.Hang()
	news := feedTimed(r, "news", 3, 2*time.Millisecond)
	t.Cleanup(func() { news.stop() })
	wait.For(t, 10*time.Second, "records for d offered while C hangs", func() error {
		if calls, _, _ := news.state(); calls < 60 {
			return fmt.Errorf("%d Handle calls", calls)
		}
		return nil
	})
	waitFailing(t, r, "d")
	calls, longest, taken := news.state()
	t.Logf("while C hangs: %d Handle calls for d, the longest %s, %d records taken (held)", calls, longest, taken)
	c.Recover()
	wait.For(t, 60*time.Second, "records for d flowing again", func() error {
		if _, _, n := news.state(); n < taken+300 {
			return fmt.Errorf("%d taken since the recovery", n-taken)
		}
		return nil
	})
	want := map[string]bool{}
	var n int
	for p, t := range news.stop() {
		n += int(t)
		for off := range t {
			want[fmt.Sprintf("news/%d@%d", p, off)] = true
		}
	}
	wait.For(t, 30*time.Second, "every record for d acknowledged", func() error {
		if got := w.acks.count("news/"); got < n {
			return fmt.Errorf("%d of %d", got, n)
		}
		return nil
	})
	recs := w.readAll("C", "d", want)
	dups, late := orderOf(t, recs)
	calls, longest, _ = news.state()
	t.Logf("d: %d records taken, %d on C (%d duplicates, %d late); %d Handle calls, the longest %s", n, len(recs), dups, late, calls, longest)
	if dups > 0 || late > 0 || len(recs) != n {
		t.Errorf("channel d holds %d records for %d taken: %d duplicates, %d after a later one of their partition", len(recs), n, dups, late)
	}
	// No network wait: a lock and a map look-up, on 2 loaded cores with
	// -race; the metadata request it replaced waited up to 5 s here.
	if longest > time.Second {
		t.Errorf("the longest Handle call took %s, want under 1 s", longest)
	}
	late, _ = w.orderAfterRecovery(r, f, "orders")
	requireCounted(t, r, late)
	requireInOrder(t, r, late)
}
