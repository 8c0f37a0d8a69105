package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/internal/kafka"
	"github.com/kswitch/kswitch/internal/testkit/testenv"
	"github.com/kswitch/kswitch/internal/testkit/wait"
)

// partitionsWithin calls p.Partitions(topic) and fails t if the call took
// longer than bound; it returns how long it took, the count and the
// error.
func partitionsWithin(t *testing.T, p *kafka.Producer, topic string, bound time.Duration) (time.Duration, int32, error) {
	t.Helper()
	start := time.Now()
	n, err := p.Partitions(topic)
	d := time.Since(start)
	if d > bound {
		t.Errorf("Partitions(%s) took %s, want under %s (no network wait)", topic, d, bound)
	}
	return d, n, err
}

// TestProducePartitionsOffTheRecordPath: the cluster hangs, and a topic
// created after the producer opened is asked for. Partitions answers at
// once, ErrPartitionsUnknown, while the count refresher waits on the hung
// cluster (a metadata call there takes the client's 5 s read timeout per
// try); once the cluster answers again the count is known, and records
// produced to the topic are written once each, in order. A topic the
// cluster had when the producer opened is known from the start.
func TestProducePartitionsOffTheRecordPath(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "later", partitions: 4, count: 400, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{"out": 3}})
	r := newRecorder()
	p := newProducer(t, k, testConfig(), r)
	// The bound: a map look-up under a lock, on 2 loaded cores with
	// -race; a network wait is the client's 5 s read timeout.
	const bound = 500 * time.Millisecond
	if _, n, err := partitionsWithin(t, p, "out", bound); n != 3 || err != nil {
		t.Fatalf("Partitions(out) = %d, %v; want 3 from the metadata the producer opened with", n, err)
	}
	if err := k.CreateTopic(pl.topic, pl.partitions); err != nil {
		t.Fatal(err)
	}
	k.Hang()
	var longest time.Duration
	for start := time.Now(); time.Since(start) < 2*time.Second; time.Sleep(50 * time.Millisecond) {
		d, n, err := partitionsWithin(t, p, pl.topic, bound)
		longest = max(longest, d)
		if !errors.Is(err, kafka.ErrPartitionsUnknown) {
			t.Fatalf("Partitions(%s) on the hung cluster = %d, %v; want ErrPartitionsUnknown", pl.topic, n, err)
		}
	}
	t.Logf("Partitions on the hung cluster: the longest call took %s", longest)
	k.Recover()
	wait.For(t, 30*time.Second, "the count of the new topic looked up", func() error {
		if _, n, err := partitionsWithin(t, p, pl.topic, bound); n != pl.partitions {
			return fmt.Errorf("Partitions = %d, %v", n, err)
		}
		return nil
	})
	produceAll(t, p, r, pl, 30*time.Second)
	r.check(t)
	verdict(t, k, pl)
}

// TestProducePartitionsGrow: partitions added to a topic in use are seen
// within PartitionsRefresh, and records produced to the new ones are
// written.
func TestProducePartitionsGrow(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 6, count: 600, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: 3}})
	cfg := testConfig()
	cfg.PartitionsRefresh = 200 * time.Millisecond
	r := newRecorder()
	p := newProducer(t, k, cfg, r)
	if n, err := p.Partitions(pl.topic); n != 3 || err != nil {
		t.Fatalf("Partitions = %d, %v; want 3", n, err)
	}
	if err := k.AddPartitions(pl.topic, pl.partitions); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	wait.For(t, 10*time.Second, "the new partitions seen", func() error {
		if n, err := p.Partitions(pl.topic); n != pl.partitions {
			return fmt.Errorf("Partitions = %d, %v", n, err)
		}
		return nil
	})
	t.Logf("6 partitions seen %s after they were added (PartitionsRefresh %s)", time.Since(start).Round(time.Millisecond), cfg.PartitionsRefresh)
	produceAll(t, p, r, pl, 30*time.Second)
	r.check(t)
	verdict(t, k, pl)
}

// TestProduceBumpsAtMostOncePerInterval: the broker answers three
// produces of partition 0 in a row OUT_OF_ORDER_SEQUENCE_NUMBER, so the
// producer wants a new producer id three times, each right after the one
// before. It takes them BumpInterval (5 s) apart: each InitProducerID of
// a bump reaches the broker at least 5 s after the one before (the
// interval runs from the answer of the one before, which comes after it
// reached the broker). The partitions wait meanwhile, then every record
// is written once, in order.
func TestProduceBumpsAtMostOncePerInterval(t *testing.T) {
	t.Parallel()
	pl := plan{topic: "out", partitions: 2, count: 200, size: 100}
	k := testenv.StartKafkaT(t, "C", devstack.KafkaOptions{Topics: map[string]int32{pl.topic: 2}})
	cfg := testConfig()
	r := newRecorder()
	p := newProducer(t, k, cfg, r)
	c := k.Cluster()
	var mu sync.Mutex
	var inits []time.Time
	c.ControlKey(int16(kmsg.InitProducerID), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		mu.Lock()
		inits = append(inits, time.Now())
		mu.Unlock()
		return nil, nil, false
	})
	c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: pl.topic, Partitions: []int32{0}, Err: kerr.OutOfOrderSequenceNumber, Count: 3})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	feed(ctx, t, p, r, pl.messages()[:20], 0)
	wait.For(t, 10*time.Second, "a delayed bump seen by Stalled", func() error {
		st, _ := p.Stalled(pl.topic, 0)
		if p.Stats().BumpsDelayed == 0 || st.Err == nil {
			return fmt.Errorf("stats %+v, stall %+v", p.Stats(), st)
		}
		return nil
	})
	st, _ := p.Stalled(pl.topic, 0)
	t.Logf("while delayed: %v", st.Err)
	feed(ctx, t, p, r, pl.messages()[20:], 0)
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v (%d of %d reported, stats %+v)", err, r.settled(), pl.count, p.Stats())
	}
	r.check(t)
	verdict(t, k, pl)
	if st := p.Stats(); st.Bumps != 3 || st.BumpsDelayed != 2 {
		t.Errorf("stats %+v, want 3 bumps, 2 of them delayed", st)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(inits) != 3 {
		t.Fatalf("%d InitProducerID requests, want 3", len(inits))
	}
	for i := 1; i < len(inits); i++ {
		gap := inits[i].Sub(inits[i-1])
		t.Logf("bump %d: %s after bump %d", i+1, gap.Round(time.Millisecond), i)
		if gap < cfg.BumpInterval {
			t.Errorf("bump %d came %s after bump %d, want at least %s", i+1, gap, i, cfg.BumpInterval)
		}
	}
}
