package agent_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/mirror"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
)

// scaleFleet is a fleet over many partitions: topics of up to 20
// partitions each on A, mirrored to B, and n agents sharing them.
type scaleFleet struct {
	d          *dc
	topics     []string
	topicParts map[string]int32
	partitions int
	l          *ledger
	agents     []*agent.Agent
	produced   []string // every id written, in order
}

// scaleTopics spreads partitions over topics of 20 (fewer: one topic).
func scaleTopics(partitions int) map[string]int32 {
	per := min(20, partitions)
	out := map[string]int32{}
	for i := 0; i*per < partitions; i++ {
		out[fmt.Sprintf("t%03d", i)] = int32(min(per, partitions-i*per))
	}
	return out
}

func startScaleFleet(tb testing.TB, partitions, agents int) *scaleFleet {
	tb.Helper()
	topicParts := scaleTopics(partitions)
	var topics []string
	for t := range topicParts {
		topics = append(topics, t)
	}
	d := &dc{
		etcd: testenv.StartEtcdT(tb),
		a:    testenv.StartKafkaT(tb, "A", devstack.KafkaOptions{Topics: topicParts}),
		b:    testenv.StartKafkaT(tb, "B", devstack.KafkaOptions{}),
	}
	m, err := mirror.Start(context.Background(), mirror.Config{
		Source: d.a.Brokers(), Target: d.b.Brokers(), SourceName: "A", TargetName: "B",
		Topics: topics, RemoteTopic: func(t string) string { return "A." + t },
		TargetPrefill:    3,
		OffsetSyncsTopic: "mm2-offset-syncs.A.internal", OffsetSyncsOnTarget: true,
	})
	if err != nil {
		tb.Fatal(err)
	}
	d.mirror = m
	tb.Cleanup(m.Stop)
	f := &scaleFleet{d: d, topics: topics, topicParts: topicParts, partitions: partitions, l: newLedger()}
	for i := range agents {
		id := fmt.Sprintf("agent-%02d", i+1)
		f.agents = append(f.agents, startFleetAgent(tb, f.config(id), agent.Options{Handler: f.l.handler(id), Logger: quietLogger(tb, id)}))
	}
	return f
}

func (f *scaleFleet) config(id string) config.Config {
	cfg := f.d.config(id)
	cfg.Source.Topics = f.topics
	// The default commit interval: what a fleet this size runs with.
	cfg.Source.CommitInterval = config.Default().Source.CommitInterval
	return cfg
}

// consuming waits until the agents own every partition on cluster and
// returns how long that took.
func (f *scaleFleet) consuming(tb testing.TB, timeout time.Duration, cluster string, agents ...*agent.Agent) time.Duration {
	tb.Helper()
	began := time.Now()
	wait.For(tb, timeout, fmt.Sprintf("%d agents consume all %d partitions on %s", len(agents), f.partitions, cluster), func() error {
		c, err := activeOfN(f.partitions, agents...)
		if err == nil && c != cluster {
			err = fmt.Errorf("active %s", c)
		}
		return err
	})
	return time.Since(began)
}

// produce writes perTopic records to every topic of A, record i to
// partition i (modulo the topic's), values tag/topic/i, and waits for
// their acks.
func (f *scaleFleet) produce(tb testing.TB, tag string, perTopic int) {
	tb.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Flush.Messages = 500
	sc.Producer.Flush.Frequency = 5 * time.Millisecond
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewAsyncProducer(f.d.a.Brokers(), sc)
	if err != nil {
		tb.Fatal(err)
	}
	n := perTopic * len(f.topics)
	var wg sync.WaitGroup
	var failed []error
	wg.Go(func() {
		for range n {
			select {
			case <-p.Successes():
			case err := <-p.Errors():
				failed = append(failed, err)
			}
		}
	})
	for i := range perTopic {
		for _, t := range f.topics {
			id := fmt.Sprintf("%s/%s/%d", tag, t, i)
			f.produced = append(f.produced, id)
			p.Input() <- &sarama.ProducerMessage{Topic: t, Partition: int32(i) % f.topicParts[t], Value: sarama.StringEncoder(id), Timestamp: time.Now()}
		}
	}
	wg.Wait()
	if err := p.Close(); err != nil {
		tb.Fatal(err)
	}
	if len(failed) > 0 {
		tb.Fatalf("%d of %d records not written, e.g. %v", len(failed), n, failed[0])
	}
}

