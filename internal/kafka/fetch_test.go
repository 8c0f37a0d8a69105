package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testenv"
	"github.com/kswitch/kswitch/internal/wait"
)

// closeBound bounds how long a Close of something blocked on a hung broker
// may take. What it waits for is local: the socket is closed under sarama,
// whose reader fails at once, and goroutines return. sarama's read timeout
// (5 s) is what a Close that waited on the network would take; 1 s is far
// below it and far above a scheduling delay on 2 loaded cores under -race.
const closeBound = time.Second

func clusterConf(k *devstack.Kafka) config.Cluster {
	return config.Cluster{Brokers: k.Brokers(), Version: config.DefaultKafkaVersion}
}

// TestConnFloor: a dedicated connection negotiates Fetch as min(our
// ceiling, the broker's maximum) and refuses a version below the floor,
// saying what to change.
func TestConnFloor(t *testing.T) {
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 1}})
	conf, err := kafka.Config(clusterConf(k))
	if err != nil {
		t.Fatal(err)
	}
	c, err := kafka.DialConn(t.Context(), conf, k.Brokers()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ceiling := kafka.FetchVersion(conf.Version)
	if v, err := c.Negotiate(kafka.APIKeyFetch, ceiling, 4); err != nil || v != ceiling {
		t.Errorf("Negotiate(Fetch, %d, 4) = %d, %v; want %d (kfake serves up to 18)", ceiling, v, err, ceiling)
	}
	if _, err := c.Negotiate(kafka.APIKeyFetch, kafka.FetchVersion(sarama.V0_10_2_0), 4); err == nil || !strings.Contains(err.Error(), "raise the cluster's version") {
		t.Errorf("Negotiate(Fetch) for Kafka 0.10.2: %v, want a refusal naming the version setting", err)
	}
	if _, err := c.Negotiate(kafka.APIKey(1000), 1, 0); err == nil || !strings.Contains(err.Error(), "does not serve") {
		t.Errorf("Negotiate(an unknown key): %v, want does not serve", err)
	}
}

// TestConnCloseDoesNotWait: a Fetch that the broker never answers ends as
// soon as the Conn is closed, not after sarama's read timeout; so does a
// Conn whose context ends.
func TestConnCloseDoesNotWait(t *testing.T) {
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 1}})
	arrived := make(chan struct{}, 4)
	k.Cluster().ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		k.Cluster().KeepControl()
		arrived <- struct{}{}
		return nil, nil, true // never answered
	})
	conf, err := kafka.Config(clusterConf(k))
	if err != nil {
		t.Fatal(err)
	}
	for _, how := range []string{"Close", "ctx"} {
		ctx, cancel := context.WithCancel(t.Context())
		c, err := kafka.DialConn(ctx, conf, k.Brokers()[0])
		if err != nil {
			t.Fatal(err)
		}
		req := &sarama.FetchRequest{Version: 4, MaxWaitTime: 100, MinBytes: 1, MaxBytes: 1 << 20}
		req.AddBlock("t", 0, 0, 1<<20, -1)
		done := make(chan error, 1)
		go func() {
			_, err := c.Broker().Fetch(req)
			done <- err
		}()
		<-arrived
		start := time.Now()
		if how == "Close" {
			c.Close()
		} else {
			cancel()
		}
		err = <-done
		if took := time.Since(start); err == nil || took > closeBound {
			t.Errorf("%s: the hung Fetch returned %v after %v, want an error within %v", how, err, took, closeBound)
		}
		c.Close()
		c.Close() // twice: fine
		cancel()
	}
}

