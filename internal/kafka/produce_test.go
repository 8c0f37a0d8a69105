package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"github.com/twmb/franz-go/pkg/kversion"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// The producer's tests: every record carries its partition and its
// number within it (the message's Ref, and the value's prefix); a
// recorder checks the reports (each record once, in order per partition)
// and a franz-go reader reads the topic back to its end and checks the
// verdict: every record exactly once, in order per partition, but those
// meant to be refused.

// recorder is the ProduceHandler of the tests.
type recorder struct {
	mu          sync.Mutex
	next        map[int32]int // per partition: the number the next report must carry, at least
	acked       int
	refused     []string // values' prefixes
	lastRefusal error
	problems    []string
	left        int // Unfinished
	kick        chan struct{}
}

func newRecorder() *recorder {
	return &recorder{next: map[int32]int{}, kick: make(chan struct{}, 1)}
}

type ref struct {
	partition int32
	n         int
}

func (r *recorder) saw(m *kafka.Message) {
	id := m.Ref.(ref)
	if id.n < r.next[id.partition] {
		r.problems = append(r.problems, fmt.Sprintf("partition %d: record %d reported after record %d", id.partition, id.n, r.next[id.partition]-1))
	}
	r.next[id.partition] = id.n + 1
}

func (r *recorder) Acked(msgs []*kafka.Message, offset int64) {
	r.mu.Lock()
	for _, m := range msgs {
		r.saw(m)
	}
	r.acked += len(msgs)
	r.mu.Unlock()
	r.poke()
}

func (r *recorder) Refused(m *kafka.Message, err error) {
	r.mu.Lock()
	r.saw(m)
	r.refused = append(r.refused, prefix(m.Value))
	r.lastRefusal = err
	r.mu.Unlock()
	r.poke()
}

func (r *recorder) Unfinished(msgs []*kafka.Message) {
	r.mu.Lock()
	r.left += len(msgs)
	r.mu.Unlock()
}

func (r *recorder) poke() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

func (r *recorder) settled() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.acked + len(r.refused)
}

func (r *recorder) ackedN() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.acked
}

func (r *recorder) check(t *testing.T, refused ...string) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, p := range r.problems {
		t.Error(p)
	}
	if !slices.Equal(r.refused, refused) {
		t.Errorf("refused %q, want %q", r.refused, refused)
	}
}

// value is record n of partition p, size bytes at least: "p/n " then
// filler.
func value(p int32, n, size int) []byte {
	v := fmt.Appendf(nil, "%d/%d ", p, n)
	for len(v) < size {
		v = append(v, byte('a'+len(v)%26))
	}
	return v
}

func prefix(v []byte) string {
	s, _, _ := strings.Cut(string(v), " ")
	return s
}

// plan says what a test produces: count records spread over partitions
// (record i to partition i % partitions), each of size bytes (sizes
// overrides by "p/n"), with the codec of codecs[(i / 1000) % len].
type plan struct {
	topic      string
	partitions int32
	count      int
	size       int
	sizes      map[string]int
	codecs     []sarama.CompressionCodec
	// window bounds the records given and not yet reported (0: none):
	// a producing application's pace, so that faults land mid-stream.
	window int
}

func (pl plan) messages() []*kafka.Message {
	msgs := make([]*kafka.Message, pl.count)
	per := make([]int, pl.partitions)
	for i := range msgs {
		p := int32(i) % pl.partitions
		n := per[p]
		per[p]++
		size := pl.size
		if s, ok := pl.sizes[fmt.Sprintf("%d/%d", p, n)]; ok {
			size = s
		}
		codec := sarama.CompressionNone
		if len(pl.codecs) > 0 {
			codec = pl.codecs[(i/1000)%len(pl.codecs)]
		}
		msgs[i] = &kafka.Message{Topic: pl.topic, Partition: p, Key: []byte(strconv.Itoa(i)), Value: value(p, n, size),
			Headers: []sarama.RecordHeader{{Key: []byte("n"), Value: []byte(strconv.Itoa(n))}},
			Codec:   codec, Ref: ref{p, n}}
	}
	return msgs
}

// feed produces msgs in order, keeping at most window unreported; it
// returns when all are given or ctx ends.
func feed(ctx context.Context, t *testing.T, p *kafka.Producer, r *recorder, msgs []*kafka.Message, window int) {
	for i, m := range msgs {
		for window > 0 && i-r.settled() >= window {
			select {
			case <-r.kick:
			case <-ctx.Done():
				return
			}
		}
		if err := p.Produce(m); err != nil {
			t.Errorf("Produce: %v", err)
			return
		}
	}
}

func cluster(k *devstack.Kafka) config.Cluster {
	return config.Cluster{Brokers: k.Brokers(), Version: config.DefaultKafkaVersion}
}

