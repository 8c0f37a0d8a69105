package routing_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
	"github.com/kswitch/kswitch/keys"
	"github.com/kswitch/kswitch/routing"
)

// The relay benchmark's workload.
const (
	relayRecords    = 100_000
	relayValueBytes = 1024
	relayPartitions = 12
	relayRounds     = 9 // of each side, alternating; the median is reported (rounds vary by ±20 % on 2 shared cores)
)

// BenchmarkRelayThroughput relays relayRecords records of 1 KiB from a
// 12-partition topic on one kfake cluster to a topic on another, through
// one rule and one channel, and compares kswitch with a baseline measured
// in the same run on the same clusters: a minimal sarama loop (a partition
// consumer per partition handing each record to an async producer with
// a channel's default producer settings, routing.ProducerConfig).
//
// kswitch runs as 'kswitch agent' wires it: an agent (election,
// assignment, commits to etcd, the Kafka group mirror) whose handler is a
// Router following etcd, with the signal watcher for channel pauses. Each
// round gets a fresh fleet (so it starts from the oldest offset) and a
// fresh destination topic. Both sides start with their consumers ready and
// paused (kswitch: a fleet pause signal in force and every partition
// owned; baseline: sarama's PartitionConsumer.Pause), and the clock runs
// from the resume until the destination's high-water marks add up to
// relayRecords: completion is read from the destination, not from either
// side's counters. One benchmark iteration is relayRounds rounds of each
// side, alternating which goes first; the medians are reported. A third
// side, a tuned franz-go loop, is the relay goal's other baseline
// (docs/RELAY.md, "The bench rows").
func BenchmarkRelayThroughput(b *testing.B) {
	_, dst, cli, cfg := relayStack(b)

	hwm := newHighWater(b, cfg.Clusters["D"])
	round := 0
	var kswitch, baseline, franz sideResults
	b.ResetTimer()
	for range b.N {
		kswitch, baseline, franz = sideResults{}, sideResults{}, sideResults{}
		for i := range relayRounds {
			sides := []func(){
				func() {
					round++
					topic := "relay-franz-" + strconv.Itoa(round)
					franz.add(relayRate(b, dst, hwm, topic, func(sw *stopwatch) {
						runFranz(b, cfg, topic, sw)
					}))
				},
				func() {
					round++
					topic := "relay-baseline-" + strconv.Itoa(round)
					baseline.add(relayRate(b, dst, hwm, topic, func(sw *stopwatch) {
						runBaseline(b, cfg, topic, sw)
					}))
				},
				func() {
					round++
					topic := "relay-kswitch-" + strconv.Itoa(round)
					kswitch.add(relayRate(b, dst, hwm, topic, func(sw *stopwatch) {
						runKswitch(b, cfg, cli, "relay-"+strconv.Itoa(round), topic, sw)
					}))
				},
			}
			// Each side goes first, second and last in turn.
			for range i % len(sides) {
				sides = append(sides[1:], sides[0])
			}
			for _, side := range sides {
				side()
			}
		}
	}
	b.StopTimer()
	k, base, fr := median(kswitch.rates), median(baseline.rates), median(franz.rates)
	kcpu, basecpu, frcpu := median(kswitch.cpu), median(baseline.cpu), median(franz.cpu)
	b.ReportMetric(k, "kswitch-records/s")
	b.ReportMetric(base, "sarama-records/s")
	b.ReportMetric(fr, "franz-records/s")
	b.ReportMetric(k/base, "kswitch/sarama")
	b.ReportMetric(k/fr, "kswitch/franz")
	b.ReportMetric(kcpu, "kswitch-cpu-µs/record")
	b.ReportMetric(basecpu, "sarama-cpu-µs/record")
	b.ReportMetric(frcpu, "franz-cpu-µs/record")
	fmt.Printf("relay of %d records of %d B, %d partitions, 1 rule, 1 channel: kswitch %.0f records/s (rounds %.0f), sarama loop %.0f (rounds %.0f), tuned franz-go loop %.0f (rounds %.0f); "+
		"kswitch ÷ sarama %.2f, kswitch ÷ franz-go %.2f (target ≥ 1.0: %s); process CPU per record (brokers included) kswitch %.1f µs, sarama %.1f µs, franz-go %.1f µs: kswitch ÷ franz-go %.2f (target ≤ 1.1: %s)\n",
		relayRecords, relayValueBytes, relayPartitions, k, kswitch.rates, base, baseline.rates, fr, franz.rates,
		k/base, k/fr, met(k/fr >= 1.0), kcpu, basecpu, frcpu, kcpu/frcpu, met(kcpu/frcpu <= 1.1))
}

