package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// The transactional stream's tests (docs/RELAY.md §4, F10, F11 at package
// level). Each ends with the verdict read back by a read_committed franz-go
// reader: every committed record exactly once and in order per partition,
// nothing of an aborted transaction.

func openTxn(t *testing.T, p *kafka.Producer, id string) *kafka.TxnStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	s, err := p.OpenTxn(ctx, kafka.DefaultTxnConfig(id))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Close(ctx); err != nil {
			t.Errorf("Close of stream %s: %v", id, err)
		}
	})
	return s
}

// records returns records from..to-1 of a stream spread over partitions
// (record i to partition i % partitions), numbered per partition.
func records(topic string, partitions int32, from, to int) []*kafka.Message {
	var msgs []*kafka.Message
	for i := from; i < to; i++ {
		p := int32(i) % partitions
		n := i / int(partitions)
		msgs = append(msgs, &kafka.Message{Topic: topic, Partition: p, Key: fmt.Appendf(nil, "%d", i), Value: value(p, n, 60), Ref: ref{p, n}})
	}
	return msgs
}

func produceTxn(t *testing.T, s *kafka.TxnStream, msgs []*kafka.Message) {
	t.Helper()
	for _, m := range msgs {
		if err := s.Produce(m); err != nil {
			t.Fatalf("Produce %s: %v", prefix(m.Value), err)
		}
	}
}

func commit(t *testing.T, s *kafka.TxnStream, last *kafka.Message) []*kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	msgs, err := s.Commit(ctx, last)
	if err != nil {
		t.Fatalf("Commit: %v (stats %+v)", err, s.Stats())
	}
	return msgs
}

// prefixes lists the values' prefixes per partition, in order.
func prefixes(msgs []*kafka.Message) map[int32][]string {
	out := map[int32][]string{}
	for _, m := range msgs {
		out[m.Partition] = append(out[m.Partition], prefix(m.Value))
	}
	return out
}

// committedVerdict writes an end marker (not transactional) to each
// partition of topic, then reads the topic read_committed from its start
// up to the markers, and checks each partition holds exactly want's
// records in order: the markers come after every transaction that ended
// before them, so nothing committed can be missed.
func committedVerdict(t *testing.T, k *devstack.Kafka, topic string, partitions int32, want map[int32][]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	w, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	for p := range partitions {
		if err := w.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: p, Value: []byte("end")}).FirstErr(); err != nil {
			w.Close()
			t.Fatalf("end marker to %s/%d: %v", topic, p, err)
		}
	}
	w.Close()
	offsets := map[int32]kgo.Offset{}
	for p := range partitions {
		offsets[p] = kgo.NewOffset().AtStart()
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: offsets}))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got := map[int32][]string{}
	ended := map[int32]bool{}
	for len(ended) < int(partitions) {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read back %s: %v (ended %v)", topic, err, ended)
		}
		fs.EachError(func(topic string, p int32, err error) { t.Logf("read back %s/%d: %v", topic, p, err) })
		fs.EachRecord(func(rec *kgo.Record) {
			if string(rec.Value) == "end" {
				ended[rec.Partition] = true
				return
			}
			if ended[rec.Partition] {
				t.Errorf("%s/%d@%d: %s after the end marker", topic, rec.Partition, rec.Offset, rec.Value)
			}
			got[rec.Partition] = append(got[rec.Partition], prefix(rec.Value))
		})
	}
	n := 0
	for p := range partitions {
		if g, w := got[p], want[p]; !slices.Equal(g, w) {
			t.Errorf("%s/%d holds %d committed records, want %d: %s", topic, p, len(g), len(w), firstDiff(g, w))
		}
		n += len(got[p])
	}
	t.Logf("read back %d committed records of %s", n, topic)
}

// writtenAtLeast waits until topic's partitions hold n records in all,
// committed or not (the high watermarks): the batches were written.
func writtenAtLeast(t *testing.T, k *devstack.Kafka, topic string, partitions int32, n int64) {
	t.Helper()
	wait.For(t, 30*time.Second, fmt.Sprintf("%d records written to %s", n, topic), func() error {
		var sum int64
		for _, end := range endOffsets(t.Context(), t, k, topic, partitions) {
			sum += end
		}
		if sum < n {
			return fmt.Errorf("%d written", sum)
		}
		return nil
	})
}

