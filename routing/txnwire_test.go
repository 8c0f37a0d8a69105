package routing

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// readCommittedKgo reads every record of topic on cluster as a franz-go
// read_committed consumer sees them (value → copies). To know it has read
// to the end, it first writes an end marker, outside any transaction, to
// each of the topic's partitions: once it has read every marker, it has
// read everything committed before them. Call it when no transaction of
// the topic is open.
func (w *world) readCommittedKgo(cluster, topic string, partitions int32) map[string]int {
	w.t.Helper()
	brokers := w.writeEndMarkers(cluster, topic, partitions)
	reader, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		w.t.Fatal(err)
	}
	defer reader.Close()
	ctx, cancel := context.WithTimeout(w.t.Context(), 30*time.Second)
	defer cancel()
	out := map[string]int{}
	ended := map[int32]bool{}
	for int32(len(ended)) < partitions {
		fs := reader.PollFetches(ctx)
		if ctx.Err() != nil {
			w.t.Fatalf("%s/%s: the end markers of %d of %d partitions read after 30 s", cluster, topic, len(ended), partitions)
		}
		fs.EachRecord(func(r *kgo.Record) {
			if string(r.Value) == endMarker {
				ended[r.Partition] = true
				return
			}
			out[string(r.Value)]++
		})
	}
	return out
}

// readCommittedByMarkers reads every record of topic on cluster that the
// log shows committed (value → copies), deciding it from the log's own
// control records rather than from the broker's aborted-transaction
// index: a franz-go read_uncommitted reader keeps the control records,
// and a transactional record is committed when the next control record
// of its producer id in its partition is a COMMIT, aborted when it is an
// ABORT (records outside transactions count as they are). Like
// readCommittedKgo it first writes an end marker to each partition and
// reads up to them. A transactional record with no control record of its
// producer after it (a hanging transaction: it would hold the last
// stable offset) is reported as an error. Call it when no transaction of
// the topic is open.
//
// It exists for tests where kfake's aborted-transaction index is wrong
// (kfake@v0.0.0-20260918054303-01f206a7e32c): a cluster closed with a
// transaction open, whose partition snapshot then does not match its
// segments, is restored twice over, by the full segment replay (an
// implicit abort: an index entry with no marker, and an epoch bump) and
// by the session state (the transaction open again, aborted with a
// marker by the next InitProducerID). Its fetches then return two
// aborted transactions of that producer with the same first offset for
// one ABORT marker, and a read_committed reader (franz-go pops one entry
// per marker) hides every later transactional record of that producer
// id: committed ones included. Real Kafka writes its transaction index
// entry only with the abort marker.
func (w *world) readCommittedByMarkers(cluster, topic string, partitions int32) map[string]int {
	w.t.Helper()
	brokers := w.writeEndMarkers(cluster, topic, partitions)
	reader, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.KeepControlRecords(),
		kgo.FetchIsolationLevel(kgo.ReadUncommitted()), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		w.t.Fatal(err)
	}
	defer reader.Close()
	ctx, cancel := context.WithTimeout(w.t.Context(), 30*time.Second)
	defer cancel()
	type open struct {
		partition int32
		producer  int64
	}
	pending := map[open][]*kgo.Record{} // transactional records whose control record is not read yet
	out := map[string]int{}
	ended := map[int32]bool{}
	for int32(len(ended)) < partitions {
		fs := reader.PollFetches(ctx)
		if ctx.Err() != nil {
			w.t.Fatalf("%s/%s: the end markers of %d of %d partitions read after 30 s", cluster, topic, len(ended), partitions)
		}
		fs.EachRecord(func(r *kgo.Record) {
			k := open{r.Partition, r.ProducerID}
			switch {
			case r.Attrs.IsControl():
				// The control record's key: version int16, type int16 (0 ABORT, 1 COMMIT).
				if len(r.Key) < 4 {
					w.t.Fatalf("%s/%d@%d: control record with a %d-byte key", topic, r.Partition, r.Offset, len(r.Key))
				}
				if r.Key[2] == 0 && r.Key[3] == 1 {
					for _, p := range pending[k] {
						out[string(p.Value)]++
					}
				}
				delete(pending, k)
			case r.Attrs.IsTransactional():
				pending[k] = append(pending[k], r)
			case string(r.Value) == endMarker:
				ended[r.Partition] = true
			default:
				out[string(r.Value)]++
			}
		})
	}
	for k, rs := range pending {
		w.t.Errorf("%s/%d: %d records of producer %d from offset %d have no control record after them (a hanging transaction)",
			topic, k.partition, len(rs), k.producer, rs[0].Offset)
	}
	return out
}

