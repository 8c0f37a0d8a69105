package routing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
)

// The ordinary accidents of a sink: an outage, a record no topic takes,
// and readiness that must say when records go nowhere.

// partitionFeed offers the records of n source partitions of topic
// "orders" to r as the agent does: each partition in offset order, a
// record offered again until the router takes it.
type partitionFeed struct {
	mu     sync.Mutex
	taken  []int64 // by partition: records taken
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func feed(r *Router, n int, pace time.Duration, value func(p int32, off int64) string) *partitionFeed {
	ctx, cancel := context.WithCancel(context.Background())
	f := &partitionFeed{taken: make([]int64, n), cancel: cancel}
	for p := range n {
		f.wg.Go(func() {
			for off := int64(0); ctx.Err() == nil; off++ {
				v := ""
				if value != nil {
					v = value(int32(p), off)
				}
				if deliver(ctx, r, testRecord("orders", int32(p), off, v), time.Hour) != nil {
					return
				}
				f.mu.Lock()
				f.taken[p] = off + 1
				f.mu.Unlock()
				time.Sleep(pace)
			}
		})
	}
	return f
}

func (f *partitionFeed) stop() []int64 {
	f.cancel()
	f.wg.Wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]int64(nil), f.taken...)
}

func (f *partitionFeed) total() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var n int64
	for _, t := range f.taken {
		n += t
	}
	return n
}

// readAll reads topic on cluster from its start until it holds every
// value of want (values may repeat), for at most 20 s.
func (w *world) readAll(cluster, topic string, want map[string]bool) []*kgo.Record {
	w.t.Helper()
	cl := w.consumer(cluster, topic)
	defer cl.Close()
	var out []*kgo.Record
	missing := len(want)
	seen := map[string]bool{}
	ctx, cancel := context.WithTimeout(w.t.Context(), 20*time.Second)
	defer cancel()
	for missing > 0 {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			w.t.Fatalf("%s/%s: %d of %d records after 20s", cluster, topic, len(want)-missing, len(want))
		}
		fs.EachRecord(func(r *kgo.Record) {
			out = append(out, r)
			if v := string(r.Value); want[v] && !seen[v] {
				seen[v] = true
				missing--
			}
		})
	}
	return out
}

// sourceOffset returns the offset of a record whose value is
// "orders/<p>@<offset>".
func sourceOffset(t *testing.T, v []byte) int64 {
	_, o, ok := strings.Cut(string(v), "@")
	n, err := strconv.ParseInt(o, 10, 64)
	if !ok || err != nil {
		t.Fatalf("value %q is not a source record's", v)
	}
	return n
}

// orderedWorld starts a router that sends records of "orders" to channel
// c on cluster C, partition for partition (extra channels and settings
// from more), and feeds it three source partitions until 150 records are
// acknowledged.
func orderedWorld(t *testing.T, topics []string, more func(*Config)) (*world, *Router, *partitionFeed) {
	w := newWorld(t, map[string][]string{"C": append([]string{"c"}, topics...)}, "A", "C")
	w.cfg.Routing = Config{
		Rules:    []Rule{{Name: "all", Channels: []string{"c"}}},
		Channels: map[string]Channel{"c": {Cluster: "C", Topic: "c", Partitioner: PartitionerManual}},
	}
	if more != nil {
		more(&w.cfg.Routing)
	}
	r := w.start(nil)
	f := feed(r, 3, 2*time.Millisecond, nil)
	t.Cleanup(func() { f.stop() })
	wait.For(t, 10*time.Second, "records flowing", func() error {
		if n := w.acks.count("orders/"); n < 150 {
			return fmt.Errorf("%d acknowledged", n)
		}
		return nil
	})
	return w, r, f
}

// settled stops f, waits until every record it fed is acknowledged and
// returns their values (but the ones skip names) and count.
func (w *world) settled(f *partitionFeed, skip func(p int, off int64) bool) (map[string]bool, int) {
	w.t.Helper()
	want := map[string]bool{}
	var n int
	for p, t := range f.stop() {
		n += int(t)
		for off := range t {
			if skip == nil || !skip(p, off) {
				want[fmt.Sprintf("orders/%d@%d", p, off)] = true
			}
		}
	}
	wait.For(w.t, 30*time.Second, "every record taken acknowledged", func() error {
		if got := w.acks.count("orders/"); got < n {
			return fmt.Errorf("%d of %d", got, n)
		}
		return nil
	})
	return want, n
}