// TestTxnCommits: 6 000 records over 6 partitions given by one goroutine
// while another commits every 5 ms, a position record in a topic of its
// own in each transaction: each Commit returns its records in order, the
// records given during a commit are in the next, and read_committed sees
// every record once in order.
func TestTxnCommits(t *testing.T) {
	t.Parallel()
	const topic, positions, parts, count = "out", "positions", 6, 6000
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{topic: parts, positions: 1}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/0")
	msgs := records(topic, parts, 0, count)
	var committed atomic.Int64
	progress := make(chan struct{}, 1)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		for i, m := range msgs {
			for int64(i)-committed.Load() >= 500 {
				select {
				case <-progress:
				case <-ctx.Done():
					return
				}
			}
			if err := s.Produce(m); err != nil {
				t.Errorf("Produce: %v", err)
				return
			}
		}
	})
	var got []*kafka.Message
	var pos []string
	txns := 0
	tick := time.NewTicker(5 * time.Millisecond) // the transaction interval
	defer tick.Stop()
	for committed.Load() < count && ctx.Err() == nil {
		pm := &kafka.Message{Topic: positions, Value: fmt.Appendf(nil, "0/%d", len(pos))}
		c := commit(t, s, pm)
		if len(c) == 0 || c[len(c)-1] != pm {
			t.Fatalf("transaction %d: %d records, the position record not last", txns, len(c))
		}
		pos = append(pos, prefix(pm.Value))
		got = append(got, c[:len(c)-1]...)
		committed.Store(int64(len(got)))
		select {
		case progress <- struct{}{}:
		default:
		}
		txns++
		select {
		case <-tick.C:
		case <-ctx.Done():
		}
	}
	wg.Wait()
	if len(got) != count {
		t.Fatalf("%d records committed, want %d", len(got), count)
	}
	for i, m := range got {
		if m != msgs[i] {
			t.Fatalf("committed record %d is %s, want %s: out of the order given", i, prefix(m.Value), prefix(msgs[i].Value))
		}
	}
	if st := s.Stats(); st.Aborts != 0 || st.Commits != int64(txns) {
		t.Errorf("stats %+v, want %d commits and no abort", st, txns)
	}
	t.Logf("%d transactions, stats %+v", txns, s.Stats())
	committedVerdict(t, k, topic, parts, prefixes(msgs))
	committedVerdict(t, k, positions, 1, map[int32][]string{0: pos})
}

// TestTxnAbortThenCommit: a transaction's records are written, then
// aborted (Abort returns them); the same records given again are
// committed: each once, nothing of the aborted transaction visible.
func TestTxnAbortThenCommit(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 6
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/1")
	first := records(topic, parts, 0, 600)
	produceTxn(t, s, first)
	writtenAtLeast(t, k, topic, parts, 600)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	dropped, err := s.Abort(ctx)
	if err != nil {
		t.Fatalf("Abort: %v", err)
	}
	if len(dropped) != len(first) {
		t.Fatalf("Abort returned %d records, want %d", len(dropped), len(first))
	}
	again := records(topic, parts, 0, 600)
	produceTxn(t, s, again)
	if c := commit(t, s, nil); len(c) != len(again) {
		t.Fatalf("committed %d records, want %d", len(c), len(again))
	}
	if st := s.Stats(); st.Aborts != 1 || st.Bumps != 1 || st.Commits != 1 {
		t.Errorf("stats %+v, want 1 abort, 1 bump, 1 commit", st)
	}
	committedVerdict(t, k, topic, parts, prefixes(again))
}