func newProducer(t *testing.T, k *devstack.Kafka, cfg kafka.ProducerConfig, r *recorder) *kafka.Producer {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	p, err := kafka.NewProducer(ctx, k.Name(), cluster(k), cfg, r)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := p.Close(ctx); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

// produceAll gives every message of pl to p at pl.window's pace and waits
// until each is reported.
func produceAll(t *testing.T, p *kafka.Producer, r *recorder, pl plan, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), within)
	defer cancel()
	feed(ctx, t, p, r, pl.messages(), pl.window)
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported, stats %+v)", err, r.settled(), pl.count, p.Stats())
	}
}

// verdict reads topic back from its start to its end with a franz-go
// client and checks every partition holds exactly the records of pl but
// the refused ones, once each and in order.
func verdict(t *testing.T, k *devstack.Kafka, pl plan, refused ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	ends := endOffsets(ctx, t, k, pl.topic, pl.partitions)
	offsets := map[int32]kgo.Offset{}
	for p := range pl.partitions {
		offsets[p] = kgo.NewOffset().AtStart()
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{pl.topic: offsets}))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got := map[int32][]string{}
	next := map[int32]int64{}
	for !reached(next, ends) {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read back %s: %v (read up to %v of %v)", pl.topic, err, next, ends)
		}
		fs.EachError(func(topic string, p int32, err error) { t.Logf("read back %s/%d: %v", topic, p, err) })
		fs.EachRecord(func(rec *kgo.Record) {
			pre := prefix(rec.Value)
			if _, n, _ := strings.Cut(pre, "/"); len(rec.Headers) != 1 || rec.Headers[0].Key != "n" || string(rec.Headers[0].Value) != n {
				t.Errorf("record %s at %s/%d@%d: headers %v, want n=%s", pre, rec.Topic, rec.Partition, rec.Offset, rec.Headers, n)
			}
			got[rec.Partition] = append(got[rec.Partition], pre)
			next[rec.Partition] = rec.Offset + 1
		})
	}
	skip := map[string]bool{}
	for _, s := range refused {
		skip[s] = true
	}
	want := map[int32][]string{}
	for _, m := range pl.messages() {
		if s := prefix(m.Value); !skip[s] {
			want[m.Partition] = append(want[m.Partition], s)
		}
	}
	n := 0
	for _, g := range got {
		n += len(g)
	}
	t.Logf("read back %d records of %s", n, pl.topic)
	for p := range pl.partitions {
		if g, w := got[p], want[p]; !slices.Equal(g, w) {
			t.Errorf("partition %d holds %d records, want %d: %s", p, len(g), len(w), firstDiff(g, w))
		}
	}
}

func reached(next, ends map[int32]int64) bool {
	for p, end := range ends {
		if next[p] < end {
			return false
		}
	}
	return true
}

func firstDiff(got, want []string) string {
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return fmt.Sprintf("at %d got %s, want %s", i, got[i], want[i])
		}
	}
	return fmt.Sprintf("equal for %d, then lengths differ", min(len(got), len(want)))
}

// endOffsets lists the end offset of each partition of topic.
func endOffsets(ctx context.Context, t *testing.T, k *devstack.Kafka, topic string, partitions int32) map[int32]int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	req := kmsg.NewPtrListOffsetsRequest()
	rt := kmsg.NewListOffsetsRequestTopic()
	rt.Topic = topic
	for p := range partitions {
		rp := kmsg.NewListOffsetsRequestTopicPartition()
		rp.Partition, rp.Timestamp = p, -1
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	ends := map[int32]int64{}
	for shard := range slices.Values(cl.RequestSharded(ctx, req)) {
		if shard.Err != nil {
			t.Fatalf("list offsets of %s: %v", topic, shard.Err)
		}
		for _, st := range shard.Resp.(*kmsg.ListOffsetsResponse).Topics {
			for _, sp := range st.Partitions {
				if err := kerr.ErrorForCode(sp.ErrorCode); err != nil {
					t.Fatalf("list offsets of %s/%d: %v", topic, sp.Partition, err)
				}
				ends[sp.Partition] = sp.Offset
			}
		}
	}
	return ends
}

func testConfig() kafka.ProducerConfig {
	cfg := kafka.DefaultProducerConfig()
	cfg.Timeout = time.Second
	return cfg
}

var allCodecs = []sarama.CompressionCodec{sarama.CompressionNone, sarama.CompressionSnappy, sarama.CompressionLZ4,
	sarama.CompressionZSTD, sarama.CompressionGZIP}

// TestProduce: 30 000 records over 12 partitions, the codec changing
// every 1 000 records, on 1 broker and on 3.
func TestProduce(t *testing.T) {
	t.Parallel()
	for _, brokers := range []int{1, 3} {
		t.Run(fmt.Sprintf("brokers=%d", brokers), func(t *testing.T) {
			pl := plan{topic: "out", partitions: 12, count: 30000, size: 100, codecs: allCodecs, window: 5000}
			k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: brokers, Topics: map[string]int32{pl.topic: pl.partitions}})
			r := newRecorder()
			p := newProducer(t, k, testConfig(), r)
			produceAll(t, p, r, pl, time.Minute)
			r.check(t)
			verdict(t, k, pl)
			t.Logf("stats %+v", p.Stats())
			if st := p.Stats(); st.Bumps != 0 || st.Refused != 0 {
				t.Errorf("stats %+v: want no bump, nothing refused", st)
			}
		})
	}
}