// exactlyOnceRounds is how many rounds of each delivery mode
// BenchmarkExactlyOnceCost runs.
const exactlyOnceRounds = 5

// BenchmarkExactlyOnceCost relays relayRecords records as the kswitch side
// of BenchmarkRelayThroughput does, in rounds alternating the destination
// cluster's delivery: at_least_once (complete when the destination's
// high-water marks hold every record) and exactly_once (complete when the
// last transaction of every source partition committed: its position in
// __kswitch.positions reaches the partition's end, so every record is
// visible to a read_committed reader). Reported: the medians and their
// ratio (target: exactly_once ≥ 0.8× at_least_once).
func BenchmarkExactlyOnceCost(b *testing.B) {
	_, dst, cli, cfg := relayStack(b)
	eosCfg := cfg.Clone()
	var err error
	var srcClient sarama.Client
	d := eosCfg.Clusters["D"]
	d.Delivery = config.ExactlyOnce
	if v := os.Getenv("KSWITCH_BENCH_TXN_INTERVAL"); v != "" { // to compare intervals
		if d.TransactionInterval, err = time.ParseDuration(v); err != nil {
			b.Fatal(err)
		}
	}
	eosCfg.Clusters["D"] = d
	srcClient, err = kafka.NewClient("A", cfg.Clusters["A"])
	if err != nil {
		b.Fatal(err)
	}
	defer srcClient.Close()
	tps := make([]kafka.TopicPartition, relayPartitions)
	for p := range tps {
		tps[p] = kafka.TopicPartition{Topic: "orders", Partition: int32(p)}
	}
	ends, err := kafka.EndOffsets(srcClient, tps)
	if err != nil {
		b.Fatal(err)
	}
	hwm := newHighWater(b, cfg.Clusters["D"])
	round := 0
	var alo, eos sideResults
	b.ResetTimer()
	for range b.N {
		alo, eos = sideResults{}, sideResults{}
		for i := range exactlyOnceRounds {
			sides := []func(){
				func() {
					round++
					fleet, topic := "eos-alo-"+strconv.Itoa(round), "eos-alo-"+strconv.Itoa(round)
					alo.add(relayRate(b, dst, hwm, topic, func(sw *stopwatch) { runKswitch(b, cfg, cli, fleet, topic, sw) }))
				},
				func() {
					round++
					fleet, topic := "eos-"+strconv.Itoa(round), "eos-"+strconv.Itoa(round)
					eos.add(relayRate(b, dst, hwm, topic, func(sw *stopwatch) {
						sw.done = positionsReach(hwm.client, fleet, ends)
						runKswitch(b, eosCfg, cli, fleet, topic, sw)
					}))
				},
			}
			if i%2 == 1 {
				sides[0], sides[1] = sides[1], sides[0]
			}
			for _, side := range sides {
				side()
			}
		}
	}
	b.StopTimer()
	a, x := median(alo.rates), median(eos.rates)
	acpu, xcpu := median(alo.cpu), median(eos.cpu)
	b.ReportMetric(a, "at-least-once-records/s")
	b.ReportMetric(x, "exactly-once-records/s")
	b.ReportMetric(x/a, "exactly/at-least")
	fmt.Printf("exactly-once cost, relay of %d records of %d B, %d partitions, transactions every %s: at_least_once %.0f records/s (rounds %.0f), exactly_once %.0f (rounds %.0f): "+
		"exactly ÷ at-least %.2f (target ≥ 0.8: %s); process CPU per record %.1f µs and %.1f µs\n",
		relayRecords, relayValueBytes, relayPartitions, cmp.Or(d.TransactionInterval, config.DefaultTransactionInterval), a, alo.rates, x, eos.rates, x/a, met(x/a >= 0.8), acpu, xcpu)
}