// TestTxnProduceRefusedAborts: a produce inside the transaction is
// answered OUT_OF_ORDER_SEQUENCE_NUMBER (abortable, §4: no drain-and-bump
// inside a transaction): Commit aborts, bumps the epoch and returns
// ErrTxnAborted; the next Commit commits the same records, each once.
func TestTxnProduceRefusedAborts(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 6
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/2")
	before := records(topic, parts, 0, 600)
	produceTxn(t, s, before)
	commit(t, s, nil)
	h := k.Cluster().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Partitions: []int32{2}, Err: kerr.OutOfOrderSequenceNumber})
	msgs := records(topic, parts, 600, 1200)
	produceTxn(t, s, msgs)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err := s.Commit(ctx, nil)
	var aerr *kafka.TxnAbortedError
	if !errors.As(err, &aerr) || !errors.Is(err, kafka.ErrTxnAborted) {
		t.Fatalf("Commit: %v, want ErrTxnAborted for OUT_OF_ORDER_SEQUENCE_NUMBER", err)
	}
	if h.Hits() != 1 || len(aerr.Refused) != 0 {
		t.Errorf("fault hits %d, refused %d: want 1, 0", h.Hits(), len(aerr.Refused))
	}
	if c := commit(t, s, nil); len(c) != len(msgs) {
		t.Fatalf("committed %d records after the abort, want %d", len(c), len(msgs))
	}
	if st := s.Stats(); st.Aborts != 1 || st.Bumps != 1 || st.Commits != 2 {
		t.Errorf("stats %+v, want 1 abort, 1 bump, 2 commits", st)
	}
	committedVerdict(t, k, topic, parts, prefixes(append(before, msgs...)))
}

// TestTxnFenced (F11 at package level): a second OpenTxn of the id fences
// the first stream: its commit reports ErrTxnFenced, it refuses records
// from then on, and its open transaction's records (written) are never
// visible; the second stream's commit is.
func TestTxnFenced(t *testing.T) {
	t.Parallel()
	const topic, parts, id = "out", 6, "kswitch/test/C/in/A/3"
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	old := openTxn(t, p, id)
	txn1 := records(topic, parts, 0, 300)
	produceTxn(t, old, txn1)
	commit(t, old, nil)
	produceTxn(t, old, records(topic, parts, 300, 600))
	writtenAtLeast(t, k, topic, parts, 600)
	owner := openTxn(t, p, id)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := old.Commit(ctx, nil); !errors.Is(err, kafka.ErrTxnFenced) {
		t.Fatalf("the fenced stream's Commit: %v, want ErrTxnFenced", err)
	}
	if err := old.Produce(records(topic, parts, 600, 601)[0]); !errors.Is(err, kafka.ErrTxnFenced) {
		t.Fatalf("the fenced stream's Produce: %v, want ErrTxnFenced", err)
	}
	txn3 := records(topic, parts, 300, 900) // the new owner sends the open transaction's records again
	produceTxn(t, owner, txn3)
	commit(t, owner, nil)
	committedVerdict(t, k, topic, parts, prefixes(append(txn1, txn3...)))
}

// TestTxnCoordinatorMoved (F10): AddPartitionsToTxn and EndTxn answered
// NOT_COORDINATOR once each, and the coordinators rehashed between
// transactions on 3 brokers: every transaction commits (the stream finds
// the coordinator again and resends), every record once.
func TestTxnCoordinatorMoved(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 6
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/4")
	c := k.Cluster()
	add := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.AddPartitionsToTxn}, Topic: topic, Err: kerr.NotCoordinator})
	end := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.EndTxn}, TopLevel: true, Err: kerr.NotCoordinator})
	var all []*kafka.Message
	for i := range 10 {
		msgs := records(topic, parts, i*120, (i+1)*120)
		produceTxn(t, s, msgs)
		if got := commit(t, s, nil); len(got) != len(msgs) {
			t.Fatalf("transaction %d: %d committed, want %d", i, len(got), len(msgs))
		}
		all = append(all, msgs...)
		c.RehashCoordinators()
	}
	if add.Hits() != 1 || end.Hits() != 1 {
		t.Errorf("NOT_COORDINATOR answered %d times to AddPartitionsToTxn, %d to EndTxn; want 1 and 1", add.Hits(), end.Hits())
	}
	if st := s.Stats(); st.Commits != 10 || st.Aborts != 0 {
		t.Errorf("stats %+v, want 10 commits, no abort", st)
	}
	committedVerdict(t, k, topic, parts, prefixes(all))
}

