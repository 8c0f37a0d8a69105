package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/integration/netfault"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
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
	t.Parallel()
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
	t.Parallel()
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
	t.Parallel()
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
	t.Parallel()
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

// TestFetchHungBroker (F5): one of three brokers stops answering fetches.
// The partitions it leads stall; the others keep advancing; closing a
// stalled partition returns at once. When the broker answers again, its
// partitions catch up after the request's read timeout, every record once
// and in order. Hung again, the whole Fetcher closes at once.
func TestFetchHungBroker(t *testing.T) {
	t.Parallel()
	const parts = 12
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"t": parts}})
	c := k.Cluster()
	var hung []int32
	hungNode := c.LeaderFor("t", 0)
	for p := range int32(parts) {
		if c.LeaderFor("t", p) == hungNode {
			hung = append(hung, p)
		}
	}
	if len(hung) == parts {
		// kfake places leaders at random: move one away.
		if err := c.MoveTopicPartition("t", parts-1, (hungNode+1)%3); err != nil {
			t.Fatal(err)
		}
		hung = hung[:parts-1]
	}
	produceSeq(t, k, "t", parts, 0, 100, 100)
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	rs := readers(t, f, "t", parts, false)
	waitRead(t, rs, 20*time.Second, 100)

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
	hangNow := func() {
		t.Helper()
		hang.Store(true)
		before := hanging.Load()
		wait.For(t, 10*time.Second, "a fetch hung on the broker", func() error {
			if hanging.Load() == before {
				return errors.New("none yet")
			}
			return nil
		})
	}
	hangNow()
	produceSeq(t, k, "t", parts, 100, 300, 100)
	want := make([]int, parts)
	for p := range want {
		want[p] = 300
		if slices.Contains(hung, int32(p)) {
			want[p] = 100
		}
	}
	// The others advance while the hung broker's partitions read nothing.
	waitRead(t, rs, 20*time.Second, want...)

	closed := hung[0]
	start := time.Now()
	rs[closed].p.Close()
	if took := time.Since(start); took > closeBound {
		t.Errorf("Close of %d, led by the hung broker, took %v (bound %v)", closed, took, closeBound)
	} else {
		t.Logf("Close of %d, led by the hung broker: %v", closed, took)
	}

	// Answering again: the request in flight times out (Net.ReadTimeout
	// 5 s), the connection is made again, the partitions catch up.
	hang.Store(false)
	for _, p := range hung {
		want[p] = 300
	}
	want[closed] = 100
	waitRead(t, rs, 30*time.Second, want...)
	if st := f.Stats(); st.Errors == 0 {
		t.Errorf("the hung request's timeout was not counted: %+v", st)
	}

	hangNow()
	start = time.Now()
	f.Close()
	if took := time.Since(start); took > closeBound {
		t.Errorf("the Fetcher's Close with a fetch hung took %v (bound %v)", took, closeBound)
	} else {
		t.Logf("the Fetcher's Close with a fetch hung: %v", took)
	}
	t.Logf("%+v", f.Stats())
}

// TestFetchLeaderMoves (F6, fetch side): partition leaders move every 30 ms
// while records are produced and fetched; every record is read once, in
// order, and partitions did move.
func TestFetchLeaderMoves(t *testing.T) {
	t.Parallel()
	const parts = 6
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"t": parts}})
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	rs := readers(t, f, "t", parts, false)
	stop := make(chan struct{})
	shuffled := make(chan int)
	var changes atomic.Int32
	go func() {
		n := 0
		defer func() { shuffled <- n }()
		tick := time.NewTicker(30 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if n%2 == 0 {
					k.Cluster().ShufflePartitionLeaders()
				} else {
					p := int32(n % parts)
					_ = k.Cluster().MoveTopicPartition("t", p, (k.Cluster().LeaderFor("t", p)+1)%3)
				}
				n++
				changes.Add(1)
			}
		}
	}()
	// Each round waits for two leader changes and for its records to be
	// read, so moves land between fetches of every round.
	for i := range 10 {
		before := changes.Load()
		wait.For(t, 10*time.Second, "two leader changes", func() error {
			if changes.Load() < before+2 {
				return errors.New("not yet")
			}
			return nil
		})
		produceSeq(t, k, "t", parts, i*100, (i+1)*100, 100)
		waitRead(t, rs, 30*time.Second, (i+1)*100)
	}
	waitRead(t, rs, 30*time.Second, 1000)
	close(stop)
	n := <-shuffled
	if moves := f.Stats().Moves; moves == 0 {
		t.Errorf("%d leader changes, no partition moved", n)
	}
	t.Logf("%d leader changes, %+v", n, f.Stats())
}