// waitFailing waits until r reports channel name failing.
func waitFailing(t *testing.T, r *Router, name string) {
	t.Helper()
	wait.For(t, 30*time.Second, "channel "+name+" failing", func() error {
		for _, cs := range r.Status().Channels {
			if cs.Name == name && cs.Failing != "" {
				return nil
			}
		}
		return errors.New("not failing")
	})
}

// orderAfterRecovery waits until 300 records more than before are taken
// (C is back), settles f, reads channel c back and returns how many
// records reached it after a later one of their partition, and how many
// the router counted so.
func (w *world) orderAfterRecovery(r *Router, f *partitionFeed, label string) (late int, counted float64) {
	t := w.t
	t.Helper()
	before := f.total()
	wait.For(t, 60*time.Second, "records flowing again", func() error {
		if n := f.total(); n < before+300 {
			return fmt.Errorf("%d taken since the recovery", n-before)
		}
		return nil
	})
	want, n := w.settled(f, nil)
	recs := w.readAll("C", "c", want)
	dups, late := orderOf(t, recs)
	counted = metricValue(r.m.reordered)
	t.Logf("%s: %d records taken, %d on C (%d duplicates, %d after a later one of their partition; kswitch_routing_reordered_total %v)",
		label, n, len(recs), dups, late, counted)
	return late, counted
}

// orderOf counts, in records of channel partitions that mirror their
// source partitions, the duplicates and the records that reached the
// channel after a later record of their partition (first copies only).
func orderOf(t *testing.T, recs []*kgo.Record) (dups, late int) {
	t.Helper()
	seen := map[string]bool{}
	last := map[int32]int64{}
	for _, rec := range recs {
		if seen[string(rec.Value)] {
			dups++
			continue
		}
		seen[string(rec.Value)] = true
		off := sourceOffset(t, rec.Value)
		if prev, ok := last[rec.Partition]; ok && off < prev {
			late++
			t.Logf("partition %d: %s reached the channel after offset %d", rec.Partition, rec.Value, prev)
		}
		last[rec.Partition] = max(last[rec.Partition], off)
	}
	return dups, late
}

// requireCounted fails t when r produced a record behind an earlier held
// record of its partition (never, by design), or when more records came
// late than r counted as overtaken in its producer
// (kswitch_routing_reordered_total).
func requireCounted(t *testing.T, r *Router, late int) {
	t.Helper()
	if b := r.breaches.Load(); b != 0 {
		t.Errorf("the router produced %d records behind an earlier held record of their partition", b)
	}
	if counted := metricValue(r.m.reordered); float64(late) > counted {
		t.Errorf("%d records reached the channel after a later one of their partition, %v counted", late, counted)
	}
}

// requireInOrder fails t when a record reached its channel after a later
// one of its partition, or the router counted one so
// (kswitch_routing_reordered_total): the producer retries in place,
// splits a batch too large itself and gives back only what is refused for
// good, so nothing may come late.
func requireInOrder(t *testing.T, r *Router, late int) {
	t.Helper()
	if counted := metricValue(r.m.reordered); late > 0 || counted > 0 {
		t.Errorf("%d records reached the channel after a later one of their partition, %v counted", late, counted)
	}
}