// endMarker is the value of the records writeEndMarkers writes.
const endMarker = "end-marker"

// writeEndMarkers writes an end marker, outside any transaction, to each
// of topic's partitions on cluster, and returns the cluster's brokers: a
// reader that has read every marker has read everything written before.
func (w *world) writeEndMarkers(cluster, topic string, partitions int32) []string {
	w.t.Helper()
	brokers := w.kafkas[cluster].Brokers()
	writer, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		w.t.Fatal(err)
	}
	defer writer.Close()
	for p := range partitions {
		if err := writer.ProduceSync(w.t.Context(), &kgo.Record{Topic: topic, Partition: p, Value: []byte(endMarker)}).FirstErr(); err != nil {
			w.t.Fatalf("write the end marker to %s/%d: %v", topic, p, err)
		}
	}
	return brokers
}

// logUncommitted logs every record and control record of topic on
// cluster as a read_uncommitted reader sees them in 3 s, with the
// partitions' high-water marks and last stable offsets: what a failed
// read_committed check needs to be understood.
func (w *world) logUncommitted(cluster, topic string) {
	w.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(w.kafkas[cluster].Brokers()...), kgo.ConsumeTopics(topic), kgo.KeepControlRecords(),
		kgo.FetchIsolationLevel(kgo.ReadUncommitted()), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		w.t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		fs.EachPartition(func(p kgo.FetchTopicPartition) {
			w.t.Logf("uncommitted %s/%d: high water %d, last stable %d", topic, p.Partition, p.HighWatermark, p.LastStableOffset)
		})
		fs.EachRecord(func(r *kgo.Record) {
			w.t.Logf("uncommitted %s/%d@%d: producer %d epoch %d transactional %v control %v value %.24q",
				topic, r.Partition, r.Offset, r.ProducerID, r.ProducerEpoch, r.Attrs.IsTransactional(), r.Attrs.IsControl(), r.Value)
		})
	}
}

// TestExactlyOnceDirectThroughABrokerRestart: the
// exactly_once cluster's broker stops (connections refused, then cut)
// while a transaction holds records, and starts again on the same ports
// with its data: every record is on the channel once, committed as the
// log's control records say (readCommittedByMarkers: kfake's
// aborted-transaction index can be wrong after such a restart), and each
// is acknowledged once. Restarted while a commit waits for the stopped
// broker, the commit goes through (records given meanwhile join the next
// transaction); stopped past the stream's
// RetryTimeout (10 s), the stream is broken, opened again once S is back
// (which aborts the open transaction), and the position read back
// decides what is sent again.
func TestExactlyOnceDirectThroughABrokerRestart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// broken: S stays down until a transaction failed (the
		// stream broken); else it restarts once a commit waits for
		// it, with records queued behind the commit.
		broken bool
	}{{"brief", false}, {"past the retry timeout", true}} {
		t.Run(tc.name, func(t *testing.T) {
			w := eosWorld(t)
			o := w.owner(1, 200*time.Millisecond)
			o.handle(t, 0, 50)
			o.waitAcked(t, 50)

			o.handle(t, 50, 100) // into the open transaction
			w.kafkas["S"].Stop()
			t.Logf("S stopped with %d of 100 records acknowledged", o.acks.count("orders/0@"))
			o.handle(t, 100, 150) // into the open transaction, or the next
			m := o.r.m.txns
			if tc.broken {
				wait.For(t, time.Minute, "a transaction fails with S stopped", func() error {
					if n := metricValue(m.WithLabelValues("S", "failed")); n == 0 {
						return fmt.Errorf("no failed transaction yet")
					}
					return nil
				})
				if err := w.kafkas["S"].Restart(); err != nil {
					t.Fatal(err)
				}
				o.handle(t, 150, 200)
			} else {
				wait.For(t, 30*time.Second, "a commit under way with S stopped", func() error {
					if !committing(o.r) {
						return fmt.Errorf("no commit under way")
					}
					return nil
				})
				o.handle(t, 150, 200) // queued for the next transaction
				if err := w.kafkas["S"].Restart(); err != nil {
					t.Fatal(err)
				}
			}
			wait.For(t, time.Minute, "200 records acknowledged", func() error {
				if n := o.acks.count("orders/0@"); n != 200 {
					return fmt.Errorf("%d acknowledged", n)
				}
				return nil
			})
			t.Logf("transactions: %v committed, %v aborted, %v failed (opened again)", metricValue(m.WithLabelValues("S", "committed")),
				metricValue(m.WithLabelValues("S", "aborted")), metricValue(m.WithLabelValues("S", "failed")))
			if n := metricValue(m.WithLabelValues("S", "fenced")); n != 0 {
				t.Errorf("the owner was fenced %v times", n)
			}
			o.close(t, false)
			o.wantAckedOnce(t)
			var want []string
			for off := range int64(200) {
				want = append(want, fmt.Sprintf("orders/0@%d", off))
			}
			// Committed as the log's control records say, not as
			// kfake's aborted-transaction index says: S was stopped
			// with a transaction open (see readCommittedByMarkers).
			wantEachOnce(t, w.readCommittedByMarkers("S", "out", 3), want)
			if t.Failed() {
				w.logUncommitted("S", "out")
			}
		})
	}
}