// TestFetchOffsetOutOfRange (F12): a partition started beyond the log's
// end, and one whose records were deleted past its position, end with an
// error satisfying errors.Is(err, sarama.ErrOffsetOutOfRange).
func TestFetchOffsetOutOfRange(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 2}})
	produceSeq(t, k, "t", 2, 0, 10, 10)
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.Brokers()...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	del := kmsg.NewPtrDeleteRecordsRequest()
	dt := kmsg.NewDeleteRecordsRequestTopic()
	dt.Topic = "t"
	dp := kmsg.NewDeleteRecordsRequestTopicPartition()
	dp.Partition, dp.Offset = 1, 6
	dt.Partitions = append(dt.Partitions, dp)
	del.Topics = append(del.Topics, dt)
	del.TimeoutMillis = 5000
	resp, err := del.RequestWith(t.Context(), cl)
	if err != nil {
		t.Fatal(err)
	}
	if code := resp.Topics[0].Partitions[0].ErrorCode; code != 0 {
		t.Fatalf("DeleteRecords: error code %d", code)
	}
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	for _, c := range []struct {
		what      string
		partition int32
		at        int64
	}{{"beyond the end", 0, 15}, {"before the log start", 1, 2}} {
		p, err := f.ConsumePartition("t", c.partition, c.at)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-p.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the partition did not end within 10 s", c.what)
		}
		chunks, err := p.Poll(nil)
		if len(chunks) != 0 || !errors.Is(err, sarama.ErrOffsetOutOfRange) {
			t.Errorf("%s: Poll = %d chunks, %v; want none and offset out of range", c.what, len(chunks), err)
		}
		t.Logf("%s: %v", c.what, err)
		p.Close()
	}
	// Ended, the partition may be consumed again, in range.
	r, err := startReader(f, "t", 1, 6, 6, false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.stop()
	waitRead(t, []*reader{r}, 10*time.Second, 10)
}

// TestFetchThrottled (F14): the broker answers every other fetch empty with
// ThrottleMillis 100, while records come in 10 rounds; everything is still
// read, once, in order, and the throttle time is counted.
func TestFetchThrottled(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 4}})
	throttled := k.ThrottleFetches(100)
	f, _ := fetcherT(t, k, kafka.FetchConfig{PartitionMaxBytes: 4 << 10, MaxBytes: 16 << 10})
	rs := readers(t, f, "t", 4, false)
	for i := range 10 {
		produceSeq(t, k, "t", 4, i*25, (i+1)*25, 100)
		waitRead(t, rs, 30*time.Second, (i+1)*25)
	}
	st := f.Stats()
	if want := time.Duration(throttled()) * 100 * time.Millisecond; st.Throttled < want-100*time.Millisecond || st.Throttled == 0 {
		t.Errorf("throttled %v, want about %v (%d throttled responses)", st.Throttled, want, throttled())
	}
	t.Logf("%d throttled responses, %+v", throttled(), st)
}

// peakBudget is a ByteBudget that remembers the most it held.
type peakBudget struct {
	*kafka.ByteBudget
	mu   sync.Mutex
	peak int64
}

func (b *peakBudget) Charge(n int64) {
	b.ByteBudget.Charge(n)
	b.mu.Lock()
	b.peak = max(b.peak, b.InUse())
	b.mu.Unlock()
}

func (b *peakBudget) Peak() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.peak
}