// handledAll waits until every record produced has been handled.
func (f *scaleFleet) handledAll(tb testing.TB, timeout time.Duration) time.Duration {
	tb.Helper()
	began := time.Now()
	wait.For(tb, timeout, fmt.Sprintf("all %d records handled", len(f.produced)), func() error {
		missing, first := 0, ""
		for _, id := range f.produced {
			if f.l.timesHandled(id) == 0 {
				if missing++; first == "" {
					first = id
				}
			}
		}
		if missing > 0 {
			return fmt.Errorf("%d not handled, e.g. %s", missing, first)
		}
		return nil
	})
	return time.Since(began)
}

// mirrored waits until B holds everything A does.
func (f *scaleFleet) mirrored(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := f.d.mirror.CaughtUp(ctx); err != nil {
		tb.Fatalf("the mirror did not catch up within %v: %v", timeout, err)
	}
}

// quietLogger logs at info for a test (shown when it fails) and nothing
// for a benchmark: 1200 partitions make debug logs the load measured.
func quietLogger(tb testing.TB, id string) *zap.Logger {
	if _, ok := tb.(*testing.T); ok {
		return zaptest.NewLogger(tb, zaptest.Level(zap.InfoLevel)).Named(id)
	}
	return zap.NewNop()
}

// flow writes records to every topic of A at rate records/s for d, values
// tag/i, and returns how many it wrote.
func (f *scaleFleet) flow(tb testing.TB, tag string, rate int, d time.Duration) int {
	tb.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Return.Successes = true
	sc.Producer.Flush.Frequency = 5 * time.Millisecond
	sc.Producer.Partitioner = sarama.NewRoundRobinPartitioner
	p, err := sarama.NewAsyncProducer(f.d.a.Brokers(), sc)
	if err != nil {
		tb.Fatal(err)
	}
	var (
		acked  sync.WaitGroup
		failed int
		sent   int
	)
	acked.Go(func() {
		for range p.Successes() {
		}
	})
	acked.Go(func() {
		for range p.Errors() {
			failed++
		}
	})
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	began := time.Now()
	for time.Since(began) < d {
		<-tick.C
		due := int(time.Since(began).Seconds() * float64(rate))
		for ; sent < due; sent++ {
			t := f.topics[sent%len(f.topics)]
			id := fmt.Sprintf("%s/%d", tag, sent)
			f.produced = append(f.produced, id)
			p.Input() <- &sarama.ProducerMessage{Topic: t, Value: sarama.StringEncoder(id), Timestamp: time.Now()}
		}
	}
	p.AsyncClose()
	acked.Wait()
	if failed > 0 {
		tb.Fatalf("%d of %d records not written", failed, sent)
	}
	return sent
}

// scaleRun is what the test asserts and the benchmark measures: a fleet
// starts on every partition, an agent is killed, A fails; records are
// written before each step and every one must be handled.
type scaleRun struct {
	start, kill, failover, drain time.Duration
	records, dups, killedDups    int
	killed                       string
}

func runScale(tb testing.TB, f *scaleFleet, perTopic int) scaleRun {
	tb.Helper()
	var r scaleRun
	budget := 60 * time.Second
	began := time.Now()
	step := func(what string) {
		tb.Logf("%v: %s", time.Since(began).Round(time.Millisecond), what)
	}
	r.start = f.consuming(tb, budget, "A", f.agents...)
	step("consuming")
	f.produce(tb, "before", perTopic)
	step("produced")
	f.handledAll(tb, budget)
	step("handled")

	// A SIGKILL: nothing released; the lease expires after the TTL.
	victim := f.agents[len(f.agents)-1]
	rest := f.agents[:len(f.agents)-1]
	r.killed = victim.ID()
	f.produce(tb, "kill", perTopic)
	killed := time.Now()
	victim.Abort()
	r.kill = time.Since(killed) + f.consuming(tb, budget, "A", rest...)
	step("consuming after the kill")
	f.handledAll(tb, budget)
	step("handled")

	// A fails with B caught up: the fleet moves every partition, its
	// positions translated by fingerprint.
	f.produce(tb, "failover", perTopic)
	f.mirrored(tb, budget)
	step("mirrored")
	failed := time.Now()
	f.d.a.Fail()
	r.failover = time.Since(failed) + f.consuming(tb, budget, "B", rest...)
	step("consuming B")
	r.drain = f.handledAll(tb, budget)
	step("handled")
	r.records = len(f.produced)
	// Only the records written count: the mirror's filler on B (one value
	// in every partition) is handled once per partition it is in.
	f.l.mu.Lock()
	for _, id := range f.produced {
		if n := f.l.seen[id]; n > 1 {
			r.dups += n - 1
			if f.l.first[id] == r.killed {
				r.killedDups += n - 1
			}
		}
	}
	f.l.mu.Unlock()
	tb.Cleanup(func() { tb.Logf("%v: cleaned up", time.Since(began).Round(time.Millisecond)) })
	return r
}