// wantAckedOnce checks that the owner acknowledged no record twice.
func (o *eosOwner) wantAckedOnce(t *testing.T) {
	t.Helper()
	o.acks.mu.Lock()
	defer o.acks.mu.Unlock()
	for k, n := range o.acks.seen {
		if n != 1 {
			t.Errorf("%s acknowledged %d times", k, n)
		}
	}
}

// committing reports whether a transactional producer of r is committing.
func committing(r *Router) bool {
	r.txns.mu.Lock()
	tps := slices.Collect(maps.Values(r.txns.live))
	r.txns.mu.Unlock()
	for _, tp := range tps {
		tp.mu.Lock()
		c := tp.committing
		tp.mu.Unlock()
		if c {
			return true
		}
	}
	return false
}

// TestExactlyOnceDirectRefusedRecordToDeadLetter: a
// record larger than the channel's topic takes (max.message.bytes) aborts
// its transaction; the stream names it (kafka.TxnAbortedError.Refused)
// and it goes to the dead-letter channel, while the transaction's other
// records are committed in the next: each record once on the channel or
// on the dead-letter channel, read_committed, each acknowledged once.
func TestExactlyOnceDirectRefusedRecordToDeadLetter(t *testing.T) {
	t.Parallel()
	const limit, big, bigAt, n = 100_000, 300_000, 30, 60
	w := newWorld(t, map[string][]string{"S": {"out", "dead"}}, "A", "S")
	s := w.cfg.Clusters["S"]
	s.Delivery = config.ExactlyOnce
	w.cfg.Clusters["S"] = s
	w.cfg.Routing = Config{Default: []string{"out"}, DeadLetter: "dead",
		Channels: map[string]Channel{"out": {Cluster: "S", Topic: "out"}, "dead": {Cluster: "S", Topic: "dead"}}}
	v := strconv.Itoa(limit)
	if err := adminOf(t, w.kafkas["S"]).AlterConfig(sarama.TopicResource, "out", map[string]*string{"max.message.bytes": &v}, false); err != nil {
		t.Fatal(err)
	}
	o := w.owner(1, 50*time.Millisecond)
	for off := range int64(n) {
		rec := testRecord("orders", 0, off, "")
		if off == bigAt {
			rec.Value = []byte(strings.Repeat("x", big))
		}
		rec.Origin, rec.Generation, rec.Session = "A", o.gen, o.gen
		if err := deliver(t.Context(), o.r, rec, 30*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	wait.For(t, 30*time.Second, fmt.Sprintf("%d records acknowledged", n), func() error {
		if got := o.acks.count("orders/0@"); got != n {
			return fmt.Errorf("%d acknowledged", got)
		}
		return nil
	})
	m := o.r.m.txns
	if got := metricValue(m.WithLabelValues("S", "aborted")); got != 1 {
		t.Errorf("%v transactions aborted, want 1 (the one with the large record)", got)
	}
	if got := metricValue(o.r.m.dead.WithLabelValues("produce")); got != 1 {
		t.Errorf("dead_lettered{produce} = %v, want 1", got)
	}
	o.close(t, false)
	o.wantAckedOnce(t)
	var want []string
	for off := range int64(n) {
		if off != bigAt {
			want = append(want, fmt.Sprintf("orders/0@%d", off))
		}
	}
	wantEachOnce(t, w.readCommittedKgo("S", "out", 3), want)
	dead := w.read("S", "dead", 1)
	if len(dead) != 1 || header(dead[0], HeaderSource) != fmt.Sprintf("orders/0@%d", bigAt) || len(dead[0].Value) != big {
		for _, d := range dead {
			t.Errorf("dead letter from %s, %d bytes; want orders/0@%d, %d bytes", header(d, HeaderSource), len(d.Value), bigAt, big)
		}
	}
}