// TestTxnBrokenCommit: the connection is lost with EndTxn commit
// unanswered: Commit reports ErrTxnBroken (the outcome is unknown); the
// id opened again aborts what was not committed, and the records sent
// again in it are committed once.
func TestTxnBrokenCommit(t *testing.T) {
	t.Parallel()
	const topic, parts, id = "out", 6, "kswitch/test/C/in/A/5"
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, id)
	msgs := records(topic, parts, 0, 600)
	produceTxn(t, s, msgs)
	k.Cluster().ControlKey(int16(kmsg.EndTxn), func(kmsg.Request) (kmsg.Response, error, bool) {
		return nil, errors.New("connection cut by the test"), true
	})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := s.Commit(ctx, nil); !errors.Is(err, kafka.ErrTxnBroken) {
		t.Fatalf("Commit with EndTxn unanswered: %v, want ErrTxnBroken", err)
	}
	if err := s.Produce(msgs[0]); !errors.Is(err, kafka.ErrTxnBroken) {
		t.Fatalf("Produce on a broken stream: %v, want ErrTxnBroken", err)
	}
	again := openTxn(t, p, id)
	resend := records(topic, parts, 0, 600)
	produceTxn(t, again, resend)
	commit(t, again, nil)
	committedVerdict(t, k, topic, parts, prefixes(resend))
}

// TestTxnRecordRefusedForGood: a record larger than the topic takes (64
// KiB max.message.bytes, one record of 100 KiB among 1 KiB ones): its
// batch is split down to it, it is refused, and the transaction is
// aborted; Commit's TxnAbortedError names it, and the next Commit
// commits every other record once, in order.
func TestTxnRecordRefusedForGood(t *testing.T) {
	t.Parallel()
	const topic, parts = "small", 3
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{})
	createTopic(t, k, topic, parts, map[string]string{"max.message.bytes": "65536"})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/6")
	msgs := records(topic, parts, 0, 300)
	for _, m := range msgs {
		m.Value = value(m.Partition, m.Ref.(ref).n, 1024)
	}
	big := msgs[151] // partition 1, record 50
	big.Value = value(big.Partition, big.Ref.(ref).n, 100<<10)
	produceTxn(t, s, msgs)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	_, err := s.Commit(ctx, nil)
	var aerr *kafka.TxnAbortedError
	if !errors.As(err, &aerr) || len(aerr.Refused) != 1 || aerr.Refused[0] != big {
		t.Fatalf("Commit: %v, want ErrTxnAborted with %s refused", err, prefix(big.Value))
	}
	rest := slices.DeleteFunc(slices.Clone(msgs), func(m *kafka.Message) bool { return m == big })
	if c := commit(t, s, nil); !slices.Equal(c, rest) {
		t.Fatalf("committed %d records, want the %d others in the order given", len(c), len(rest))
	}
	committedVerdict(t, k, topic, parts, prefixes(rest))
}

// TestTxnOpenRetries: OpenTxn finds the coordinator again and retries
// InitProducerID while it is answered COORDINATOR_NOT_AVAILABLE,
// CONCURRENT_TRANSACTIONS, COORDINATOR_LOAD_IN_PROGRESS; answered so for
// longer than RetryTimeout it fails, saying why.
func TestTxnOpenRetries(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 3
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	c := k.Cluster()
	find := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.FindCoordinator}, TopLevel: true, Err: kerr.CoordinatorNotAvailable})
	initID := c.Fault(
		kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, TopLevel: true, Err: kerr.ConcurrentTransactions, Count: 2},
		kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, TopLevel: true, Err: kerr.CoordinatorLoadInProgress})
	s := openTxn(t, p, "kswitch/test/C/in/A/7")
	if find.Hits() != 1 || initID.Hits() != 3 {
		t.Errorf("faults hit: FindCoordinator %d, InitProducerID %d; want 1 and 3", find.Hits(), initID.Hits())
	}
	msgs := records(topic, parts, 0, 60)
	produceTxn(t, s, msgs)
	commit(t, s, nil)
	committedVerdict(t, k, topic, parts, prefixes(msgs))

	forever := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, TopLevel: true, Err: kerr.ConcurrentTransactions, Count: -1})
	defer forever.Remove()
	cfg := kafka.DefaultTxnConfig("kswitch/test/C/in/A/8")
	cfg.RetryTimeout = 300 * time.Millisecond
	start := time.Now()
	_, err := p.OpenTxn(t.Context(), cfg)
	if !errors.Is(err, sarama.ErrConcurrentTransactions) {
		t.Fatalf("OpenTxn answered CONCURRENT_TRANSACTIONS for good: %v, want an error wrapping it", err)
	}
	t.Logf("OpenTxn: %v", err)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("OpenTxn gave up after %s, RetryTimeout %s", took, cfg.RetryTimeout)
	}
}