// TestFleetOf10At1200PartitionsLosesNothingThroughAKillAndAFailover: 60
// topics of 20 partitions, 10 agents. Every record written before the
// start, the kill and the failover is handled; the only records handled
// twice are those the killed agent handled after its last commit; the
// kill's rebalance fits in the session TTL and a margin.
func TestFleetOf10At1200PartitionsLosesNothingThroughAKillAndAFailover(t *testing.T) {
	f := startScaleFleet(t, 1200, 10)
	r := runScale(t, f, 40) // 2 records in every partition before each step
	t.Logf("1200 partitions, 10 agents: consumed %v after start, %v after the kill of %s, on B %v after A failed; %d records, %d handled twice (%d first by the killed agent)",
		r.start, r.kill, r.killed, r.failover, r.records, r.dups, r.killedDups)
	if r.dups != r.killedDups {
		f.l.check(t)
		t.Errorf("%d records handled twice, %d of them first by the killed agent: the others were repeated by a switch", r.dups, r.killedDups)
		shown := 0
		for _, d := range f.l.dupDeliveries() {
			if !strings.Contains(d, ": "+r.killed+" ") && !strings.Contains(d, "filler") && shown < 10 {
				t.Log(d)
				shown++
			}
		}
		methods := map[string]int{}
		for _, ev := range readHistory(t, testenv.EtcdClientT(t, f.d.etcd)) {
			for _, p := range ev.Partitions {
				methods[ev.Reason[:min(20, len(ev.Reason))]+" "+p.Method]++
			}
		}
		t.Logf("translations: %v", methods)
	}
	// The lease outlives the kill by at most the TTL; then the leader
	// plans and the agents start 1200 partitions (generous for -race on
	// two loaded cores).
	if bound := ttl + 8*time.Second; r.kill > bound {
		t.Errorf("the kill's rebalance took %v, want <= %v (session TTL %v)", r.kill, bound, ttl)
	}
}

// etcdWrites counts the fleet's writes to etcd as a watcher sees them.
type etcdWrites struct {
	mu                   sync.Mutex
	events, bytes        int64
	revisions            map[int64]bool
	cancel               context.CancelFunc
	done                 chan struct{}
	watchedAt, stoppedAt time.Time
}

func watchWrites(tb testing.TB, cli *clientv3.Client, prefix string) *etcdWrites {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &etcdWrites{revisions: map[int64]bool{}, cancel: cancel, done: make(chan struct{}), watchedAt: time.Now()}
	ch := cli.Watch(clientv3.WithRequireLeader(ctx), prefix, clientv3.WithPrefix())
	go func() {
		defer close(w.done)
		for resp := range ch {
			w.mu.Lock()
			for _, ev := range resp.Events {
				w.events++
				w.bytes += int64(len(ev.Kv.Key) + len(ev.Kv.Value))
				w.revisions[ev.Kv.ModRevision] = true
			}
			w.mu.Unlock()
		}
	}()
	tb.Cleanup(w.stop)
	return w
}

func (w *etcdWrites) stop() {
	w.cancel()
	<-w.done
	if w.stoppedAt.IsZero() {
		w.stoppedAt = time.Now()
	}
}

// rates returns writes, bytes and revisions per second while watched.
func (w *etcdWrites) rates() (writes, bytes, revisions float64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.stoppedAt.Sub(w.watchedAt).Seconds()
	return float64(w.events) / s, float64(w.bytes) / s, float64(len(w.revisions)) / s
}