// TestFetchBounds (F15): 16 partitions with a backlog of 512 KiB each and
// readers that release nothing: fetching stops at the budget, having held
// at most the budget and one batch (not one response: a request asks for
// no more than the budget has free), and every partition got records
// before it stopped (rotation: 8 partitions per request); released, every
// record is read once, in order.
func TestFetchBounds(t *testing.T) {
	t.Parallel()
	const (
		parts    = 16
		records  = 512
		size     = 1 << 10
		budget   = 3 << 20
		partMax  = 128 << 10
		reqMax   = 1 << 20
		batchMax = 16 << 10
	)
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": parts}})
	// Uncompressed, so that a response's size is its records' (a
	// compressed one is charged its records' size, larger).
	produceSeq(t, k, "t", parts, 0, records, size, kgo.ProducerBatchMaxBytes(batchMax), kgo.ProducerBatchCompression(kgo.NoCompression()))
	b := &peakBudget{ByteBudget: kafka.NewByteBudget(budget)}
	f, _ := fetcherT(t, k, kafka.FetchConfig{Budget: b, PartitionMaxBytes: partMax, MaxBytes: reqMax, MaxPartitions: 8})
	rs := readers(t, f, "t", parts, true)
	wait.For(t, 20*time.Second, "fetching stopped by the budget", func() error {
		if b.Room(partMax) == nil {
			return fmt.Errorf("%d of %d bytes held, %+v", b.InUse(), budget, f.Stats())
		}
		return nil
	})
	// A request asks for what the budget has free (at least partMax), so
	// a response takes the budget at most one batch past it (KIP-74: a
	// first batch larger than the request's MaxBytes is returned whole),
	// plus the framing of 8 partitions; it is charged its records' size
	// (64 bytes more per KiB record) when that is larger.
	bound := int64((budget+batchMax)*9/8 + 4<<10)
	if b.Peak() > bound {
		t.Errorf("held %d bytes at the peak, bound %d (budget %d + one batch)", b.Peak(), bound, budget)
	}
	for _, r := range rs {
		if n, _ := r.seen(); n == 0 {
			t.Errorf("partition %d got nothing before the budget ran out: starved", r.p.Partition())
		}
	}
	t.Logf("stopped with %d bytes held (peak %d), %+v", b.InUse(), b.Peak(), f.Stats())
	for _, r := range rs {
		r.setHold(false)
	}
	waitRead(t, rs, 60*time.Second, records)
	if b.Peak() > bound {
		t.Errorf("held %d bytes at the peak, bound %d", b.Peak(), bound)
	}
	// Closed, the partitions give every byte back (a response in flight
	// for them is charged, then dropped).
	for _, r := range rs {
		r.stop()
	}
	wait.For(t, 10*time.Second, "the budget given back", func() error {
		if n := b.InUse(); n != 0 {
			return fmt.Errorf("%d bytes still charged", n)
		}
		return nil
	})
}

// TestFetchPauseResume: a paused partition receives nothing while another
// of the same broker flows; resumed, it goes on from where it was.
func TestFetchPauseResume(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 2}})
	produceSeq(t, k, "t", 2, 0, 100, 10)
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	rs := readers(t, f, "t", 2, false)
	waitRead(t, rs, 10*time.Second, 100)
	rs[0].p.Pause()
	produceSeq(t, k, "t", 2, 100, 200, 10)
	waitRead(t, rs[1:], 10*time.Second, 200)
	// Two more requests answered after partition 1 read everything: the
	// paused one was left out of them.
	after := f.Stats().Requests
	wait.For(t, 10*time.Second, "two more fetches", func() error {
		if n := f.Stats().Requests; n < after+2 {
			return fmt.Errorf("%d requests since", n-after)
		}
		return nil
	})
	if n, _ := rs[0].seen(); n != 100 {
		t.Fatalf("paused partition 0 read %d records, want the 100 read before the pause", n)
	}
	rs[0].p.Resume()
	waitRead(t, rs, 10*time.Second, 200)
}

// TestFetchConnectionsDropped: the broker closes the connection on every
// third fetch; every record is still read once, in order, and the
// failures are counted.
func TestFetchConnectionsDropped(t *testing.T) {
	t.Parallel()
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Topics: map[string]int32{"t": 3}})
	c := k.Cluster()
	var n atomic.Int32
	c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if n.Add(1)%3 != 0 {
			return nil, nil, false
		}
		return nil, errors.New("dropped by the test"), true // kfake closes the connection
	})
	f, _ := fetcherT(t, k, kafka.FetchConfig{PartitionMaxBytes: 4 << 10, MaxBytes: 16 << 10})
	rs := readers(t, f, "t", 3, false)
	for i := range 5 {
		produceSeq(t, k, "t", 3, i*50, (i+1)*50, 100)
		waitRead(t, rs, 30*time.Second, (i+1)*50)
	}
	if st := f.Stats(); st.Errors == 0 {
		t.Errorf("no failure counted: %+v", st)
	}
	t.Logf("%d fetches, %+v", n.Load(), f.Stats())
}

