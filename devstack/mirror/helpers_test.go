package mirror

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// baseTime is far from now, so a timestamp that the broker or a client
// filled in by itself cannot pass for the one the test set.
var baseTime = time.Date(2024, 3, 1, 12, 0, 0, 0, time.UTC)

// message is the i-th test record of topic/partition: a key, a value, two
// headers (one with an empty value) and a timestamp that differs per record.
func message(topic string, partition int32, i int) *sarama.ProducerMessage {
	return &sarama.ProducerMessage{
		Topic:     topic,
		Partition: partition,
		Key:       sarama.StringEncoder(fmt.Sprintf("key-%s-%d-%d", topic, partition, i)),
		Value:     sarama.StringEncoder(fmt.Sprintf("value-%s-%d-%d", topic, partition, i)),
		Headers: []sarama.RecordHeader{
			{Key: []byte("seq"), Value: fmt.Appendf(nil, "%d", i)},
			{Key: []byte("empty"), Value: []byte{}},
		},
		Timestamp: baseTime.Add(time.Duration(partition)*time.Hour + time.Duration(i)*time.Second + 7*time.Millisecond),
	}
}

func saramaTestConfig() *sarama.Config {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_6_0_0
	cfg.ClientID = "mirror-test"
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	cfg.Producer.Retry.Max = 1
	cfg.Producer.Retry.Backoff = 50 * time.Millisecond
	cfg.Net.ReadTimeout = 3 * time.Second
	cfg.Metadata.Retry.Max = 1
	cfg.Metadata.Retry.Backoff = 50 * time.Millisecond
	cfg.Consumer.Return.Errors = true
	cfg.Consumer.MaxWaitTime = 50 * time.Millisecond
	return cfg
}

func newClient(t *testing.T, k *devstack.Kafka) sarama.Client {
	t.Helper()
	cl, err := sarama.NewClient(k.Brokers(), saramaTestConfig())
	if err != nil {
		t.Fatalf("client of %s: %v", k.Name(), err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func newProducer(t *testing.T, cl sarama.Client) sarama.SyncProducer {
	t.Helper()
	p, err := sarama.NewSyncProducerFromClient(cl)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// produceN sends records from..from+n-1 (see message) to topic/partition.
func produceN(t *testing.T, p sarama.SyncProducer, topic string, partition int32, from, n int) {
	t.Helper()
	for i := from; i < from+n; i++ {
		if _, _, err := p.SendMessage(message(topic, partition, i)); err != nil {
			t.Fatalf("produce %s/%d #%d: %v", topic, partition, i, err)
		}
	}
}

// readAll returns every record of topic/partition, from its oldest offset
// to its high watermark (read first).
func readAll(t *testing.T, cl sarama.Client, topic string, partition int32) []*sarama.ConsumerMessage {
	t.Helper()
	var msgs []*sarama.ConsumerMessage
	// Retry the whole read: the cluster may just have come back.
	wait.For(t, 20*time.Second, fmt.Sprintf("read %s/%d", topic, partition), func() error {
		var err error
		msgs, err = tryReadAll(cl, topic, partition)
		return err
	})
	return msgs
}

func tryReadAll(cl sarama.Client, topic string, partition int32) ([]*sarama.ConsumerMessage, error) {
	if err := cl.RefreshMetadata(topic); err != nil {
		return nil, err
	}
	hwm, err := cl.GetOffset(topic, partition, sarama.OffsetNewest)
	if err != nil {
		return nil, err
	}
	c, err := sarama.NewConsumerFromClient(cl)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	pc, err := c.ConsumePartition(topic, partition, sarama.OffsetOldest)
	if err != nil {
		return nil, err
	}
	defer pc.Close()
	var msgs []*sarama.ConsumerMessage
	timeout := time.NewTimer(10 * time.Second)
	defer timeout.Stop()
	for len(msgs) == 0 || msgs[len(msgs)-1].Offset < hwm-1 {
		if hwm == 0 {
			break
		}
		select {
		case m := <-pc.Messages():
			msgs = append(msgs, m)
		case err := <-pc.Errors():
			return nil, err
		case <-timeout.C:
			return nil, fmt.Errorf("got %d records of %s/%d, want up to offset %d", len(msgs), topic, partition, hwm-1)
		}
	}
	return msgs, nil
}

// sameMessage reports how got differs from want in key, value, timestamp
// or headers, or "" when it does not.
func sameMessage(got, want *sarama.ConsumerMessage) string {
	switch {
	case !bytes.Equal(got.Key, want.Key):
		return fmt.Sprintf("key %q, want %q", got.Key, want.Key)
	case !bytes.Equal(got.Value, want.Value):
		return fmt.Sprintf("value %q, want %q", got.Value, want.Value)
	case !got.Timestamp.Equal(want.Timestamp):
		return fmt.Sprintf("timestamp %v, want %v", got.Timestamp, want.Timestamp)
	case len(got.Headers) != len(want.Headers):
		return fmt.Sprintf("%d headers, want %d", len(got.Headers), len(want.Headers))
	}
	for i, h := range got.Headers {
		if !bytes.Equal(h.Key, want.Headers[i].Key) || !bytes.Equal(h.Value, want.Headers[i].Value) {
			return fmt.Sprintf("header %d %q=%q, want %q=%q", i, h.Key, h.Value, want.Headers[i].Key, want.Headers[i].Value)
		}
	}
	return ""
}

func isFiller(m *sarama.ConsumerMessage) bool {
	for _, h := range m.Headers {
		if string(h.Key) == FillerHeader {
			return true
		}
	}
	return false
}

// checkCopy fails the test unless target partition holds prefill filler
// records followed by exactly the source partition's records, in order.
func checkCopy(t *testing.T, src, dst sarama.Client, topic, remote string, partition int32, prefill int) {
	t.Helper()
	want := readAll(t, src, topic, partition)
	got := readAll(t, dst, remote, partition)
	if len(got) != prefill+len(want) {
		t.Fatalf("%s/%d holds %d records, want %d fillers + %d copied", remote, partition, len(got), prefill, len(want))
	}
	for _, m := range got[:prefill] {
		if !isFiller(m) {
			t.Fatalf("%s/%d offset %d is not a filler record: %q", remote, partition, m.Offset, m.Value)
		}
	}
	for i, w := range want {
		g := got[prefill+i]
		if isFiller(g) {
			t.Fatalf("%s/%d offset %d: a filler record among the copies", remote, partition, g.Offset)
		}
		if diff := sameMessage(g, w); diff != "" {
			t.Fatalf("%s/%d offset %d (copy of %s/%d offset %d): %s", remote, partition, g.Offset, topic, partition, w.Offset, diff)
		}
	}
}

func startMirror(t *testing.T, cfg Config) *Mirror {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel))
	}
	// The mirror lives as long as Start's context: the test's.
	m, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(m.Stop)
	return m
}

func caughtUp(t *testing.T, m *Mirror) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.CaughtUp(ctx); err != nil {
		lag, lerr := m.Lag()
		t.Fatalf("caught up: %v (copied %d, lag %d %v)", err, m.Copied(), lag, lerr)
	}
}

