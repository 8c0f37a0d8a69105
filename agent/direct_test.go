package agent_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/record"
	"github.com/kswitch/kswitch/state"
)

// The tests of the Fetcher's path into the agent (docs/RELAY.md §2, §7
// step 3) that the rest of the suite does not cover.

// partitionLog is a handler that acknowledges at once and records the
// offsets handled by partition.
type partitionLog struct {
	mu      sync.Mutex
	offsets map[int32][]int64
}

func (l *partitionLog) handler() record.Handler {
	return record.HandlerFunc(func(_ context.Context, r *record.Record) error {
		l.mu.Lock()
		if l.offsets == nil {
			l.offsets = map[int32][]int64{}
		}
		l.offsets[r.Partition] = append(l.offsets[r.Partition], r.Offset)
		l.mu.Unlock()
		r.Ack()
		return nil
	})
}

// handled returns the distinct offsets handled of partition p.
func (l *partitionLog) handled(p int32) map[int64]bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := map[int64]bool{}
	for _, o := range l.offsets[p] {
		seen[o] = true
	}
	return seen
}

// produceCounted writes n records keyed 0..n-1 to topic and returns how
// many each partition got.
func produceCounted(t *testing.T, k *devstack.Kafka, topic string, n int) map[int32]int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	recs := make([]*kgo.Record, n)
	for i := range recs {
		recs[i] = &kgo.Record{Key: []byte(strconv.Itoa(i)), Value: []byte("v" + strconv.Itoa(i))}
	}
	res := cl.ProduceSync(t.Context(), recs...)
	if err := res.FirstErr(); err != nil {
		t.Fatal(err)
	}
	per := map[int32]int64{}
	for _, r := range res {
		per[r.Record.Partition]++
	}
	return per
}

// waitHandled waits until partition p's offsets [0, n) were all handled.
func waitHandled(t *testing.T, l *partitionLog, timeout time.Duration, want map[int32]int64, parts ...int32) {
	t.Helper()
	wait.For(t, timeout, fmt.Sprintf("partitions %v handled", parts), func() error {
		for _, p := range parts {
			seen := l.handled(p)
			for o := range want[p] {
				if !seen[o] {
					return fmt.Errorf("partition %d: offset %d of %d not handled", p, o, want[p])
				}
			}
		}
		return nil
	})
}