// TestProduceAppliedButUnanswered (F3): the broker writes batches and
// answers REQUEST_TIMED_OUT or NOT_ENOUGH_REPLICAS_AFTER_APPEND; the
// resends under the same sequences are recognised: 0 duplicated.
func TestProduceAppliedButUnanswered(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 12, count: 12000, size: 100, window: 2000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
	faults := k.Cluster().Fault(
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{2}, Err: kerr.RequestTimedOut, Count: 3},
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{7}, Err: kerr.NotEnoughReplicasAfterAppend, Count: 3},
	)
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	produceAll(t, p, r, pl, time.Minute)
	if n := faults.Hits(); n != 6 {
		t.Errorf("faults answered %d requests, want 6", n)
	}
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 0 || st.Retries < 6 {
		t.Errorf("stats %+v: want no bump, >= 6 resend rounds", st)
	}
}

// feedHalfAcked feeds msgs and waits until half of them are acknowledged:
// the producer is mid-stream, with batches acknowledged and in flight.
func feedHalfAcked(ctx context.Context, t *testing.T, p *kafka.Producer, r *recorder, msgs []*kafka.Message, window int) {
	t.Helper()
	feed(ctx, t, p, r, msgs, window)
	wait.For(t, 30*time.Second, "half of the first records acknowledged", func() error {
		if n := r.ackedN(); n < len(msgs)/2 {
			return fmt.Errorf("%d of %d acknowledged", n, len(msgs))
		}
		return nil
	})
}

// TestProduceSequenceLost (F7): OUT_OF_ORDER_SEQUENCE_NUMBER, then
// UNKNOWN_PRODUCER_ID, on one partition: one drain-and-bump each, nothing
// acknowledged sent again, nothing skipped.
func TestProduceSequenceLost(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 6, count: 12000, size: 100, window: 1000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	msgs := pl.messages()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	third := len(msgs) / 3
	feedHalfAcked(ctx, t, p, r, msgs[:third], pl.window)
	for i, e := range []*kerr.Error{kerr.OutOfOrderSequenceNumber, kerr.UnknownProducerID} {
		k.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{3}, Err: e})
		feed(ctx, t, p, r, msgs[third*(i+1):third*(i+2)], pl.window)
		wait.For(t, 30*time.Second, fmt.Sprintf("bump %d", i+1), func() error {
			if n := p.Stats().Bumps; n != int64(i+1) {
				return fmt.Errorf("%d bumps", n)
			}
			return nil
		})
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	r.check(t)
	verdict(t, k, pl)
	if n := p.Stats().Bumps; n != 2 {
		t.Errorf("%d bumps, want 2", n)
	}
}

// TestProduceSequenceGap (F8): one batch of a partition numbered a
// sequence too far, as after the broker lost the producer's state: the
// broker refuses it and every batch behind it as out of order by itself;
// one drain-and-bump, the refused batches sent again under the new
// producer id, every partition's records once and in order.
func TestProduceSequenceGap(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 6, count: 12000, size: 100, window: 1000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	msgs := pl.messages()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	half := len(msgs) / 2
	feedHalfAcked(ctx, t, p, r, msgs[:half], pl.window)
	kafka.SkipSequence(p, pl.topic, 3)
	feed(ctx, t, p, r, msgs[half:], pl.window)
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported, stats %+v)", err, r.settled(), pl.count, p.Stats())
	}
	r.check(t)
	verdict(t, k, pl)
	st := p.Stats()
	t.Logf("stats %+v", st)
	if st.Bumps != 1 || st.Refused != 0 {
		t.Errorf("stats %+v: want 1 bump, nothing refused", st)
	}
}

// TestProduceSplitsTooLarge (F9): a topic taking batches of 64 KiB at
// most; 20 KiB records are sent in batches split until they fit, the one
// record of 100 KiB is refused, every other once and in order.
func TestProduceSplitsTooLarge(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "small", partitions: 3, count: 300, size: 20 << 10, sizes: map[string]int{"1/40": 100 << 10}}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{})
	createTopic(t, k, pl.topic, pl.partitions, map[string]string{"max.message.bytes": strconv.Itoa(64 << 10)})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	produceAll(t, p, r, pl, time.Minute)
	r.check(t, "1/40")
	verdict(t, k, pl, "1/40")
	if st := p.Stats(); st.Splits == 0 || st.Refused != 1 || st.Bumps != 0 {
		t.Errorf("stats %+v: want splits, 1 refused, no bump", st)
	}
}