// producerLoop produces to topic partitions 0..partitions-1 of k round
// robin until stopped, ignoring failures (a record that failed is not in the
// source, or is: the tests compare the target with what the source holds).
// After a failure it starts over with a new client, because a sarama
// producer that failed to find a leader three times keeps failing for 10 s
// ("circuit breaker is open").
type producerLoop struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	acked  int
	failed int
}

func startProducerLoop(t *testing.T, k *devstack.Kafka, topic string, partitions int32) *producerLoop {
	ctx, cancel := context.WithCancel(context.Background())
	pl := &producerLoop{cancel: cancel}
	pl.wg.Add(1)
	go func() {
		defer pl.wg.Done()
		var (
			cl sarama.Client
			p  sarama.SyncProducer
		)
		closeAll := func() {
			if p != nil {
				p.Close()
			}
			if cl != nil {
				cl.Close()
			}
			p, cl = nil, nil
		}
		defer closeAll()
		for i := 0; ctx.Err() == nil; {
			var err error
			if p == nil {
				if cl, err = sarama.NewClient(k.Brokers(), saramaTestConfig()); err == nil {
					p, err = sarama.NewSyncProducerFromClient(cl)
				}
			}
			if err == nil {
				_, _, err = p.SendMessage(message(topic, int32(i)%partitions, i))
			}
			pl.mu.Lock()
			if err == nil {
				pl.acked++
				i++
			} else {
				pl.failed++
			}
			pl.mu.Unlock()
			// A steady stream, not a flood; and no busy loop while failing.
			if err == nil {
				time.Sleep(2 * time.Millisecond)
			} else {
				closeAll()
				time.Sleep(20 * time.Millisecond)
			}
		}
	}()
	t.Cleanup(pl.stop)
	return pl
}

func (pl *producerLoop) stop() {
	pl.cancel()
	pl.wg.Wait()
}

func (pl *producerLoop) counts() (acked, failed int) {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	return pl.acked, pl.failed
}

// waitAcked waits until the loop has n more acknowledged records than now.
func (pl *producerLoop) waitAcked(t *testing.T, n int) {
	t.Helper()
	start, _ := pl.counts()
	wait.For(t, 30*time.Second, fmt.Sprintf("%d more records produced", n), func() error {
		if acked, _ := pl.counts(); acked < start+n {
			return fmt.Errorf("%d acknowledged", acked-start)
		}
		return nil
	})
}

// decodeSync parses an offset-sync record, independently of package offsets.
func decodeSync(key, value []byte) (topic string, partition int32, upstream, downstream int64, err error) {
	if len(key) < 2 {
		return "", 0, 0, 0, errors.New("short key")
	}
	n := int(binary.BigEndian.Uint16(key))
	if len(key) != 2+n+4 || len(value) != 16 {
		return "", 0, 0, 0, fmt.Errorf("key %x value %x: bad lengths", key, value)
	}
	topic = string(key[2 : 2+n])
	partition = int32(binary.BigEndian.Uint32(key[2+n:]))
	upstream = int64(binary.BigEndian.Uint64(value))
	downstream = int64(binary.BigEndian.Uint64(value[8:]))
	return topic, partition, upstream, downstream, nil
}