// adminOf returns a sarama cluster admin of k, closed when the test ends.
func adminOf(t *testing.T, k *devstack.Kafka) sarama.ClusterAdmin {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	admin, err := sarama.NewClusterAdmin(k.Brokers(), sc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	return admin
}

// TestSinkOutageKeepsSourceOrder: records of one source partition reach
// their channel in source order through an outage of the channel's
// cluster, whether it refuses connections or swallows requests. Before
// the held produces were sent again in order, new records flowed from the
// first success on while earlier failed ones waited out their backoffs:
// records landed after later ones of their partition.
func TestSinkOutageKeepsSourceOrder(t *testing.T) {
	t.Parallel()
	for _, fault := range []string{"fail", "hang"} {
		t.Run(fault, func(t *testing.T) {
			w, r, f := orderedWorld(t, nil, nil)
			c := w.kafkas["C"]
			if fault == "fail" {
				c.Fail()
			} else {
				c.Hang()
			}
			waitFailing(t, r, "c")
			time.Sleep(3 * time.Second) // the outage: C stays down while records wait
			c.Recover()
			late, counted := w.orderAfterRecovery(r, f, fault)
			// The producer keeps a partition's order through its retries:
			// nothing comes late, counted or not.
			requireCounted(t, r, late)
			if late > 0 || counted > 0 {
				t.Errorf("%d records reached the channel after a later one of their partition (%v counted by the router)", late, counted)
			}
		})
	}
}

// TestRecordNoTopicTakes: a record larger than the channel and the
// dead-letter channel accept (the producer's 1 MB limit) does not stop
// its partition: the dead-letter channel gets a reference to it, its
// position moves on, and the records behind it flow in order. With
// routing.refused: block the partition stops and readiness says why.
// Before, it was sent again forever and its partition froze.
func TestRecordNoTopicTakes(t *testing.T) {
	t.Parallel()
	const big = 2 << 20
	for _, policy := range []string{"", RefusedBlock} {
		t.Run("policy="+cmp.Or(policy, "default"), func(t *testing.T) {
			w := newWorld(t, map[string][]string{"C": {"c", "dead"}}, "A", "C")
			w.cfg.Routing = Config{
				Rules:      []Rule{{Name: "all", Channels: []string{"c"}}},
				Channels:   map[string]Channel{"c": {Cluster: "C", Topic: "c", Partitioner: PartitionerManual}, "dead": {Cluster: "C", Topic: "dead"}},
				DeadLetter: "dead",
				Refused:    policy,
			}
			r := w.start(nil)
			huge := testRecord("orders", 0, 0, strings.Repeat("x", big))
			huge.Headers = []record.Header{{Key: []byte("trace"), Value: []byte("t-1")}}
			w.handle(huge, 10*time.Second)
			next := testRecord("orders", 0, 1, "")
			if policy == RefusedBlock {
				wait.For(t, 20*time.Second, "partition 0 blocked", func() error {
					if r.nblock.Load() == 0 {
						return errors.New("not blocked")
					}
					return nil
				})
				var we *WaitError
				if err := r.Handle(t.Context(), next); !errors.As(err, &we) || we.Reason != "blocked" {
					t.Fatalf("Handle of the next record = %v, want it blocked", err)
				}
				if p := r.DeliveryProblem(time.Minute); !strings.Contains(p, "partition orders/0 of cluster A stopped at a record refused for good") {
					t.Errorf("DeliveryProblem = %q", p)
				}
				if w.acks.has(huge) {
					t.Error("the refused record was acknowledged under routing.refused: block")
				}
				w.unackedOnClose = true // the blocked record, consumed again by the next owner
				return
			}
			w.handle(next, 10*time.Second)
			wait.For(t, 20*time.Second, "the refused record and the next acknowledged", func() error {
				if !w.acks.has(huge) || !w.acks.has(next) {
					return fmt.Errorf("huge %v, next %v", w.acks.has(huge), w.acks.has(next))
				}
				return nil
			})
			ref := w.read("C", "dead", 1)[0]
			if len(ref.Value) != refValueMax || string(ref.Value) != strings.Repeat("x", refValueMax) {
				t.Errorf("reference value: %d bytes", len(ref.Value))
			}
			for k, want := range map[string]string{HeaderSize: strconv.Itoa(big), HeaderTruncated: "true", HeaderSource: "orders/0@0",
				HeaderSourceCluster: "A", HeaderRule: "all", "trace": "t-1"} {
				if got := header(ref, k); got != want {
					t.Errorf("reference header %s = %q, want %q", k, got, want)
				}
			}
			// The producer sends it, alone, and the broker refuses it.
			refusal := sarama.ErrMessageSizeTooLarge.Error()
			if e := header(ref, HeaderError); !strings.Contains(e, refusal) {
				t.Errorf("reference header %s = %q, want the refusal (%q)", HeaderError, e, refusal)
			}
			if got := w.read("C", "c", 1); string(got[0].Value) != "orders/0@1" {
				t.Errorf("channel c holds %q first, want orders/0@1", got[0].Value)
			}
			for reason, want := range map[string]float64{"reference": 1, "produce": 0, "dropped": 0} {
				if got := metricValue(r.m.dead.WithLabelValues(reason)); got != want {
					t.Errorf("dead_lettered{%s} = %v, want %v", reason, got, want)
				}
			}
			if p := r.DeliveryProblem(time.Minute); p != "" {
				t.Errorf("DeliveryProblem = %q after the reference", p)
			}
		})
	}
}

// TestDeliveryProblemSaysWhereRecordsGo: the router tells readiness when
// every record goes to the dead-letter channel, and when a channel takes
// nothing while records wait for it, with the cause; and stops telling
// once records flow again.
func TestDeliveryProblemSaysWhereRecordsGo(t *testing.T) {
	t.Parallel()
	const after = time.Second
	w := newWorld(t, map[string][]string{"C": {"c", "dead"}}, "A", "C")
	w.cfg.Routing = Config{
		// int(value) fails on every record whose value is not a number.
		Rules:      []Rule{{Name: "numbers", Match: `int(value) >= 0`, Channels: []string{"c"}}},
		Channels:   map[string]Channel{"c": {Cluster: "C", Topic: "c"}, "dead": {Cluster: "C", Topic: "dead"}},
		DeadLetter: "dead",
	}
	r := w.start(nil)
	numbers := false
	var mu sync.Mutex
	f := feed(r, 2, 5*time.Millisecond, func(p int32, off int64) string {
		mu.Lock()
		defer mu.Unlock()
		if numbers {
			return strconv.FormatInt(off, 10)
		}
		return fmt.Sprintf("orders/%d@%d", p, off)
	})
	defer f.stop()
	wait.For(t, 20*time.Second, "the dead-letter run reported", func() error {
		if p := r.DeliveryProblem(after); !strings.Contains(p, "went to the dead-letter channel, none to a channel") || !strings.Contains(p, "rule numbers") {
			return fmt.Errorf("DeliveryProblem = %q", p)
		}
		return nil
	})
	if v := gathered(t, w, "kswitch_routing_dead_letter_run_seconds", ""); v < 1 {
		t.Errorf("kswitch_routing_dead_letter_run_seconds = %v during the run", v)
	}
	mu.Lock()
	numbers = true
	mu.Unlock()
	wait.For(t, 20*time.Second, "records reach c: no problem", func() error {
		if p := r.DeliveryProblem(after); p != "" {
			return fmt.Errorf("DeliveryProblem = %q", p)
		}
		return nil
	})
	w.kafkas["C"].Fail()
	wait.For(t, 30*time.Second, "the stalled channel reported", func() error {
		if p := r.DeliveryProblem(after); !strings.Contains(p, "channel c (C/c) has acknowledged no record for") {
			return fmt.Errorf("DeliveryProblem = %q", p)
		}
		return nil
	})
	if v := gathered(t, w, "kswitch_routing_channel_stalled_seconds", "c"); v < 1 {
		t.Errorf("kswitch_routing_channel_stalled_seconds{channel=c} = %v while c took nothing", v)
	}
	w.kafkas["C"].Recover()
	wait.For(t, 30*time.Second, "no problem once c takes records again", func() error {
		if p := r.DeliveryProblem(after); p != "" {
			return fmt.Errorf("DeliveryProblem = %q", p)
		}
		return nil
	})
}

// gathered returns the value of gauge name (of channel, when set) in w's
// registry, or -1.
func gathered(t *testing.T, w *world, name, channel string) float64 {
	t.Helper()
	mfs, err := w.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if channel == "" {
				return m.GetGauge().GetValue()
			}
			for _, l := range m.GetLabel() {
				if l.GetName() == "channel" && l.GetValue() == channel {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}

// TestChannelTopicRecreated: a channel's topic deleted on its cluster and
// created again holds up the channel's records while it is gone; once it
// is back they reach it and nothing waits for good.
func TestChannelTopicRecreated(t *testing.T) {
	t.Parallel()
	w, r, f := orderedWorld(t, nil, nil)
	admin := adminOf(t, w.kafkas["C"])
	if err := admin.DeleteTopic("c"); err != nil {
		t.Fatal(err)
	}
	deleted := f.total()
	wait.For(t, 10*time.Second, "c deleted", func() error {
		if ts, err := admin.ListTopics(); err != nil || ts["c"].NumPartitions > 0 {
			return fmt.Errorf("still listed (%v)", err)
		}
		return nil
	})
	if err := w.kafkas["C"].CreateTopic("c", 3); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 60*time.Second, "records flowing into the new topic", func() error {
		if n := f.total(); n < deleted+300 {
			return fmt.Errorf("%d taken since the topic was deleted", n-deleted)
		}
		return nil
	})
	// The new topic holds at least each partition's last record, and
	// what was acknowledged after it was created. The producer's sequence
	// numbers run on from the deleted topic's: the new topic refuses the
	// first batch (out of order sequence), which is sent again after what
	// the producer held behind it, counted.
	all, n := w.settled(f, nil)
	lastOf := map[string]int64{}
	for v := range all {
		p, _, _ := strings.Cut(v, "@")
		lastOf[p] = max(lastOf[p], sourceOffset(t, []byte(v)))
	}
	want := map[string]bool{}
	for p, off := range lastOf {
		want[fmt.Sprintf("%s@%d", p, off)] = true
	}
	recs := w.readAll("C", "c", want)
	_, late := orderOf(t, recs)
	requireCounted(t, r, late)
	requireInOrder(t, r, late)
	t.Logf("%d records taken, %d in the re-created topic, %d after a later one of their partition (counted %v)", n, len(recs), late, metricValue(r.m.reordered))
}

// TestBatchWithARecordTooLargeForTheTopic: the channel's broker refuses a
// batch holding one record larger than the topic takes (max.message.bytes),
// every record of the batch with the same error. Only that record is
// judged too large: the others reach the channel, in order, and the
// dead-letter channel (as small) gets a reference to the large one alone.
// Before, every record of the batch was dead-lettered, or dropped when
// their dead letters were refused in a batch too.
func TestBatchWithARecordTooLargeForTheTopic(t *testing.T) {
	t.Parallel()
	const limit, big, bigAt = 100_000, 300_000, 300
	w := newWorld(t, map[string][]string{"C": {"c", "dead"}}, "A", "C")
	admin := adminOf(t, w.kafkas["C"])
	for _, topic := range []string{"c", "dead"} {
		v := strconv.Itoa(limit)
		if err := admin.AlterConfig(sarama.TopicResource, topic, map[string]*string{"max.message.bytes": &v}, false); err != nil {
			t.Fatal(err)
		}
	}
	w.cfg.Routing = Config{
		Rules:      []Rule{{Name: "all", Channels: []string{"c"}}},
		Channels:   map[string]Channel{"c": {Cluster: "C", Topic: "c", Partitioner: PartitionerManual}, "dead": {Cluster: "C", Topic: "dead"}},
		DeadLetter: "dead",
	}
	r := w.start(nil)
	f := feed(r, 2, 0, func(p int32, off int64) string {
		if p == 0 && off == bigAt {
			return strings.Repeat("x", big)
		}
		return ""
	})
	wait.For(t, 30*time.Second, "records past the large one", func() error {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.taken[0] < bigAt+500 {
			return fmt.Errorf("partition 0 took %d", f.taken[0])
		}
		return nil
	})
	want, n := w.settled(f, func(p int, off int64) bool { return p == 0 && off == bigAt })
	// The producer splits the refused batch itself and refuses only the
	// large record: nothing reaches the channel late.
	_, late := orderOf(t, w.readAll("C", "c", want))
	requireCounted(t, r, late)
	requireInOrder(t, r, late)
	dead := w.read("C", "dead", 1)
	if len(dead) != 1 || header(dead[0], HeaderSource) != fmt.Sprintf("orders/0@%d", bigAt) || header(dead[0], HeaderSize) != strconv.Itoa(big) {
		for _, d := range dead {
			t.Errorf("dead letter from %s, size %s", header(d, HeaderSource), header(d, HeaderSize))
		}
	}
	for reason, want := range map[string]float64{"reference": 1, "produce": 0, "dropped": 0} {
		if got := metricValue(r.m.dead.WithLabelValues(reason)); got != want {
			t.Errorf("dead_lettered{%s} = %v, want %v", reason, got, want)
		}
	}
	t.Logf("%d records taken, 0 lost; the %d-byte record went to the dead-letter channel as a reference; %d reached c after a later one of their partition (kswitch_routing_reordered_total %v)",
		n, big, late, metricValue(r.m.reordered))
}