// BenchmarkTxn produces the same records (150 B, 12 partitions, 10
// transactions of 5 000 per round) through a TxnStream and through
// sarama's transactional AsyncProducer (today's exactly_once path), and
// the same records without transactions through the idempotent
// Producer, on the same in-process kfake; it reports the stream's
// records/s and its ratios to both.
func BenchmarkTxn(b *testing.B) {
	const records, partitions, perTxn = 50000, 12, 5000
	k, err := devstack.StartKafka("C", devstack.KafkaOptions{Topics: map[string]int32{"txn": partitions, "idem": partitions, "sarama": partitions}})
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
	s, err := p.OpenTxn(b.Context(), kafka.DefaultTxnConfig("bench"))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = s.Close(context.Background()) }()
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Producer.Idempotent, sc.Producer.RequiredAcks, sc.Net.MaxOpenRequests = true, sarama.WaitForAll, 1
	sc.Producer.Transaction.ID = "bench-sarama"
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	sp, err := sarama.NewAsyncProducer(k.Brokers(), sc)
	if err != nil {
		b.Fatal(err)
	}
	defer sp.Close()
	msg := func(topic string, i int) *kafka.Message {
		return &kafka.Message{Topic: topic, Partition: int32(i % partitions), Key: strconv.AppendInt(nil, int64(i), 10), Value: val}
	}

	var txn, idem, sar time.Duration
	for b.Loop() {
		start := time.Now()
		for i := range records {
			if err := s.Produce(msg("txn", i)); err != nil {
				b.Fatal(err)
			}
			if (i+1)%perTxn == 0 {
				if _, err := s.Commit(b.Context(), nil); err != nil {
					b.Fatal(err)
				}
			}
		}
		txn += time.Since(start)

		start = time.Now()
		h.reset(records)
		for i := range records {
			if err := p.Produce(msg("idem", i)); err != nil {
				b.Fatal(err)
			}
		}
		<-h.done
		idem += time.Since(start)

		start = time.Now()
		for n := 0; n < records; n += perTxn {
			if err := sp.BeginTxn(); err != nil {
				b.Fatal(err)
			}
			go func() {
				for i := n; i < n+perTxn; i++ {
					sp.Input() <- &sarama.ProducerMessage{Topic: "sarama", Partition: int32(i % partitions), Key: sarama.ByteEncoder(strconv.AppendInt(nil, int64(i), 10)), Value: sarama.ByteEncoder(val)}
				}
			}()
			for range perTxn {
				select {
				case <-sp.Successes():
				case err := <-sp.Errors():
					b.Fatal(err)
				}
			}
			if err := sp.CommitTxn(); err != nil {
				b.Fatal(err)
			}
		}
		sar += time.Since(start)
	}
	b.ReportMetric(float64(b.N*records)/txn.Seconds(), "records/s")
	b.ReportMetric(idem.Seconds()/txn.Seconds(), "x_idempotent")
	b.ReportMetric(sar.Seconds()/txn.Seconds(), "x_sarama_txn")
}