func createTopic(t *testing.T, k *devstack.Kafka, topic string, partitions int32, configs map[string]string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	req := kmsg.NewPtrCreateTopicsRequest()
	rt := kmsg.NewCreateTopicsRequestTopic()
	rt.Topic, rt.NumPartitions, rt.ReplicationFactor = topic, partitions, 1
	for name, v := range configs {
		c := kmsg.NewCreateTopicsRequestTopicConfig()
		c.Name, c.Value = name, &v
		rt.Configs = append(rt.Configs, c)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(t.Context(), cl)
	if err != nil {
		t.Fatal(err)
	}
	if err := kerr.ErrorForCode(resp.Topics[0].ErrorCode); err != nil {
		t.Fatalf("create topic %s: %v", topic, err)
	}
}

// TestMurmur2MatchesSarama: HashPartition places 10⁶ random keys where
// sarama's murmur2 partitioner does, so the move to the new producer
// moves no key.
func TestMurmur2MatchesSarama(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	sp := sarama.NewMurmur2Partitioner("t")
	key := make([]byte, 64)
	for i := range 1000000 {
		k := key[:rng.IntN(len(key)+1)]
		for j := range k {
			k[j] = byte(rng.Uint32())
		}
		n := int32(1 + i%97)
		want, err := sp.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(k)}, n)
		if err != nil {
			t.Fatal(err)
		}
		if got := kafka.HashPartition(k, n); got != want {
			t.Fatalf("key %x over %d partitions: HashPartition %d, sarama %d", k, n, got, want)
		}
	}
}

// midStream produces pl through p at pl.window's pace: half of it, then,
// once a quarter is acknowledged, calls start (the fault begins), gives
// the second half, waits until p says the topic stalls, calls end (the
// fault ends) and waits until every record is reported.
func midStream(t *testing.T, p *kafka.Producer, r *recorder, pl plan, start, end func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	msgs := pl.messages()
	half := len(msgs) / 2
	started, fed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(fed)
		feed(ctx, t, p, r, msgs[:half], pl.window)
		select {
		case <-started:
		case <-ctx.Done():
			return
		}
		feed(ctx, t, p, r, msgs[half:], pl.window)
	}()
	defer func() { <-fed }()
	wait.For(t, time.Minute, "a quarter acknowledged", func() error {
		if n := r.ackedN(); n < pl.count/4 {
			return fmt.Errorf("%d of %d acknowledged", n, pl.count)
		}
		return nil
	})
	start()
	close(started)
	waitStalledFor(t, p, pl.topic)
	end()
	<-fed
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported, stats %+v)", err, r.settled(), pl.count, p.Stats())
	}
	t.Logf("stats %+v", p.Stats())
}

// TestProduceThroughARestart (F1): the destination's only broker stopped
// and restarted (its state, producers' included, kept on disk) while
// records flow: batches in flight are sent again under their sequences,
// no bump, every record once.
func TestProduceThroughARestart(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 12, count: 30000, size: 100, window: 3000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	midStream(t, p, r, pl, k.Stop, func() {
		if err := k.Restart(); err != nil {
			t.Fatal(err)
		}
	})
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 0 || st.Reconnected == 0 {
		t.Errorf("stats %+v: want no bump, a reconnection", st)
	}
	if st, ok := p.Stalled(pl.topic, 0); ok {
		t.Errorf("still stalled after every record was acknowledged: %+v", st)
	}
}

// TestProduceThroughAHang (F2): the destination swallows every request
// for 3 s: the requests time out, their connection is closed, the
// batches are sent again; the destination is seen failing, then flows.
func TestProduceThroughAHang(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 12, count: 20000, size: 100, window: 3000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	var hung time.Time
	midStream(t, p, r, pl, func() {
		k.Hang()
		hung = time.Now()
	}, func() {
		time.Sleep(time.Until(hung.Add(3 * time.Second))) // the fault's length, not a wait for a condition
		k.Recover()
	})
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 0 || st.Reconnected == 0 {
		t.Errorf("stats %+v: want no bump, a reconnection", st)
	}
}

// TestProduceThroughACutLink (F4): every connection of the producer cut
// with requests in flight, dials refused until the destination is seen
// failing, then healed.
func TestProduceThroughACutLink(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 12, count: 30000, size: 100, window: 5000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{pl.topic: pl.partitions}})
	link := devstack.NewLink()
	cfg := testConfig()
	cfg.Dialer = link
	r := newRecorder()
	p := newProducer(t, k, cfg, r)
	midStream(t, p, r, pl, link.Cut, link.Heal)
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 0 || st.Reconnected == 0 {
		t.Errorf("stats %+v: want no bump, reconnections", st)
	}
}

// TestProduceWhileLeadersMove (F6, produce side): on 3 brokers, a
// partition's leader moves after every 500 records given, with records
// in flight.
func TestProduceWhileLeadersMove(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 12, count: 30000, size: 100, window: 3000}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{pl.topic: pl.partitions}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	msgs := pl.messages()
	moves := 0
	for i := 0; i < len(msgs); i += 500 {
		feed(ctx, t, p, r, msgs[i:min(i+500, len(msgs))], pl.window)
		part, node := int32(moves%int(pl.partitions)), int32((moves/int(pl.partitions)+1+moves)%3)
		if err := k.Cluster().MoveTopicPartition(pl.topic, part, node); err != nil {
			t.Fatal(err)
		}
		moves++
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported, stats %+v)", err, r.settled(), pl.count, p.Stats())
	}
	st := p.Stats()
	t.Logf("%d leader moves, stats %+v", moves, st)
	r.check(t)
	verdict(t, k, pl)
	if st.Bumps != 0 || st.Retries == 0 {
		t.Errorf("stats %+v: want no bump, resends after the moves", st)
	}
}