// TestDirectHungBroker (F5 at the agent's level): one of the source
// cluster's three brokers stops answering fetches. The agent goes on
// delivering the partitions the other brokers lead; the
// fetch that failed is counted in kswitch_consume_errors_total; the
// partitions the hung broker leads are released on a rebalance, and on
// Stop, without waiting for their fetch in flight (a wait would last at
// least Net.ReadTimeout, 5 s); once the broker answers again, every record
// is delivered.
func TestDirectHungBroker(t *testing.T) {
	t.Parallel()
	const parts = 6
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"orders": parts}})
	c := k.Cluster()
	hungNode := c.LeaderFor("orders", 0)
	isHung := map[int32]bool{}
	for p := range int32(parts) {
		isHung[p] = c.LeaderFor("orders", p) == hungNode
	}
	if isHung[parts-1] {
		// kfake places leaders at random: one partition at least is led
		// by another broker.
		if err := c.MoveTopicPartition("orders", parts-1, (hungNode+1)%3); err != nil {
			t.Fatal(err)
		}
		isHung[parts-1] = false
	}
	var hung, others []int32
	all := make([]int32, 0, parts)
	for p := range int32(parts) {
		all = append(all, p)
		if isHung[p] {
			hung = append(hung, p)
		} else {
			others = append(others, p)
		}
	}
	t.Logf("broker %d leads %v", hungNode, hung)

	// releases holds agent-1's releases from the rebalance on (nil
	// before: the releases of the fleet's start are not measured).
	var mu sync.Mutex
	var releases map[int32][]release
	var l partitionLog
	opts := func(id string) agent.Options {
		return agent.Options{Handler: l.handler(), Released: func(o record.Owned) {
			if id == "agent-1" {
				at := time.Now()
				mu.Lock()
				if releases != nil {
					releases[o.Partition] = append(releases[o.Partition], release{Owned: o, at: at})
				}
				mu.Unlock()
			}
		}}
	}
	a1 := startFleetAgent(t, consumeConfig(e, k, "agent-1"), opts("agent-1"))
	waitBalanced(t, parts, a1)
	want := produceCounted(t, k, "orders", 600)
	waitHandled(t, &l, 20*time.Second, want, all...)

	var hang atomic.Bool
	var hanging atomic.Int32
	c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if c.CurrentNode() != hungNode || !hang.Load() {
			return nil, nil, false
		}
		hanging.Add(1)
		return nil, nil, true // never answered
	})
	hang.Store(true)
	wait.For(t, 10*time.Second, "a fetch hung on the broker", func() error {
		if hanging.Load() == 0 {
			return errors.New("none yet")
		}
		return nil
	})
	for p, n := range produceCounted(t, k, "orders", 600) {
		want[p] += n
	}
	// The other brokers' partitions are delivered while the hung one's
	// wait.
	waitHandled(t, &l, 20*time.Second, want, others...)
	// The hung fetch fails after Net.ReadTimeout (5 s), and the agent
	// counts it within a commit tick.
	wait.For(t, 15*time.Second, "the hung fetch counted", func() error {
		if v, _ := metricValue(a1, "kswitch_consume_errors_total", nil); v < 1 {
			return fmt.Errorf("kswitch_consume_errors_total %v", v)
		}
		return nil
	})

	// A rebalance: agent-1 releases some partitions, then Stop all of its
	// others. Each release is timed from what caused it: the generation
	// that revoked it, as published (its own time, read back from etcd's
	// history once agent-1 stopped, so no watcher of the test's races the
	// agent's own), or the Stop.
	mu.Lock()
	releases = map[int32][]release{}
	mu.Unlock()
	a2 := startFleetAgent(t, consumeConfig(e, k, "agent-2"), opts("agent-2"))
	waitBalanced(t, parts, a1, a2)
	stopAt := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := a1.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(stopAt); took > releaseBound {
		t.Errorf("agent-1's Stop with broker %d hung took %v (bound %v)", hungNode, took, releaseBound)
	}
	history := assignmentHistory(t, e)
	mu.Lock()
	got := releases
	releases = nil
	mu.Unlock()
	for _, p := range hung {
		if len(got[p]) == 0 {
			t.Errorf("agent-1 never released partition %d", p)
		}
		for _, r := range got[p] {
			// Published is the leader's wall clock, this process's: a
			// generation is published before any agent can apply it.
			cause, why := stopAt, "agent-1's Stop"
			if g, ok := revokingGeneration(history, "agent-1", r.Owned); ok && g.Published.Before(cause) {
				cause, why = g.Published, fmt.Sprintf("generation %d revoked it", g.Generation)
			}
			switch took := r.at.Sub(cause); {
			case took < 0:
				t.Errorf("partition %d, led by the hung broker, run under generation %d, released %v before %s: nothing had asked agent-1 to give it up",
					p, r.Generation, -took, why)
			case took > releaseBound:
				t.Errorf("partition %d, led by the hung broker, released %v after %s (bound %v)", p, took, why, releaseBound)
			default:
				t.Logf("partition %d, led by the hung broker, released %v after %s", p, took, why)
			}
		}
	}

	hang.Store(false)
	// The fetch in flight times out (Net.ReadTimeout 5 s), agent-2's
	// Fetcher connects again, and everything is delivered.
	waitHandled(t, &l, 30*time.Second, want, all...)
}

// releaseBound bounds a release that waits on no network: the stop of the
// partition, the drain of records the handler acknowledged at once, a
// commit to etcd; below the 5 s of Net.ReadTimeout a wait for a hung
// fetch would take.
const releaseBound = 3 * time.Second