// BenchmarkFetch reads the same 100 000 records of 100 bytes (4 partitions,
// kfake in this process) with the Fetcher and with sarama's Consumer, one
// after the other in each round, each timed from its start to its last
// record (closing is not timed: sarama's waits for a fetch in flight);
// records/s is the Fetcher's, x-sarama its ratio to sarama's.
func BenchmarkFetch(b *testing.B) {
	const parts, perPart = 4, 25_000
	k := testenv.StartKafkaT(b, "B", devstack.KafkaOptions{Topics: map[string]int32{"b": parts}})
	for i := range 5 {
		produceSeq(b, k, "b", parts, i*perPart/5, (i+1)*perPart/5, 100)
	}
	f, client := fetcherT(b, k, kafka.FetchConfig{Budget: kafka.NewByteBudget(32 << 20)})
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		b.Fatal(err)
	}
	defer consumer.Close()
	var ours, theirs time.Duration
	b.ResetTimer()
	for range b.N {
		ours += benchFetcher(b, f, parts, perPart)
		theirs += benchSarama(b, consumer, parts, perPart)
	}
	b.StopTimer()
	total := float64(b.N * parts * perPart)
	b.ReportMetric(total/ours.Seconds(), "records/s")
	b.ReportMetric(total/theirs.Seconds(), "sarama-records/s")
	b.ReportMetric(theirs.Seconds()/ours.Seconds(), "x-sarama")
}

func benchFetcher(b *testing.B, f *kafka.Fetcher, parts int32, perPart int) time.Duration {
	var read sync.WaitGroup
	var fps []*kafka.FetchPartition
	start := time.Now()
	for p := range parts {
		fp, err := f.ConsumePartition("b", p, 0)
		if err != nil {
			b.Fatal(err)
		}
		fps = append(fps, fp)
		read.Add(1)
		go func() {
			defer read.Done()
			var buf []*kafka.Chunk
			bytes := 0
			for {
				<-fp.Ready()
				chunks, err := fp.Poll(buf[:0])
				if err != nil {
					b.Error(err)
					return
				}
				for _, c := range chunks {
					for i := range c.Records {
						bytes += len(c.Records[i].Value)
					}
					last := c.Records[len(c.Records)-1].Offset
					c.Release()
					if last == int64(perPart-1) {
						return
					}
				}
			}
		}()
	}
	read.Wait()
	took := time.Since(start)
	for _, fp := range fps {
		fp.Close()
	}
	return took
}

func benchSarama(b *testing.B, consumer sarama.Consumer, parts int32, perPart int) time.Duration {
	var read sync.WaitGroup
	var pcs []sarama.PartitionConsumer
	start := time.Now()
	for p := range parts {
		pc, err := consumer.ConsumePartition("b", p, sarama.OffsetOldest)
		if err != nil {
			b.Fatal(err)
		}
		pcs = append(pcs, pc)
		read.Add(1)
		go func() {
			defer read.Done()
			bytes := 0
			for m := range pc.Messages() {
				bytes += len(m.Value)
				if m.Offset == int64(perPart-1) {
					return
				}
			}
		}()
	}
	read.Wait()
	took := time.Since(start)
	for _, pc := range pcs {
		if err := pc.Close(); err != nil {
			b.Error(err)
		}
	}
	return took
}