// TestTxnRecordsGivenDuringACommitAreInTheNext: records given while a
// commit waits for EndTxn (held by the cluster) are not in that
// transaction: Commit returns only the first records, Abort of the next
// transaction returns the others, and only the first are visible.
func TestTxnRecordsGivenDuringACommitAreInTheNext(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 6
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/9")
	first := records(topic, parts, 0, 600)
	produceTxn(t, s, first)
	c := k.Cluster()
	held, release := make(chan struct{}), make(chan struct{})
	c.ControlKey(int16(kmsg.EndTxn), func(kmsg.Request) (kmsg.Response, error, bool) {
		close(held)
		c.SleepControl(func() { <-release })
		c.DropControl()        // for this EndTxn only
		return nil, nil, false // then answered as usual
	})
	type result struct {
		msgs []*kafka.Message
		err  error
	}
	done := make(chan result, 1)
	go func() {
		msgs, err := s.Commit(t.Context(), nil)
		done <- result{msgs, err}
	}()
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		close(release)
		t.Fatal("no EndTxn within 30 s")
	}
	second := records(topic, parts, 600, 1200)
	produceTxn(t, s, second)
	close(release)
	r := <-done
	if r.err != nil || !slices.Equal(r.msgs, first) {
		t.Fatalf("Commit: %d records, %v; want the %d given before it", len(r.msgs), r.err, len(first))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	dropped, err := s.Abort(ctx)
	if err != nil || !slices.Equal(dropped, second) {
		t.Fatalf("Abort: %d records, %v; want the %d given during the commit", len(dropped), err, len(second))
	}
	committedVerdict(t, k, topic, parts, prefixes(first))
}

// TestTxnAbortGivenUpIsNotACommit: an Abort whose caller gave up while
// its EndTxn was held goes on; a Commit meanwhile is refused
// (ErrTxnOtherPending) instead of being handed the Abort's records as
// committed; the next Abort returns them, and a later transaction commits
// with none of them visible.
func TestTxnAbortGivenUpIsNotACommit(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 3
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/11")
	aborted := records(topic, parts, 0, 300)
	produceTxn(t, s, aborted)
	writtenAtLeast(t, k, topic, parts, 300) // in the open transaction: its abort needs an EndTxn
	c := k.Cluster()
	held, release := make(chan struct{}), make(chan struct{})
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	var once sync.Once
	c.ControlKey(int16(kmsg.EndTxn), func(kmsg.Request) (kmsg.Response, error, bool) {
		once.Do(func() { close(held) }) // an EndTxn timed out is sent again
		c.SleepControl(func() { <-release })
		c.DropControl()        // for this EndTxn only
		return nil, nil, false // then answered as usual
	})
	gaveUp, cancel := context.WithCancel(t.Context())
	go func() { // ends with the test if no EndTxn is held
		select {
		case <-held:
		case <-gaveUp.Done():
		}
		cancel()
	}()
	if _, err := s.Abort(gaveUp); !errors.Is(err, context.Canceled) {
		t.Fatalf("Abort given up: %v, want context.Canceled", err)
	}
	meanwhile, stopWaiting := context.WithTimeout(t.Context(), 5*time.Second)
	defer stopWaiting()
	if msgs, err := s.Commit(meanwhile, nil); !errors.Is(err, kafka.ErrTxnOtherPending) {
		t.Fatalf("Commit while the Abort goes on: %d records, %v; want ErrTxnOtherPending", len(msgs), err)
	}
	close(release)
	ctx, stop := context.WithTimeout(t.Context(), 30*time.Second)
	defer stop()
	dropped, err := s.Abort(ctx)
	if err != nil || !slices.Equal(dropped, aborted) {
		t.Fatalf("Abort again: %d records, %v; want the %d of the Abort given up", len(dropped), err, len(aborted))
	}
	later := records(topic, parts, 300, 600)
	produceTxn(t, s, later)
	if got := commit(t, s, nil); !slices.Equal(got, later) {
		t.Fatalf("Commit: %d records, want the %d given after the Abort", len(got), len(later))
	}
	committedVerdict(t, k, topic, parts, prefixes(later))
}

// deadBroker is the producer's Dialer in TestTxnCoordinatorRemoved: once
// kill names a broker's address, its connections are closed and dials to
// it refused, as for a broker that went down.
type deadBroker struct {
	mu    sync.Mutex
	dead  string
	conns map[string][]net.Conn
}

func (d *deadBroker) Dial(network, addr string) (net.Conn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if addr == d.dead {
		return nil, fmt.Errorf("dial %s: broker gone (test)", addr)
	}
	c, err := net.DialTimeout(network, addr, 5*time.Second)
	if err == nil {
		d.conns[addr] = append(d.conns[addr], c)
	}
	return c, err
}