// release is a partition an agent gave up (Options.Released) and when.
type release struct {
	record.Owned
	at time.Time
}

// assignmentHistory returns every value state/assignment has had up to
// now, oldest first, read back from etcd's history (the test's etcd does
// not compact): each generation with the time its leader published it,
// whenever a watcher would have seen it.
func assignmentHistory(t *testing.T, e *devstack.Etcd) []state.Assignment {
	t.Helper()
	cli := testenv.EtcdClientT(t, e)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	now, err := cli.Get(ctx, fleetKeys.Assignment())
	if err != nil {
		t.Fatalf("read %s: %v", fleetKeys.Assignment(), err)
	}
	if len(now.Kvs) == 0 {
		t.Fatalf("no %s: no assignment is published", fleetKeys.Assignment())
	}
	last := now.Kvs[0].ModRevision
	var out []state.Assignment
	for resp := range cli.Watch(clientv3.WithRequireLeader(ctx), fleetKeys.Assignment(), clientv3.WithRev(1)) {
		if err := resp.Err(); err != nil {
			t.Fatalf("read the history of %s: %v", fleetKeys.Assignment(), err)
		}
		for _, ev := range resp.Events {
			if ev.Type == clientv3.EventTypePut {
				a, err := state.ParseAssignment(ev.Kv.Value)
				if err != nil {
					t.Fatalf("%s at revision %d: %v", fleetKeys.Assignment(), ev.Kv.ModRevision, err)
				}
				out = append(out, a)
			}
			if ev.Kv.ModRevision >= last {
				return out
			}
		}
	}
	t.Fatalf("the history of %s up to revision %d not read in 10 s (%d values read): %v", fleetKeys.Assignment(), last, len(out), ctx.Err())
	return nil
}

// revokingGeneration returns the first generation of history after the one
// o was started under that does not give o's partition to agent.
func revokingGeneration(history []state.Assignment, agent string, o record.Owned) (state.Assignment, bool) {
	tp := state.TopicPartition{Topic: o.Topic, Partition: o.Partition}
	for _, a := range history {
		if a.Generation > o.Generation && !slices.Contains(a.Section(o.Cluster).Owned[agent], tp) {
			return a, true
		}
	}
	return state.Assignment{}, false
}

// holdingHandler holds every record handed to it until
// release, then acknowledges them and every later record; it notes each
// record it sees and the most bytes it held.
type holdingHandler struct {
	mu                 sync.Mutex
	hold               bool
	held               []*record.Record
	heldBytes, maxHeld int64
	seen               map[string]bool
}

func newHoldingHandler() *holdingHandler { return &holdingHandler{hold: true, seen: map[string]bool{}} }

func (h *holdingHandler) Handle(_ context.Context, r *record.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seen[fmt.Sprintf("%d@%d", r.Partition, r.Offset)] = true
	if h.hold {
		h.held = append(h.held, r)
		h.heldBytes += r.Size()
		h.maxHeld = max(h.maxHeld, h.heldBytes)
		return nil
	}
	r.Ack()
	return nil
}

// holding returns how many records h holds and the most bytes it held.
func (h *holdingHandler) holding() (int, int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.held), h.maxHeld
}

// release acknowledges what h holds, then waits until it has seen n
// records and a's budget is empty.
func (h *holdingHandler) release(t *testing.T, a *agent.Agent, n int) {
	t.Helper()
	h.mu.Lock()
	h.hold = false
	for _, r := range h.held {
		r.Ack()
	}
	h.mu.Unlock()
	wait.For(t, 20*time.Second, "every record handled, the budget empty", func() error {
		h.mu.Lock()
		defer h.mu.Unlock()
		if len(h.seen) != n {
			return fmt.Errorf("%d of %d handled", len(h.seen), n)
		}
		if v, _ := metricValue(a, "kswitch_in_flight_bytes", nil); v != 0 {
			return fmt.Errorf("kswitch_in_flight_bytes %v", v)
		}
		return nil
	})
}