// TestFetchOverSASLAndTLS: the Fetcher's own connections use the cluster's
// TLS (with a client certificate) and SASL from the client's Config.
func TestFetchOverSASLAndTLS(t *testing.T) {
	t.Parallel()
	pki, err := devstack.NewPKI(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tlsOpt, err := devstack.KafkaTLS(pki)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := pki.Issue("kafka-client", user)
	if err != nil {
		t.Fatal(err)
	}
	extra := append(devstack.KafkaSASL(config.SASLScramSHA512, user, pass), tlsOpt)
	k := testenv.StartKafkaT(t, "A", devstack.KafkaOptions{Topics: map[string]int32{"t": 2}, Extra: extra})
	c := config.Cluster{Brokers: k.Brokers(), Version: config.DefaultKafkaVersion,
		SASL: config.SASL{Mechanism: config.SASLScramSHA512, Username: user, Password: pass},
		TLS:  config.TLS{CAFile: pki.CAFile, CertFile: cert.CertFile, KeyFile: cert.KeyFile}}
	client, err := kafka.NewClient("A", c)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	sc, err := kafka.Config(c)
	if err != nil {
		t.Fatal(err)
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewManualPartitioner
	producer, err := sarama.NewSyncProducer(c.Brokers, sc)
	if err != nil {
		t.Fatal(err)
	}
	var msgs []*sarama.ProducerMessage
	for n := range 50 {
		for p := range int32(2) {
			msgs = append(msgs, &sarama.ProducerMessage{Topic: "t", Partition: p, Value: sarama.ByteEncoder(seqValue(p, n, 10))})
		}
	}
	if err := producer.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	_ = producer.Close()
	f, err := kafka.NewFetcher("A", client, kafka.FetchConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		f.Close()
		<-f.Done()
	}()
	rs := readers(t, f, "t", 2, false)
	waitRead(t, rs, 20*time.Second, 50)
}

// TestFetchBrokerRemoved (F5, stopped): a broker leaves the cluster while
// its partitions are fetched (kfake closes its listener and moves every
// leader); they go on from the survivors, every record once, in order.
func TestFetchBrokerRemoved(t *testing.T) {
	t.Parallel()
	const parts = 9
	k := testenv.StartKafkaT(t, "F", devstack.KafkaOptions{Brokers: 3, Topics: map[string]int32{"t": parts}})
	f, _ := fetcherT(t, k, kafka.FetchConfig{})
	rs := readers(t, f, "t", parts, false)
	produceSeq(t, k, "t", parts, 0, 100, 100)
	waitRead(t, rs, 20*time.Second, 100)
	gone := k.Cluster().LeaderFor("t", 0)
	if err := k.Cluster().RemoveNode(gone); err != nil {
		t.Fatal(err)
	}
	produceSeq(t, k, "t", parts, 100, 300, 100)
	waitRead(t, rs, 30*time.Second, 300)
	t.Logf("broker %d removed: %+v", gone, f.Stats())
}

// The loop of a consumer of one partition: wait for the kick, take the
// queued chunks, hand their records on, release each chunk when done with
// it; a partition that ended on its own says why.
func ExampleFetcher() {
	client, err := kafka.NewClient("A", config.Cluster{Brokers: []string{"localhost:9092"}, Version: config.DefaultKafkaVersion})
	if err != nil {
		return
	}
	defer client.Close()
	f, err := kafka.NewFetcher("A", client, kafka.FetchConfig{Budget: kafka.NewByteBudget(32 << 20)})
	if err != nil {
		return
	}
	defer f.Close()
	p, err := f.ConsumePartition("orders", 0, 0)
	if err != nil {
		return
	}
	defer p.Close()
	var buf []*kafka.Chunk
	for range p.Ready() {
		chunks, err := p.Poll(buf[:0])
		if err != nil {
			// Ended on its own, everything queued before taken:
			// errors.Is(err, sarama.ErrOffsetOutOfRange) when its
			// position left the log.
			fmt.Println(err)
			return
		}
		for _, c := range chunks {
			for _, r := range c.Records {
				fmt.Println(r.Offset, string(r.Value))
			}
			c.Release()
		}
	}
}

// TestFetchThroughProxy: the Fetcher's own connections go through the
// cluster's SOCKS5 proxy; with the proxy's link blackholed under a fetch
// in flight, Close returns at once.
func TestFetchThroughProxy(t *testing.T) {
	t.Parallel()
	k, _, link, cl := proxied(t)
	produceSeq(t, k, "t", 6, 0, 100, 100)
	client, err := kafka.NewClient("P", cl)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	before := link.Conns() // the client's own

	f, err := kafka.NewFetcher("P", client, kafka.FetchConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		f.Close()
		<-f.Done()
	}()
	rs := readers(t, f, "t", 6, false)
	waitRead(t, rs, 20*time.Second, 100)
	if n := link.Conns(); n <= before {
		t.Errorf("connections through the proxy: %d before the Fetcher, %d after it read everything; want more", before, n)
	}
	link.Set(netfault.Fault{Blackhole: true})
	start := time.Now()
	f.Close()
	if took := time.Since(start); took > closeBound {
		t.Errorf("Close with the proxy blackholed took %v (bound %v)", took, closeBound)
	}
}