// The latency workload: a steady trickle, so that each record waits for
// nothing but the relay.
const (
	latencyRecords = 1500
	latencyRate    = 500 // records per second
)

// BenchmarkExactlyOnceLatency writes latencyRecords records at
// latencyRate to A while one agent relays them to D, and measures each
// record's delay from its write to its arrival at a read_committed reader
// of D, for D at_least_once and exactly_once (alternating rounds, a fresh
// fleet and topics each). Reported: the p50 and p99 of each mode. An
// exactly_once record waits for its transaction's commit: about half the
// transaction interval more on average.
func BenchmarkExactlyOnceLatency(b *testing.B) {
	e := testenv.StartEtcdT(b)
	src := testenv.StartKafkaT(b, "A", devstack.KafkaOptions{})
	dst := testenv.StartKafkaT(b, "D", devstack.KafkaOptions{})
	cli := testenv.EtcdClientT(b, e)
	base := relayConfig(e, src, dst)
	round := 0
	var alo, eos []time.Duration
	b.ResetTimer()
	for range b.N {
		alo, eos = nil, nil
		for i := range 4 {
			for j, exactly := range []bool{false, true} {
				if (i+j)%2 == 1 {
					exactly = !exactly
				}
				round++
				d := relayLatency(b, base, cli, src, dst, round, exactly)
				if exactly {
					eos = append(eos, d...)
				} else {
					alo = append(alo, d...)
				}
			}
		}
	}
	b.StopTimer()
	a50, a99, x50, x99 := percentile(alo, 0.5), percentile(alo, 0.99), percentile(eos, 0.5), percentile(eos, 0.99)
	b.ReportMetric(float64(a50.Microseconds())/1000, "at-least-once-p50-ms")
	b.ReportMetric(float64(x50.Microseconds())/1000, "exactly-once-p50-ms")
	fmt.Printf("exactly-once cost, latency of %d records at %d/s after a second of warm-up (write to A → read_committed read of D, %d rounds of each), transactions every %s: "+
		"at_least_once p50 %v p99 %v, exactly_once p50 %v p99 %v\n",
		latencyRecords-latencyRate, latencyRate, 4, config.DefaultTransactionInterval, a50.Round(100*time.Microsecond), a99.Round(100*time.Microsecond),
		x50.Round(100*time.Microsecond), x99.Round(100*time.Microsecond))
}

func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