// startHolding starts an agent with a byte budget of budget bytes (whole
// MiB) and handler h on a cluster with orders of 4 partitions, waits
// until it owns them, writes n records of size bytes, and waits until
// the budget is full (within an eighth).
func startHolding(t *testing.T, h record.Handler, budget, n, size int) *agent.Agent {
	t.Helper()
	e := testenv.StartEtcdT(t)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	cfg := consumeConfig(e, k, "agent-1")
	cfg.Source.MaxInFlightMiB = budget >> 20
	a := startFleetAgent(t, cfg, agent.Options{Handler: h})
	waitBalanced(t, 4, a)
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.DefaultProduceTopic("orders"))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for i := range n {
		if err := cl.ProduceSync(t.Context(), &kgo.Record{Key: []byte(strconv.Itoa(i)), Value: make([]byte, size)}).FirstErr(); err != nil {
			t.Fatal(err)
		}
	}
	wait.For(t, 10*time.Second, "the budget full", func() error {
		v, _ := metricValue(a, "kswitch_in_flight_bytes", nil)
		if v < float64(budget-budget/8) {
			return fmt.Errorf("kswitch_in_flight_bytes %v", v)
		}
		return nil
	})
	return a
}

// TestBytesInFlightAreBounded: the agent's byte budget
// (source.max_in_flight_mib 1) is charged per fetch response and given
// back when each chunk's last record is acknowledged: with a handler that holds every record, the records it
// holds never exceed budget + budget/4 (no request with less than
// budget/8 free, a response at most budget/4: worker.fetchConfig), the
// fetching stops there (the budget full within budget/8), and once the
// handler acknowledges, every record is handled and the budget is empty.
func TestBytesInFlightAreBounded(t *testing.T) {
	t.Parallel()
	const size, n, budget = 16 << 10, 200, 1 << 20
	h := newHoldingHandler()
	a := startHolding(t, h, budget, n, size)
	// Response framing (headers, batch and record overhead) is charged
	// too: a few KiB over the records.
	const bound, framing = budget + budget/4, 8 << 10
	v, _ := metricValue(a, "kswitch_in_flight_bytes", nil)
	got, most := h.holding()
	if most > bound || v > bound+framing {
		t.Fatalf("the handler held up to %d B (%d records of %d B), in flight %v B; want at most %d", most, got, size, v, bound)
	}
	t.Logf("%d records held (%d KiB, %v B charged) with a 1 MiB budget", got, most>>10, v)
	h.release(t, a, n)
}

// keepingHandler is a handler that declares what it keeps per record
// (record.Keeper).
type keepingHandler struct {
	record.HandlerFunc
	kept int
}

func (h keepingHandler) KeptPerRecord() int { return h.kept }

// TestHandlerKeptBytesAreCharged: the budget charges each record what its
// handler says it keeps (record.Keeper) on top of the record's bytes, so
// a handler that keeps 16 KiB of its own per record of 1 KiB, holding
// every record, is handed no more than the budget holds at 17 KiB a
// record (at most 75 with a 1 MiB budget, where the default 448 B would
// let it hold all 200 without filling the budget), and every record once
// it acknowledges.
func TestHandlerKeptBytesAreCharged(t *testing.T) {
	t.Parallel()
	const size, kept, n, budget = 1 << 10, 16 << 10, 200, 1 << 20
	h := newHoldingHandler()
	a := startHolding(t, keepingHandler{HandlerFunc: h.Handle, kept: kept}, budget, n, size)
	got, _ := h.holding()
	if most := (budget + budget/4) / (size + kept); got > most {
		t.Fatalf("the handler holds %d records of %d B keeping %d B each; want at most %d with a %d B budget", got, size, kept, most, budget)
	}
	t.Logf("%d records held with a 1 MiB budget at %d B kept each", got, kept)
	h.release(t, a, n)
}

