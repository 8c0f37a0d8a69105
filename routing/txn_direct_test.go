package routing

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kswitch/kswitch/internal/wait"
)

// readCommittedKgo reads every record of topic on cluster as a franz-go
// read_committed consumer sees them (value → copies). To know it has read
// to the end, it first writes an end marker, outside any transaction, to
// each of the topic's partitions: once it has read every marker, it has
// read everything committed before them. Call it when no transaction of
// the topic is open.
func (w *world) readCommittedKgo(cluster, topic string, partitions int32) map[string]int {
	w.t.Helper()
	brokers := w.kafkas[cluster].Brokers()
	writer, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		w.t.Fatal(err)
	}
	defer writer.Close()
	const marker = "end-marker"
	for p := range partitions {
		if err := writer.ProduceSync(w.t.Context(), &kgo.Record{Topic: topic, Partition: p, Value: []byte(marker)}).FirstErr(); err != nil {
			w.t.Fatalf("write the end marker to %s/%d: %v", topic, p, err)
		}
	}
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
			if string(r.Value) == marker {
				ended[r.Partition] = true
				return
			}
			out[string(r.Value)]++
		})
	}
	return out
}

// TestExactlyOnceDirectThroughABrokerRestart: on the direct path, the
// exactly_once cluster's broker stops (connections refused, then cut)
// while a transaction holds records, and starts again on the same ports
// with its data: every record is on the channel once, read_committed by a
// franz-go reader, and each is acknowledged once. Stopped briefly, the
// commit waiting for the transaction's batches goes through (records
// given meanwhile join the next transaction); stopped past the stream's
// RetryTimeout (10 s), the stream is broken, opened again once S is back
// (which aborts the open transaction), and the position read back
// decides what is sent again.
func TestExactlyOnceDirectThroughABrokerRestart(t *testing.T) {
	for _, tc := range []struct {
		name string
		// broken: S stays down until a transaction failed (the
		// stream broken); else it restarts as soon as the producer
		// met it stopped, and records are given while it is down.
		broken bool
	}{{"brief", false}, {"past the retry timeout", true}} {
		t.Run(tc.name, func(t *testing.T) {
			w := eosWorld(t)
			o := w.ownerOn(1, 200*time.Millisecond, ProduceDirect)
			o.handle(t, 0, 50)
			o.waitAcked(t, 50)

			o.handle(t, 50, 100) // into the open transaction
			w.kafkas["S"].Stop()
			t.Logf("S stopped with %d of 100 records acknowledged", o.acks.count("orders/0@"))
			m := o.r.m.txns
			offered := make(chan error, 1)
			if tc.broken {
				offered <- nil
				wait.For(t, time.Minute, "a transaction fails with S stopped", func() error {
					if n := metricValue(m.WithLabelValues("S", "failed")); n == 0 {
						return fmt.Errorf("no failed transaction yet")
					}
					return nil
				})
			} else {
				go func() { offered <- o.offer(t.Context(), "A", "orders", 100, 150) }()
				// The transactional Producer has met the stopped broker:
				// a partition's batches were sent again, or its
				// connection opened again.
				wait.For(t, 30*time.Second, "the transactional producer meets S stopped", func() error {
					o.r.txns.mu.Lock()
					pr := o.r.txns.direct["S"]
					o.r.txns.mu.Unlock()
					if pr == nil {
						return fmt.Errorf("no transactional producer for S")
					}
					if st := pr.kp.Stats(); st.Retries+st.Reconnected == 0 {
						return fmt.Errorf("no retry nor reconnection yet: %+v", st)
					}
					return nil
				})
			}
			if err := w.kafkas["S"].Restart(); err != nil {
				t.Fatal(err)
			}
			if err := <-offered; err != nil {
				t.Fatal(err)
			}
			if tc.broken {
				o.handle(t, 100, 150)
			}
			o.handle(t, 150, 200)
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
			o.acks.mu.Lock()
			for k, n := range o.acks.seen {
				if n != 1 {
					t.Errorf("%s acknowledged %d times", k, n)
				}
			}
			o.acks.mu.Unlock()
			var want []string
			for off := range int64(200) {
				want = append(want, fmt.Sprintf("orders/0@%d", off))
			}
			wantEachOnce(t, w.readCommittedKgo("S", "out", 3), want)
		})
	}
}