// relayLatency runs one latency round and returns each record's delay.
func relayLatency(b *testing.B, base config.Config, cli *clientv3.Client, src, dst *devstack.Kafka, round int, exactly bool) []time.Duration {
	b.Helper()
	srcTopic, dstTopic, fleet := fmt.Sprintf("lat-src-%d", round), fmt.Sprintf("lat-dst-%d", round), fmt.Sprintf("lat-%d", round)
	for _, c := range []struct {
		k     *devstack.Kafka
		topic string
	}{{src, srcTopic}, {dst, dstTopic}} {
		if err := c.k.CreateTopic(c.topic, relayPartitions); err != nil {
			b.Fatal(err)
		}
	}
	cfg := base.Clone()
	cfg.Fleet, cfg.Agent.ID, cfg.Source.Group = fleet, "latency", fleet
	cfg.Source.Topics = []string{srcTopic}
	cfg.Source.CommitInterval = 200 * time.Millisecond
	if exactly {
		d := cfg.Clusters["D"]
		d.Delivery = config.ExactlyOnce
		cfg.Clusters["D"] = d
	}
	cfg.Routing = config.Routing{Default: []string{"out"}, Channels: map[string]config.RoutingChannel{"out": {Cluster: "D", Topic: dstTopic}}}
	m := startRelay(b, cfg, zap.NewNop())
	defer stopRelay(b, m)
	wait.For(b, 20*time.Second, "every partition owned", func() error {
		if n := len(m.Agent().Owned()); n != relayPartitions {
			return fmt.Errorf("%d partitions owned", n)
		}
		return nil
	})
	reader, err := kgo.NewClient(kgo.SeedBrokers(dst.Brokers()...), kgo.ConsumeTopics(dstTopic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.FetchMaxWait(10*time.Millisecond))
	if err != nil {
		b.Fatal(err)
	}
	defer reader.Close()
	writer, err := kgo.NewClient(kgo.SeedBrokers(src.Brokers()...), kgo.DefaultProduceTopic(srcTopic), kgo.ProducerLinger(0))
	if err != nil {
		b.Fatal(err)
	}
	defer writer.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(time.Second / latencyRate)
		defer tick.Stop()
		for i := range latencyRecords {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			writer.Produce(ctx, &kgo.Record{Key: []byte(strconv.Itoa(i)), Value: []byte("x"), Timestamp: time.Now()}, nil)
		}
	})
	var out []time.Duration
	n := 0
	for n < latencyRecords && ctx.Err() == nil {
		fs := reader.PollFetches(ctx)
		now := time.Now()
		fs.EachRecord(func(r *kgo.Record) {
			n++
			// The first second is warm-up, left out for both modes: the
			// first record of each partition waits for its producer to
			// open (an exactly_once one also fences and reads the last
			// position).
			if id, err := strconv.Atoi(string(r.Key)); err == nil && id >= latencyRate {
				out = append(out, now.Sub(r.Timestamp))
			}
		})
	}
	cancel()
	wg.Wait()
	if n < latencyRecords {
		b.Fatalf("round %d: %d of %d records read from D within a minute", round, n, latencyRecords)
	}
	return out
}

// positionsReach returns a completion check of an exactly_once relay of
// fleet: every partition's committed position in __kswitch.positions has
// reached its end on A. It reads the topic on from where it left off.
func positionsReach(c sarama.Client, fleet string, ends map[kafka.TopicPartition]int64) func() (bool, error) {
	var next int64
	done := map[string]int64{}
	return func() (bool, error) {
		if err := c.RefreshMetadata(config.PositionsTopic); err != nil {
			return false, nil // not created yet
		}
		n, err := kafka.ReadPartition(context.Background(), c, config.PositionsTopic, 0, next, func(r kafka.Record) bool {
			if !strings.HasPrefix(string(r.Key), fleet+"/") {
				return true
			}
			var p routing.TxnPosition
			if json.Unmarshal(r.Value, &p) == nil {
				for k, v := range p.Done {
					done[k] = max(done[k], v)
				}
			}
			return true
		})
		if err != nil {
			return false, nil // retried at the next poll
		}
		next = n
		for tp, end := range ends {
			if done[fmt.Sprintf("A/%s/%d", tp.Topic, tp.Partition)] < end {
				return false, nil
			}
		}
		return true, nil
	}
}

// relayStack starts etcd, a cluster A whose topic orders holds
// relayRecords records and an empty cluster D, and returns the
// configuration relaying A to D.
func relayStack(b *testing.B) (src, dst *devstack.Kafka, cli *clientv3.Client, cfg config.Config) {
	e := testenv.StartEtcdT(b)
	src = testenv.StartKafkaT(b, "A", devstack.KafkaOptions{Topics: map[string]int32{"orders": relayPartitions}})
	dst = testenv.StartKafkaT(b, "D", devstack.KafkaOptions{})
	preProduce(b, src, "orders", relayRecords)
	return src, dst, testenv.EtcdClientT(b, e), relayConfig(e, src, dst)
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "not met"
}