// countHandler counts reports and closes done once want are in.
type countHandler struct {
	mu   sync.Mutex
	n    int
	want int
	done chan struct{}
}

func (h *countHandler) add(n int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n += n; h.n == h.want {
		close(h.done)
	}
}

func (h *countHandler) Acked(msgs []*kafka.Message, _ int64) { h.add(len(msgs)) }
func (h *countHandler) Refused(*kafka.Message, error)        { h.add(1) }
func (h *countHandler) reset(want int) {
	h.mu.Lock()
	h.n, h.want, h.done = 0, want, make(chan struct{})
	h.mu.Unlock()
}

// BenchmarkProduce produces the same records (150 B, 12 partitions,
// keys spread) with this producer, sarama's idempotent AsyncProducer
// (acks all; sarama allows it one request in flight) and a franz-go
// producer (idempotent, acks all, its defaults) on the same in-process
// kfake, and reports this producer's records/s and its ratio to each.
func BenchmarkProduce(b *testing.B) {
	const records, partitions = 50000, 12
	k, err := devstack.StartKafka("C", devstack.KafkaOptions{Topics: map[string]int32{"ours": partitions, "sarama": partitions, "franz": partitions}})
	if err != nil {
		b.Fatal(err)
	}
	defer k.Stop()
	val := value(0, 0, 150)
	h := &countHandler{}
	p, err := kafka.NewProducer(b.Context(), "C", cluster(k), kafka.DefaultProducerConfig(), h)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = p.Close(context.Background()) }()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Idempotent, sc.Producer.RequiredAcks, sc.Net.MaxOpenRequests = true, sarama.WaitForAll, 1
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sp, err := sarama.NewAsyncProducer(k.Brokers(), sc)
	if err != nil {
		b.Fatal(err)
	}
	defer sp.Close()
	fc, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		b.Fatal(err)
	}
	defer fc.Close()

	var ours, sar, franz time.Duration
	for b.Loop() {
		start := time.Now()
		h.reset(records)
		for i := range records {
			if err := p.Produce(&kafka.Message{Topic: "ours", Partition: int32(i % partitions), Key: strconv.AppendInt(nil, int64(i), 10), Value: val}); err != nil {
				b.Fatal(err)
			}
		}
		<-h.done
		ours += time.Since(start)

		start = time.Now()
		go func() {
			for i := range records {
				sp.Input() <- &sarama.ProducerMessage{Topic: "sarama", Partition: int32(i % partitions), Key: sarama.ByteEncoder(strconv.AppendInt(nil, int64(i), 10)), Value: sarama.ByteEncoder(val)}
			}
		}()
		for range records {
			select {
			case <-sp.Successes():
			case err := <-sp.Errors():
				b.Fatal(err)
			}
		}
		sar += time.Since(start)

		start = time.Now()
		for i := range records {
			fc.Produce(b.Context(), &kgo.Record{Topic: "franz", Partition: int32(i % partitions), Key: strconv.AppendInt(nil, int64(i), 10), Value: val}, func(_ *kgo.Record, err error) {
				if err != nil {
					b.Error(err)
				}
			})
		}
		if err := fc.Flush(b.Context()); err != nil {
			b.Fatal(err)
		}
		franz += time.Since(start)
	}
	b.ReportMetric(float64(b.N*records)/ours.Seconds(), "records/s")
	b.ReportMetric(sar.Seconds()/ours.Seconds(), "x_sarama")
	b.ReportMetric(franz.Seconds()/ours.Seconds(), "x_franz-go")
}