// fetcherT returns a Fetcher of k's cluster, closed (and its goroutines
// waited for) when the test ends, and its client.
func fetcherT(t testing.TB, k *devstack.Kafka, cfg kafka.FetchConfig) (*kafka.Fetcher, sarama.Client) {
	t.Helper()
	client, err := kafka.NewClient(k.Name(), clusterConf(k))
	if err != nil {
		t.Fatal(err)
	}
	f, err := kafka.NewFetcher(k.Name(), client, cfg)
	if err != nil {
		client.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Close()
		select {
		case <-f.Done():
		case <-time.After(10 * time.Second):
			t.Error("the fetcher's goroutines did not return within 10 s of Close")
		}
		client.Close()
	})
	return f, client
}

// seqValue is the value of record n of partition p: the reader checks
// exactly once and order with it. pad makes it size bytes at least.
func seqValue(p int32, n, size int) []byte {
	v := fmt.Appendf(nil, "%d/%d/", p, n)
	for len(v) < size {
		v = append(v, 'x')
	}
	return v
}

func parseSeq(v []byte) (p int32, n int, ok bool) {
	parts := strings.SplitN(string(v), "/", 3)
	if len(parts) != 3 {
		return 0, 0, false
	}
	pp, err1 := strconv.Atoi(parts[0])
	nn, err2 := strconv.Atoi(parts[1])
	return int32(pp), nn, err1 == nil && err2 == nil
}