func (d *deadBroker) kill(addr string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dead = addr
	for _, c := range d.conns[addr] {
		_ = c.Close()
	}
}

// TestTxnCoordinatorRemoved (F10, the coordinator's broker gone): on 3
// brokers the id's coordinator is removed from the cluster between two
// transactions (its partitions led by the others), and the producer's
// connections to it are closed and refused from then on: the stream finds
// the new coordinator and the leaders, and the next 5 transactions
// commit, every record once.
func TestTxnCoordinatorRemoved(t *testing.T) {
	t.Parallel()
	const topic, parts, id = "out", 6, "kswitch/test/C/in/A/10"
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{topic: parts}})
	d := &deadBroker{conns: map[string][]net.Conn{}}
	cfg := testConfig()
	cfg.Dialer = d
	p := newProducer(t, k, cfg, newRecorder())
	s := openTxn(t, p, id)
	all := records(topic, parts, 0, 120)
	produceTxn(t, s, all)
	commit(t, s, nil)

	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	req := kmsg.NewPtrFindCoordinatorRequest()
	req.CoordinatorKey, req.CoordinatorType = id, 1
	resp, err := req.RequestWith(t.Context(), cl)
	cl.Close()
	if err != nil || resp.ErrorCode != 0 {
		t.Fatalf("FindCoordinator: %v, code %d", err, resp.ErrorCode)
	}
	if err := k.Cluster().RemoveNode(resp.NodeID); err != nil {
		t.Fatal(err)
	}
	d.kill(net.JoinHostPort(resp.Host, strconv.Itoa(int(resp.Port))))
	t.Logf("removed broker %d (%s:%d), the coordinator", resp.NodeID, resp.Host, resp.Port)
	for i := 1; i <= 5; i++ {
		msgs := records(topic, parts, i*120, (i+1)*120)
		produceTxn(t, s, msgs)
		if got := commit(t, s, nil); len(got) != len(msgs) {
			t.Fatalf("transaction %d: %d committed, want %d", i, len(got), len(msgs))
		}
		all = append(all, msgs...)
	}
	t.Logf("stats %+v", s.Stats())
	committedVerdict(t, k, topic, parts, prefixes(all))
}

// TestTxnCommitLastToAPartitionInTheTransaction: Commit's last message
// goes to a partition already in the transaction, whose batches were all
// acknowledged: it is sent (its sink woken) and committed last.
func TestTxnCommitLastToAPartitionInTheTransaction(t *testing.T) {
	t.Parallel()
	const topic, parts = "out", 6
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{topic: parts}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/11")
	msgs := records(topic, parts, 0, 60)
	produceTxn(t, s, msgs)
	writtenAtLeast(t, k, topic, parts, 60)
	last := records(topic, parts, 60, 61)[0] // partition 0, record 10
	got := commit(t, s, last)
	if want := append(slices.Clone(msgs), last); !slices.Equal(got, want) {
		t.Fatalf("committed %d records, want %d with the last one last", len(got), len(want))
	}
	committedVerdict(t, k, topic, parts, prefixes(append(msgs, last)))
}

// TestTxnProducerClosedDuringACommit: a Commit waiting for records that
// cannot be sent (their topic does not exist) returns ErrTxnClosed once
// the Producer is closed, and the stream's goroutine is gone.
func TestTxnProducerClosedDuringACommit(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"out": 1}})
	p := newProducer(t, k, testConfig(), newRecorder())
	s := openTxn(t, p, "kswitch/test/C/in/A/12")
	produceTxn(t, s, records("missing", 1, 0, 10))
	done := make(chan error, 1)
	go func() {
		_, err := s.Commit(t.Context(), nil)
		done <- err
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Producer Close: %v", err)
	}
	select {
	case <-kafka.TxnStreamDone(s):
	default:
		t.Fatal("the stream's goroutine still runs after the Producer's Close returned")
	}
	select {
	case err := <-done:
		if !errors.Is(err, kafka.ErrTxnClosed) || !errors.Is(err, kafka.ErrProducerClosed) {
			t.Fatalf("Commit: %v, want ErrTxnClosed and ErrProducerClosed", err)
		}
	case <-ctx.Done():
		t.Fatal("Commit still waiting after the Producer's Close")
	}
}