// TestProduceCloseOnAHungDestination: Close with requests in flight to a
// destination that answers nothing returns at its deadline, not after
// the read timeout, and hands back every unreported message.
func TestProduceCloseOnAHungDestination(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 4, count: 2000, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
	r := newRecorder()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	p, err := kafka.NewProducer(ctx, k.Name(), cluster(k), testConfig(), r)
	if err != nil {
		t.Fatal(err)
	}
	msgs := pl.messages()
	feed(ctx, t, p, r, msgs[:1000], 0)
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	k.Hang()
	defer k.Recover()
	feed(ctx, t, p, r, msgs[1000:], 0)
	waitStalledFor(t, p, pl.topic)
	closeCtx, cancelClose := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancelClose()
	start := time.Now()
	if err := p.Close(closeCtx); err != context.DeadlineExceeded {
		t.Errorf("Close: %v, want %v", err, context.DeadlineExceeded)
	}
	// The deadline, then closing sockets and joining goroutines: well
	// under the 6 s a hung request waits for its answer.
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Close took %s with a 500 ms deadline", d)
	}
	if err := p.Produce(msgs[0]); err != kafka.ErrProducerClosed {
		t.Errorf("Produce after Close: %v, want ErrProducerClosed", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.acked+r.left != pl.count || r.acked < 1000 {
		t.Errorf("%d acknowledged + %d unfinished, want %d in all and the first 1000 acknowledged", r.acked, r.left, pl.count)
	}
}

// waitStalledFor waits until p says topic's records wait unacknowledged.
func waitStalledFor(t *testing.T, p *kafka.Producer, topic string) {
	t.Helper()
	wait.For(t, 30*time.Second, "the destination seen failing", func() error {
		if st, ok := p.Stalled(topic, 500*time.Millisecond); !ok {
			return fmt.Errorf("not stalled (%+v)", st)
		}
		return nil
	})
}

// printer prints what a Producer reports.
type printer struct{}

func (p printer) Acked(msgs []*kafka.Message, offset int64) {
	for i, m := range msgs {
		fmt.Printf("%s/%d@%d %s\n", m.Topic, m.Partition, offset+int64(i), m.Value)
	}
}

func (p printer) Refused(m *kafka.Message, err error) { fmt.Printf("refused %s: %v\n", m.Value, err) }

// A Producer per destination cluster: the caller picks each record's
// partition (HashPartition for a key, as sarama's hash partitioner
// does), and learns per partition, in order, what was written where.
func ExampleProducer() {
	k, err := devstack.StartKafka("C", devstack.KafkaOptions{Topics: map[string]int32{"orders": 3}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer k.Stop()
	ctx := context.Background()
	p, err := kafka.NewProducer(ctx, "C", config.Cluster{Brokers: k.Brokers(), Version: config.DefaultKafkaVersion},
		kafka.DefaultProducerConfig(), printer{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Close(ctx)
	n, err := p.Partitions("orders")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, v := range []string{"first", "second", "third"} {
		key := []byte("customer-42")
		if err := p.Produce(&kafka.Message{Topic: "orders", Partition: kafka.HashPartition(key, n), Key: key, Value: []byte(v),
			Codec: sarama.CompressionZSTD}); err != nil {
			fmt.Println(err)
			return
		}
	}
	if err := p.Flush(ctx); err != nil {
		fmt.Println(err)
	}
	// Output:
	// orders/0@0 first
	// orders/0@1 second
	// orders/0@2 third
}

// TestProduceAcks: with acks leader and none (no producer id, one batch
// in flight per partition) every record is written once and in order
// when nothing fails; with acks leader a batch too large is split and
// the record too large refused as with acks all.
func TestProduceAcks(t *testing.T) {
	t.Parallel()
	for _, acks := range []sarama.RequiredAcks{sarama.WaitForLocal, sarama.NoResponse} {
		t.Run(fmt.Sprintf("acks=%d", acks), func(t *testing.T) {
			pl := plan{topic: "out", partitions: 12, count: 12000, size: 100, codecs: allCodecs, window: 3000}
			k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: pl.partitions}})
			cfg := testConfig()
			cfg.Acks = acks
			r := newRecorder()
			p := newProducer(t, k, cfg, r)
			produceAll(t, p, r, pl, time.Minute)
			r.check(t)
			// acks 0 reports a batch once written to the connection:
			// wait until the broker has appended the last ones.
			wait.For(t, 10*time.Second, "every record appended", func() error {
				n := int64(0)
				for _, end := range endOffsets(t.Context(), t, k, pl.topic, pl.partitions) {
					n += end
				}
				if n < int64(pl.count) {
					return fmt.Errorf("%d of %d", n, pl.count)
				}
				return nil
			})
			verdict(t, k, pl)
		})
	}
	t.Run("acks=1/too-large", func(t *testing.T) {
		pl := plan{topic: "small", partitions: 3, count: 300, size: 20 << 10, sizes: map[string]int{"2/77": 100 << 10}}
		k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{})
		createTopic(t, k, pl.topic, pl.partitions, map[string]string{"max.message.bytes": strconv.Itoa(64 << 10)})
		cfg := testConfig()
		cfg.Acks = sarama.WaitForLocal
		r := newRecorder()
		p := newProducer(t, k, cfg, r)
		produceAll(t, p, r, pl, time.Minute)
		r.check(t, "2/77")
		verdict(t, k, pl, "2/77")
	})
}

// TestProduceToATopicCreatedLater: records for a topic the cluster does
// not have wait (Stalled, with the error saying which partition has no
// leader), and are written once the topic is created.
func TestProduceToATopicCreatedLater(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "later", partitions: 3, count: 300, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	feed(ctx, t, p, r, pl.messages(), 0)
	wait.For(t, 30*time.Second, "records for the missing topic seen waiting", func() error {
		st, ok := p.Stalled(pl.topic, 0)
		if !ok || st.Err == nil || !strings.Contains(st.Err.Error(), "leader of later/") {
			return fmt.Errorf("stalled %v: %+v", ok, st)
		}
		return nil
	})
	if err := k.CreateTopic(pl.topic, pl.partitions); err != nil {
		t.Fatal(err)
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (stats %+v)", err, p.Stats())
	}
	r.check(t)
	verdict(t, k, pl)
}

// TestProduceBumpKeepsAnUnsureBatch: partition 0's batch is written but
// answered REQUEST_TIMED_OUT, and its resend refused NOT_LEADER (as Kafka
// answers once the leader moved after replicating the first send); the
// refusal says nothing about the first send, so the bump partition 1's
// OUT_OF_ORDER_SEQUENCE asks for waits until the batch is resent under its
// old sequence (answered as a duplicate) instead of renumbering it under
// the new producer id: partition 0 holds it once.
func TestProduceBumpKeepsAnUnsureBatch(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 2, count: 2, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: 2}})
	k.Cluster().Fault(
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.RequestTimedOut},
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.NotLeaderForPartition},
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{1}, Err: kerr.OutOfOrderSequenceNumber},
	)
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	produceAll(t, p, r, pl, 30*time.Second)
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 1 {
		t.Errorf("stats %+v, want 1 bump", st)
	}
}