// produceSeq produces records from..to-1 of each of partitions 0..parts-1
// of topic, with a kgo producer, and waits for their acks.
func produceSeq(t testing.TB, k *devstack.Kafka, topic string, parts int32, from, to, size int, opts ...kgo.Opt) {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(k.Brokers()...), kgo.RecordPartitioner(kgo.ManualPartitioner())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for n := from; n < to; n++ {
		for p := range parts {
			recs = append(recs, &kgo.Record{Topic: topic, Partition: p, Value: seqValue(p, n, size)})
		}
	}
	if err := cl.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// reader drains one FetchPartition in its own goroutine, checking that
// records come in offset order and that each carries the next sequence
// number of its partition: exactly once, in order.
type reader struct {
	p      *kafka.FetchPartition
	mu     sync.Mutex
	next   int   // the sequence number expected next
	last   int64 // the offset of the last record
	bad    []string
	held   []*kafka.Chunk // chunks not released while holding
	hold   bool
	chunks int
	err    error
	done   chan struct{}
}

func startReader(f *kafka.Fetcher, topic string, partition int32, offset int64, firstSeq int, hold bool) (*reader, error) {
	p, err := f.ConsumePartition(topic, partition, offset)
	if err != nil {
		return nil, err
	}
	r := &reader{p: p, next: firstSeq, last: offset - 1, hold: hold, done: make(chan struct{})}
	go r.run()
	return r, nil
}

func (r *reader) run() {
	defer close(r.done)
	var buf []*kafka.Chunk
	for {
		select {
		case <-r.p.Ready():
		case <-r.p.Done():
		}
		chunks, err := r.p.Poll(buf[:0])
		r.mu.Lock()
		for _, c := range chunks {
			r.chunks++
			for _, rec := range c.Records {
				p, n, ok := parseSeq(rec.Value)
				switch {
				case !ok || p != r.p.Partition():
					r.bad = append(r.bad, fmt.Sprintf("offset %d: value %.20q is not of partition %d", rec.Offset, rec.Value, r.p.Partition()))
				case rec.Offset <= r.last:
					r.bad = append(r.bad, fmt.Sprintf("offset %d after %d", rec.Offset, r.last))
				case n != r.next:
					r.bad = append(r.bad, fmt.Sprintf("offset %d: record %d, want %d", rec.Offset, n, r.next))
				}
				r.last, r.next = rec.Offset, n+1
			}
			if c.Next <= r.last {
				r.bad = append(r.bad, fmt.Sprintf("chunk's Next %d is not past its last record %d", c.Next, r.last))
			}
			if r.hold {
				r.held = append(r.held, c)
			} else {
				c.Release()
			}
		}
		r.mu.Unlock()
		if err != nil {
			r.mu.Lock()
			r.err = err
			r.mu.Unlock()
			return
		}
		select {
		case <-r.p.Done():
			if len(chunks) == 0 {
				return // closed
			}
		default:
		}
	}
}

// seen returns the number of records read so far and what was wrong.
func (r *reader) seen() (int, []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.next, append([]string(nil), r.bad...)
}

// setHold stops or restarts the release of chunks; releasing releases
// those held.
func (r *reader) setHold(hold bool) {
	r.mu.Lock()
	r.hold = hold
	held := r.held
	if !hold {
		r.held = nil
	}
	r.mu.Unlock()
	if !hold {
		for _, c := range held {
			c.Release()
		}
	}
}

func (r *reader) stop() {
	r.p.Close()
	<-r.done
	r.setHold(false)
}

// readers reads partitions 0..parts-1 of topic from offset 0.
func readers(t testing.TB, f *kafka.Fetcher, topic string, parts int32, hold bool) []*reader {
	t.Helper()
	rs := make([]*reader, parts)
	for p := range parts {
		r, err := startReader(f, topic, p, 0, 0, hold)
		if err != nil {
			t.Fatal(err)
		}
		rs[p] = r
		t.Cleanup(r.stop)
	}
	return rs
}

// waitRead waits until each reader has read want[p] records (all the same
// when want has one value), and fails on anything read out of order or
// twice.
func waitRead(t testing.TB, rs []*reader, timeout time.Duration, want ...int) {
	t.Helper()
	wait.For(t, timeout, "every record read once, in order", func() error {
		for i, r := range rs {
			w := want[0]
			if len(want) > 1 {
				w = want[i]
			}
			n, bad := r.seen()
			if len(bad) > 0 {
				t.Fatalf("partition %d: %d records out of order or twice, first: %s", r.p.Partition(), len(bad), bad[0])
			}
			if n != w {
				return fmt.Errorf("partition %d: %d of %d records read", r.p.Partition(), n, w)
			}
		}
		return nil
	})
}

// TestFetchEveryRecordOnceInOrder: 12 partitions over 3 brokers, records
// produced before and while fetching, every one read once, in order.
func TestFetchEveryRecordOnceInOrder(t *testing.T) {
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"t": 12}})
	produceSeq(t, k, "t", 12, 0, 500, 100)
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	rs := readers(t, f, "t", 12, false)
	waitRead(t, rs, 20*time.Second, 500)
	produceSeq(t, k, "t", 12, 500, 1000, 100)
	waitRead(t, rs, 20*time.Second, 1000)
	for _, r := range rs {
		if hwm := r.p.HighWaterMark(); hwm != 1000 {
			t.Errorf("partition %d: high watermark %d, want 1000", r.p.Partition(), hwm)
		}
	}
	if _, err := f.ConsumePartition("t", 0, 0); err == nil {
		t.Error("a second ConsumePartition of a partition being fetched: no error")
	}
}

// TestFetchReadCommitted (F13 at this level): a transactional producer
// aborts every other transaction; no aborted record, nor a transaction
// marker, is passed on, and the committed ones are, once, in order.
func TestFetchReadCommitted(t *testing.T) {
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 2}})
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...), kgo.TransactionalID("rc"), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	committed := 0
	for txn := range 20 {
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		commit := txn%2 == 0
		var recs []*kgo.Record
		for i := range 10 {
			for p := range int32(2) {
				v := []byte("aborted")
				if commit {
					v = seqValue(p, committed+i, 0)
				}
				recs = append(recs, &kgo.Record{Topic: "t", Partition: p, Value: v})
			}
		}
		if err := cl.ProduceSync(t.Context(), recs...).FirstErr(); err != nil {
			t.Fatal(err)
		}
		if err := cl.EndTransaction(t.Context(), kgo.TransactionEndTry(commit)); err != nil {
			t.Fatal(err)
		}
		if commit {
			committed += 10
		}
	}
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	rs := readers(t, f, "t", 2, false)
	waitRead(t, rs, 20*time.Second, committed)
}