// sideResults are the measurements of one side's rounds.
type sideResults struct {
	rates []float64 // records/s
	cpu   []float64 // process CPU µs per record
}

func (r *sideResults) add(rate float64, cpu time.Duration) {
	r.rates = append(r.rates, rate)
	r.cpu = append(r.cpu, float64(cpu)/float64(time.Microsecond))
}

// stopwatch times one side of a round: from start (consumers ready and
// paused, about to resume) until the destination topic holds every record.
type stopwatch struct {
	b     *testing.B
	hwm   *highWater
	topic string
	// done, when set, says when the relay is complete instead of the
	// destination's high-water marks (which count transaction markers).
	done  func() (bool, error)
	began time.Time
	took  time.Duration
	cpu0  time.Duration
	cpu   time.Duration // CPU time of the whole process (brokers and etcd included)
}

func (s *stopwatch) start() { s.began, s.cpu0 = time.Now(), processCPU(s.b) }

// waitDone waits until the destination holds relayRecords records.
func (s *stopwatch) waitDone() {
	s.b.Helper()
	if s.done != nil {
		deadline := s.began.Add(time.Minute)
		for {
			ok, err := s.done()
			if err != nil {
				s.b.Fatal(err)
			}
			if ok {
				break
			}
			if time.Now().After(deadline) {
				s.b.Fatalf("%s: relay not complete after a minute", s.topic)
			}
			time.Sleep(5 * time.Millisecond)
		}
		s.took, s.cpu = time.Since(s.began), processCPU(s.b)-s.cpu0
		return
	}
	if s.took = s.hwm.waitFor(s.topic, relayRecords, s.began); s.took <= 0 {
		s.b.Fatalf("%s: fewer than %d records on the destination after %v", s.topic, relayRecords, -s.took)
	}
	s.cpu = processCPU(s.b) - s.cpu0
}

// processCPU returns the CPU time the process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// relayRate creates topic on dst, runs side with a stopwatch on it, and
// returns the records per second it measured and the process's CPU time
// per record meanwhile.
func relayRate(b *testing.B, dst *devstack.Kafka, hwm *highWater, topic string, side func(*stopwatch)) (rate float64, cpu time.Duration) {
	b.Helper()
	if err := dst.CreateTopic(topic, relayPartitions); err != nil {
		b.Fatal(err)
	}
	sw := &stopwatch{b: b, hwm: hwm, topic: topic}
	side(sw)
	return relayRecords / sw.took.Seconds(), sw.cpu / relayRecords
}