// TestProduceRefusedAfterAnUnansweredSend: a one-record batch written
// but answered REQUEST_TIMED_OUT, whose resend is refused
// MESSAGE_TOO_LARGE (a check Kafka runs before its duplicate check, as
// after max.message.bytes was lowered), is reported refused with an error
// saying it may have been written, and the record behind it is written
// under a new producer id, not answered as a duplicate of the refused
// one's sequence and lost.
func TestProduceRefusedAfterAnUnansweredSend(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 1, count: 2, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: 1}})
	k.Cluster().Fault(
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.RequestTimedOut},
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.MessageTooLarge},
	)
	cfg := testConfig()
	cfg.BatchRecords = 1
	r := newRecorder()
	p := newProducer(t, k, cfg, r)
	produceAll(t, p, r, pl, 30*time.Second)
	r.check(t, "0/0")
	r.mu.Lock()
	err := r.lastRefusal
	r.mu.Unlock()
	if !errors.Is(err, sarama.ErrMessageSizeTooLarge) || !strings.Contains(err.Error(), "may have been written") {
		t.Errorf("refusal %v, want MESSAGE_TOO_LARGE saying the record may have been written", err)
	}
	verdict(t, k, pl) // the refused record is in the log (kfake applied the first send), once
	if st := p.Stats(); st.Bumps != 1 {
		t.Errorf("stats %+v, want 1 bump", st)
	}
}

// TestProduceBumpRetriesInitProducerID: the InitProducerID of a bump
// fails (CLUSTER_AUTHORIZATION_FAILED, until the test removes the fault):
// Stalled names the error, and once InitProducerID answers again the
// bump is made and every record written once.
func TestProduceBumpRetriesInitProducerID(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 1, count: 2, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: 1}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	init := k.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, TopLevel: true, Err: kerr.ClusterAuthorizationFailed, Count: -1})
	k.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.OutOfOrderSequenceNumber})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	feed(ctx, t, p, r, pl.messages(), pl.window)
	wait.For(t, 10*time.Second, "the failed bump seen by Stalled", func() error {
		st, _ := p.Stalled(pl.topic, 0)
		if !errors.Is(st.Err, sarama.ErrClusterAuthorizationFailed) || init.Hits() < 2 {
			return fmt.Errorf("stall %+v after %d InitProducerID refused", st, init.Hits())
		}
		return nil
	})
	init.Remove()
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported, stats %+v)", err, r.settled(), pl.count, p.Stats())
	}
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 1 {
		t.Errorf("stats %+v, want 1 bump", st)
	}
}

// TestProduceCloseWhileLookingLeadersUp: the resolver looks up the
// leaders of a missing topic's partitions on a hung cluster, one metadata
// refresh each (up to the client's 5 s read timeout apiece): Close with a
// 500 ms deadline returns at it with DeadlineExceeded, and the resolver
// returns by itself after its current call.
func TestProduceCloseWhileLookingLeadersUp(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"out": 1}})
	r := newRecorder()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	p, err := kafka.NewProducer(ctx, k.Name(), cluster(k), testConfig(), r)
	if err != nil {
		t.Fatal(err)
	}
	k.Hang()
	defer k.Recover()
	for i := range int32(4) {
		if err := p.Produce(&kafka.Message{Topic: "missing", Partition: i, Value: []byte("x"), Ref: ref{i, 0}}); err != nil {
			t.Fatal(err)
		}
	}
	wait.For(t, 10*time.Second, "the partitions seen waiting", func() error {
		if _, ok := p.Stalled("missing", 100*time.Millisecond); !ok {
			return errors.New("not stalled")
		}
		return nil
	})
	cctx, ccancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer ccancel()
	start := time.Now()
	if err := p.Close(cctx); err != context.DeadlineExceeded {
		t.Errorf("Close: %v, want %v", err, context.DeadlineExceeded)
	}
	// The deadline, then closing sockets: well under the 5 s one
	// metadata call may wait on the hung broker.
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Close took %s with a 500 ms deadline", d)
	}
	r.mu.Lock()
	if r.left != 4 {
		t.Errorf("%d messages unfinished, want 4", r.left)
	}
	r.mu.Unlock()
	select {
	case <-kafka.ProducerDone(p): // one refresh (5 s read timeout, 3 s dial) at most after Close
	case <-time.After(30 * time.Second):
		t.Fatal("the resolver did not return within 30 s of Close")
	}
}

