package demo

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
)

// reader reads every partition of the destination topic on C from its
// start, as a consumer downstream would, and notes when each record
// arrived and which cluster it was consumed from (the channel's key is
// "<number>@<cluster>"). It owns a goroutine per partition, ended by stop.
type reader struct {
	client   sarama.Client
	consumer sarama.Consumer
	topic    string
	pcs      []sarama.PartitionConsumer
	wg       sync.WaitGroup

	mu  sync.Mutex
	got []arrival
}

// arrival is one record read from C.
type arrival struct {
	id   int64
	from string // the cluster it was consumed from
	at   time.Time
}

func startReader(brokers []string, topic string, partitions int32) (*reader, error) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	sc.Consumer.MaxWaitTime = 50 * time.Millisecond
	sc.Consumer.IsolationLevel = sarama.ReadCommitted // C may be exactly_once
	cl, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("demo: a client of C: %w", err)
	}
	c, err := sarama.NewConsumerFromClient(cl)
	if err != nil {
		cl.Close()
		return nil, fmt.Errorf("demo: a consumer of C: %w", err)
	}
	r := &reader{client: cl, consumer: c, topic: topic}
	for p := range partitions {
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			r.stop()
			return nil, fmt.Errorf("demo: read C's %s/%d: %w", topic, p, err)
		}
		r.pcs = append(r.pcs, pc)
		r.wg.Go(func() { r.read(p, pc) })
	}
	return r, nil
}

func (r *reader) read(p int32, pc sarama.PartitionConsumer) {
	for m := range pc.Messages() {
		now := time.Now()
		num, from, _ := strings.Cut(string(m.Key), "@")
		id, err := strconv.ParseInt(num, 10, 64)
		r.mu.Lock()
		if err == nil && from != "" { // else not routed by the demo's channel
			r.got = append(r.got, arrival{id: id, from: from, at: now})
		}
		r.mu.Unlock()
	}
}

// stop ends the reader's goroutines and closes its clients.
func (r *reader) stop() {
	for _, pc := range r.pcs {
		pc.AsyncClose()
	}
	r.wg.Wait()
	r.consumer.Close()
	r.client.Close()
}

// count returns how many records were read.
func (r *reader) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// first returns the arrival time of the first record read at or after
// since that was consumed from cluster (any cluster when "").
func (r *reader) first(since time.Time, cluster string) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, a := range r.got {
		if !a.at.Before(since) && (cluster == "" || a.from == cluster) {
			return a.at, true
		}
	}
	return time.Time{}, false
}

// last returns the arrival time of the last record read in [from, to).
func (r *reader) last(from, to time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var t time.Time
	for _, a := range r.got {
		if !a.at.Before(from) && a.at.Before(to) {
			t = a.at
		}
	}
	return t, !t.IsZero()
}

// longestGap returns the longest time in [from, to] without an arrival.
func (r *reader) longestGap(from, to time.Time) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	prev, gap := from, time.Duration(0)
	for _, a := range r.got {
		if a.at.Before(from) || a.at.After(to) {
			continue
		}
		gap = max(gap, a.at.Sub(prev))
		prev = a.at
	}
	return max(gap, to.Sub(prev))
}

// hasAll reports whether every one of ids was read.
func (r *reader) hasAll(ids []int64) bool {
	seen := r.counts()
	for _, id := range ids {
		if seen[id] == 0 {
			return false
		}
	}
	return true
}

// counts returns how many times each number was read.
func (r *reader) counts() map[int64]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[int64]int, len(r.got))
	for _, a := range r.got {
		out[a.id]++
	}
	return out
}

// readC reads every partition of C's outTopic to its end, as a
// read_committed consumer sees it (up to the last stable offset: with
// --exactly-once the last offsets are transaction markers, which no
// consumer receives), and counts each record the demo's channel routed by
// its number.
func readC(ctx context.Context, brokers []string) (map[int64]int, error) {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_6_0_0
	cl, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("demo: a client of C: %w", err)
	}
	defer cl.Close()
	out := map[int64]int{}
	for p := range int32(partitions) {
		err := kafka.ReadAll(ctx, cl, outTopic, p, func(r kafka.Record) bool {
			num, from, _ := strings.Cut(string(r.Key), "@")
			if id, err := strconv.ParseInt(num, 10, 64); err == nil && from != "" {
				out[id]++
			}
			return true
		})
		if err != nil {
			return nil, fmt.Errorf("demo: read C's %s/%d: %w", outTopic, p, err)
		}
	}
	return out, nil
}