// runBaseline is the baseline relay: a sarama partition consumer per
// partition of orders on A, each handing its records to one async
// producer on D with the router's producer settings. The partition
// consumers are paused until the stopwatch starts.
func runBaseline(b *testing.B, cfg config.Config, topic string, sw *stopwatch) {
	b.Helper()
	cc, err := kafka.Config(cfg.Clusters["A"])
	if err != nil {
		b.Fatal(err)
	}
	consumer, err := sarama.NewConsumer(cfg.Clusters["A"].Brokers, cc)
	if err != nil {
		b.Fatal(err)
	}
	defer consumer.Close()
	pc, err := routing.ProducerConfig(cfg.Clusters["D"], "", "")
	if err != nil {
		b.Fatal(err)
	}
	producer, err := sarama.NewAsyncProducer(cfg.Clusters["D"].Brokers, pc)
	if err != nil {
		b.Fatal(err)
	}
	pcs := make([]sarama.PartitionConsumer, relayPartitions)
	for p := range pcs {
		if pcs[p], err = consumer.ConsumePartition("orders", int32(p), sarama.OffsetOldest); err != nil {
			b.Fatal(err)
		}
		pcs[p].Pause()
	}

	var wg sync.WaitGroup
	var failed error
	wg.Go(func() { // the producer's outcomes
		for n := 0; n < relayRecords; n++ {
			select {
			case <-producer.Successes():
			case perr := <-producer.Errors():
				if failed == nil {
					failed = perr
				}
			}
		}
	})
	sw.start()
	for _, c := range pcs {
		c.Resume()
		wg.Go(func() {
			for m := range c.Messages() {
				out := &sarama.ProducerMessage{Topic: topic, Key: sarama.ByteEncoder(m.Key), Value: sarama.ByteEncoder(m.Value), Timestamp: m.Timestamp}
				for _, h := range m.Headers {
					out.Headers = append(out.Headers, *h)
				}
				producer.Input() <- out
			}
		})
	}
	sw.waitDone()
	for _, c := range pcs {
		c.AsyncClose()
	}
	wg.Wait()
	if failed != nil {
		b.Fatal(failed)
	}
	if err := producer.Close(); err != nil {
		b.Fatal(err)
	}
}

// runFranz is the strongest baseline: a franz-go consume→produce loop
// tuned for throughput as franz-go's documentation recommends (a direct
// consumer of every partition fetching up to 64 MiB per request; an
// idempotent producer, acks all, lingering 5 ms for batches of up to
// 1 MiB, up to 100 000 records buffered, and five requests in flight per
// broker, franz-go's own for idempotent writes), each record produced to
// the same partition of the destination, uncompressed like a channel's
// default. The consumer is paused until the stopwatch starts.
func runFranz(b *testing.B, cfg config.Config, topic string, sw *stopwatch) {
	b.Helper()
	offsets := map[int32]kgo.Offset{}
	for p := range int32(relayPartitions) {
		offsets[p] = kgo.NewOffset().AtStart()
	}
	consumer, err := kgo.NewClient(kgo.SeedBrokers(cfg.Clusters["A"].Brokers...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{"orders": offsets}),
		kgo.FetchMaxBytes(64<<20), kgo.FetchMaxPartitionBytes(8<<20))
	if err != nil {
		b.Fatal(err)
	}
	defer consumer.Close()
	consumer.PauseFetchTopics("orders")
	producer, err := kgo.NewClient(kgo.SeedBrokers(cfg.Clusters["D"].Brokers...),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(5*time.Millisecond), kgo.ProducerBatchMaxBytes(1<<20),
		kgo.ProducerBatchCompression(kgo.NoCompression()), kgo.MaxBufferedRecords(100_000))
	if err != nil {
		b.Fatal(err)
	}
	defer producer.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed error
	sw.start()
	consumer.ResumeFetchTopics("orders")
	wg.Go(func() {
		for ctx.Err() == nil {
			fs := consumer.PollFetches(ctx)
			fs.EachRecord(func(r *kgo.Record) {
				out := &kgo.Record{Topic: topic, Partition: r.Partition, Key: r.Key, Value: r.Value, Headers: r.Headers, Timestamp: r.Timestamp}
				producer.Produce(ctx, out, func(_ *kgo.Record, err error) {
					if err != nil && ctx.Err() == nil {
						mu.Lock()
						failed = cmp.Or(failed, err)
						mu.Unlock()
					}
				})
			})
		}
	})
	sw.waitDone()
	cancel()
	wg.Wait()
	if failed != nil {
		b.Fatal(failed)
	}
}