// TestProduceOldBrokerOneBatchInFlight: a broker whose Produce stops at
// v3 (Kafka 0.11, which recognises a resend of a producer's last batch
// only, not of its last 5) gets one batch of a partition in flight at a
// time, and every record is written once, in order.
func TestProduceOldBrokerOneBatchInFlight(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 2, count: 3000, size: 100}
	vs := kversion.Stable()
	vs.SetMaxKeyVersion(int16(kmsg.Produce), 3)
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.MaxVersions(vs), kfake.SeedTopics(pl.partitions, pl.topic))
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	cfg := testConfig()
	cfg.BatchRecords = 10
	r := newRecorder()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	p, err := kafka.NewProducer(ctx, "old", config.Cluster{Brokers: kc.ListenAddrs(), Version: config.DefaultKafkaVersion}, cfg, r)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := p.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	}()
	feed(ctx, t, p, r, pl.messages(), pl.window)
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported)", err, r.settled(), pl.count)
	}
	r.check(t)
	if n := kafka.MaxPartitionInFlight(p); n != 1 {
		t.Errorf("up to %d batches of a partition in flight on Produce v3, want 1", n)
	}
	// Read back: each partition holds its records once, in order.
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.ListenAddrs()...), kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{
		pl.topic: {0: kgo.NewOffset().AtStart(), 1: kgo.NewOffset().AtStart()}}))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	next := map[int32]int{}
	for got := 0; got < pl.count; {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read back %d of %d records: %v", got, pl.count, err)
		}
		fs.EachRecord(func(rec *kgo.Record) {
			if want := fmt.Sprintf("%d/%d", rec.Partition, next[rec.Partition]); prefix(rec.Value) != want {
				t.Fatalf("partition %d: read %s, want %s", rec.Partition, prefix(rec.Value), want)
			}
			next[rec.Partition]++
			got++
		})
	}
}

// TestProduceCorruptMessageRetried: CORRUPT_MESSAGE (a CRC mismatch on
// the way) is sent again, not refused: every record written once.
func TestProduceCorruptMessageRetried(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 1, count: 2, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: 1}})
	k.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.CorruptMessage})
	cfg := testConfig()
	cfg.BatchRecords = 1
	r := newRecorder()
	p := newProducer(t, k, cfg, r)
	produceAll(t, p, r, pl, 30*time.Second)
	r.check(t)
	verdict(t, k, pl)
}

// countingHandler counts acknowledged messages and keeps none of them.
type countingHandler struct{ acked, refused atomic.Int64 }

func (h *countingHandler) Acked(msgs []*kafka.Message, _ int64) { h.acked.Add(int64(len(msgs))) }
func (h *countingHandler) Refused(*kafka.Message, error)        { h.refused.Add(1) }

// TestProduceKeepsNoAcknowledgedMessage: once acknowledged, a message is
// not reachable from the Producer, so the bytes its value slices (in the
// agent, a whole fetched response) are freed while the producer goes on.
// 20 000 values over 4 partitions, batches of at most 50 records; after
// the acks and a collection, every value is freed but a handful of the
// last (each partition's last batch may still be referenced from the
// sink's goroutine until its next request).
func TestProduceKeepsNoAcknowledgedMessage(t *testing.T) {
	const n, parts = 20000, 4
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"out": parts}})
	cfg := testConfig()
	cfg.BatchRecords = 50
	h := &countingHandler{}
	p, err := kafka.NewProducer(t.Context(), k.Name(), cluster(k), cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = p.Close(ctx)
	}()
	var freed atomic.Int64
	for i := range n {
		v := make([]byte, 100)
		runtime.AddCleanup(&v[0], func(*atomic.Int64) { freed.Add(1) }, &freed)
		if err := p.Produce(&kafka.Message{Topic: "out", Partition: int32(i % parts), Value: v, Timestamp: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	wait.For(t, time.Minute, "every message acknowledged", func() error {
		if a := h.acked.Load(); a != n || h.refused.Load() != 0 {
			return fmt.Errorf("%d of %d acknowledged, %d refused", a, n, h.refused.Load())
		}
		return nil
	})
	const kept = parts * 2 * 50 // a batch in flight and one being settled, per partition
	wait.For(t, 10*time.Second, "the acknowledged values freed", func() error {
		runtime.GC()
		if f := freed.Load(); f < n-kept {
			return fmt.Errorf("%d of %d values freed (at most %d may stay)", f, n, kept)
		}
		return nil
	})
}