// BenchmarkConsume measures one agent consuming 1 000 000 records of
// 100 B from 4 partitions of an in-process kfake to a handler that
// acknowledges at once, against a tuned franz-go consumer loop reading the
// same records in the same run (alternating rounds; each agent round a
// fleet of its own, so it starts at the oldest offset): records/s from
// the first record handled to the last, the median of the rounds of each.
// The agent commits positions to etcd, tracks each record and routes it
// through the gate and hold; the loop only counts.
func BenchmarkConsume(b *testing.B) {
	const records, rounds = 1_000_000, 3
	e := testenv.StartEtcdT(b)
	k := testenv.StartKafkaT(b, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": 4}})
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.DefaultProduceTopic("orders"), kgo.ProducerLinger(5*time.Millisecond),
		kgo.ProducerBatchCompression(kgo.NoCompression()))
	if err != nil {
		b.Fatal(err)
	}
	value := make([]byte, 100)
	recs := make([]*kgo.Record, 0, 10_000)
	for i := range records {
		recs = append(recs, &kgo.Record{Key: []byte(strconv.Itoa(i)), Value: value})
		if len(recs) == cap(recs) || i == records-1 {
			if err := cl.ProduceSync(b.Context(), recs...).FirstErr(); err != nil {
				b.Fatal(err)
			}
			recs = recs[:0]
		}
	}
	cl.Close()
	round := 0
	runAgent := func() float64 {
		round++
		var n atomic.Int64
		var first, last atomic.Int64
		done := make(chan struct{})
		// It keeps nothing of a record (record.Keeper): the budget charges
		// the agent's own share and the record's bytes.
		h := keepingHandler{HandlerFunc: func(_ context.Context, r *record.Record) error {
			now := time.Now().UnixNano()
			first.CompareAndSwap(0, now)
			r.Ack()
			if n.Add(1) == records {
				last.Store(now)
				close(done)
			}
			return nil
		}}
		cfg := consumeConfig(e, k, "agent-1")
		cfg.Fleet = "bench-" + strconv.Itoa(round)
		cfg.Source.Group = cfg.Fleet // no start at another round's group offsets
		a, err := agent.New(cfg, agent.Options{Handler: h})
		if err != nil {
			b.Fatal(err)
		}
		if err := a.Start(context.Background()); err != nil {
			b.Fatal(err)
		}
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			b.Fatalf("agent: %d of %d records handled after 2 minutes", n.Load(), records)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := a.Stop(ctx); err != nil {
			b.Fatal(err)
		}
		return float64(records) / time.Duration(last.Load()-first.Load()).Seconds()
	}
	// The franz-go loop: kgo's defaults but for reading from the start,
	// fetches of 1 MiB per partition as the agent's, no group.
	runLoop := func() float64 {
		c, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.ConsumeTopics("orders"),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxPartitionBytes(1<<20))
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var n int
		var first time.Time
		for n < records {
			fs := c.PollFetches(ctx)
			if err := ctx.Err(); err != nil {
				b.Fatalf("franz-go loop: %d of %d records read after 2 minutes", n, records)
			}
			if first.IsZero() && fs.NumRecords() > 0 {
				first = time.Now()
			}
			n += fs.NumRecords()
		}
		return float64(records) / time.Since(first).Seconds()
	}
	var agents, loops []float64
	b.ResetTimer()
	for range b.N {
		agents, loops = agents[:0], loops[:0]
		for i := range rounds {
			if i%2 == 0 {
				agents = append(agents, runAgent())
				loops = append(loops, runLoop())
			} else {
				loops = append(loops, runLoop())
				agents = append(agents, runAgent())
			}
		}
	}
	b.StopTimer()
	slices.Sort(agents)
	slices.Sort(loops)
	a, l := agents[len(agents)/2], loops[len(loops)/2]
	b.ReportMetric(a, "agent-records/s")
	b.ReportMetric(l, "franz-go-records/s")
	b.ReportMetric(a/l, "agent/franz-go")
	b.Logf("%d records of 100 B, 4 partitions, 1 agent: agent %.0f records/s %.0f, franz-go loop %.0f records/s %.0f: agent ÷ franz-go %.2f",
		records, a, agents, l, loops, a/l)
}