// runKswitch relays with an agent of fleet whose handler is a Router with
// one rule and one channel (topic on D), wired as 'kswitch agent' wires
// them. The fleet is paused until every partition is owned; the stopwatch
// starts when the pause is lifted.
func runKswitch(b *testing.B, base config.Config, cli *clientv3.Client, fleet, topic string, sw *stopwatch) {
	b.Helper()
	ctx := context.Background()
	cfg := base.Clone()
	cfg.Fleet = fleet
	cfg.Agent.ID = "relay"
	cfg.Source.Group = fleet
	cfg.Routing = config.Routing{
		Rules:    []config.RoutingRule{{Name: "orders", Match: `topic == "orders"`, Channels: []string{"out"}}},
		Channels: map[string]config.RoutingChannel{"out": {Cluster: "D", Topic: topic}},
	}
	fk := keys.New(fleet)
	pause, err := cli.Put(ctx, fk.FleetSignal(), "pause")
	if err != nil {
		b.Fatal(err)
	}

	m := startRelay(b, cfg, zap.NewNop())
	defer stopRelay(b, m)
	a := m.Agent()
	wait.For(b, 20*time.Second, "every partition owned, paused", func() error {
		if n := len(a.Owned()); n != relayPartitions || a.SignalsApplied() < pause.Header.Revision {
			return fmt.Errorf("%d partitions owned, signals applied up to revision %d (pause %d)", n, a.SignalsApplied(), pause.Header.Revision)
		}
		return nil
	})
	sw.start()
	if _, err := cli.Delete(ctx, fk.FleetSignal()); err != nil {
		b.Fatal(err)
	}
	sw.waitDone()
}

// highWater reads the high-water marks of a cluster's topics.
type highWater struct {
	client sarama.Client
}

func newHighWater(tb testing.TB, c config.Cluster) *highWater {
	cl, err := kafka.NewClient("D", c)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cl.Close() })
	return &highWater{client: cl}
}

// records returns the number of records in topic's relayPartitions
// partitions: the sum of their high-water marks, asked of each leader in
// one request (kafka.EndOffsets; the benchmark polls while both sides
// run: it must cost them little).
func (h *highWater) records(topic string) (int64, error) {
	tps := make([]kafka.TopicPartition, relayPartitions)
	for p := range tps {
		tps[p] = kafka.TopicPartition{Topic: topic, Partition: int32(p)}
	}
	ends, err := kafka.EndOffsets(h.client, tps)
	if err != nil {
		_ = h.client.RefreshMetadata(topic)
		return 0, err
	}
	var sum int64
	for _, end := range ends {
		sum += end
	}
	return sum, nil
}

// waitFor waits until topic's partitions hold n records in all and
// returns the time from began to the poll that saw them, or minus the
// time waited when they were not there within a minute.
func (h *highWater) waitFor(topic string, n int64, began time.Time) time.Duration {
	deadline := began.Add(time.Minute)
	for {
		sum, err := h.records(topic)
		now := time.Now()
		if err == nil && sum >= n {
			return now.Sub(began)
		}
		if now.After(deadline) {
			return -now.Sub(began)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// preProduce writes n records of relayValueBytes, keyed so they spread
// over the partitions, to topic on k.
func preProduce(tb testing.TB, k *devstack.Kafka, topic string, n int) {
	tb.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.DefaultProduceTopic(topic),
		kgo.ProducerLinger(5*time.Millisecond), kgo.MaxBufferedRecords(10_000))
	if err != nil {
		tb.Fatal(err)
	}
	defer cl.Close()
	value := make([]byte, relayValueBytes)
	for i := range value {
		value[i] = 'a' + byte(i%26)
	}
	var mu sync.Mutex
	var failed error
	for i := range n {
		cl.Produce(context.Background(), &kgo.Record{Key: []byte(strconv.Itoa(i)), Value: value}, func(_ *kgo.Record, err error) {
			if err != nil {
				mu.Lock()
				if failed == nil {
					failed = err
				}
				mu.Unlock()
			}
		})
	}
	if err := cl.Flush(context.Background()); err != nil {
		tb.Fatal(err)
	}
	if failed != nil {
		tb.Fatal(failed)
	}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
