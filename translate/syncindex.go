package translate

import (
	"context"
	"slices"
	"sync"

	"github.com/IBM/sarama"
	"github.com/kswitch/kswitch/internal/kafka"
)

// SyncsCache holds what Translate calls have read of an offset-syncs
// topic, by upstream partition, so that the calls of one switch (one per
// partition, and again after a planned switch's pre-translation) read the
// topic once and then only what MirrorMaker 2 wrote since. The zero value
// is empty and ready; it is safe for concurrent use (reads are
// serialized) and must not be copied.
type SyncsCache struct {
	mu      sync.Mutex
	topic   string
	next    int64 // the offset after the last one read; 0 with nothing read
	syncs   map[syncKey][]OffsetSync
	skipped int // records that did not decode
}

type syncKey struct {
	topic     string
	partition int32
}

// read brings the index of topic (partition 0, where MirrorMaker 2 writes
// its syncs) up to the topic's end and returns the syncs of upstream
// topic/partition, in topic order from the last regression on (keepSync),
// and the undecodable records of the whole topic. A topic whose end went
// below what was read (recreated) or another topic is read from its
// oldest offset again; records removed by retention before they were read
// are missed, as by a fresh read.
func (x *SyncsCache) read(ctx context.Context, client sarama.Client, topic, upstream string, partition int32) ([]OffsetSync, int, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	from := x.next
	// The end is listed first: a fetch at the end would wait for the
	// broker's fetch wait before answering with nothing, and the calls of
	// a switch (serialized here) would each pay it when nothing is new.
	end, err := kafka.ListOffset(ctx, client, topic, 0, sarama.OffsetNewest)
	if err != nil {
		return nil, 0, err
	}
	if x.syncs != nil && x.topic == topic && x.next > 0 && end < x.next {
		x.syncs = nil
	}
	if x.syncs == nil || x.topic != topic {
		oldest, err := kafka.ListOffset(ctx, client, topic, 0, sarama.OffsetOldest)
		if err != nil {
			return nil, 0, err
		}
		x.topic, x.syncs, x.skipped, from = topic, map[syncKey][]OffsetSync{}, 0, oldest
	}
	if from >= end {
		x.next = from
		return slices.Clone(x.syncs[syncKey{upstream, partition}]), x.skipped, nil
	}
	next, err := kafka.ReadPartition(ctx, client, topic, 0, from, func(r kafka.Record) bool {
		if r.Value == nil { // a tombstone
			return true
		}
		s, err := DecodeOffsetSync(r.Key, r.Value)
		if err != nil {
			x.skipped++
			return true
		}
		k := syncKey{s.Topic, s.Partition}
		x.syncs[k] = keepSync(x.syncs[k], s)
		return true
	})
	// What was read counts even when the read stopped early: the next
	// call goes on from there.
	x.next = next
	if err != nil {
		return nil, 0, err
	}
	return slices.Clone(x.syncs[syncKey{upstream, partition}]), x.skipped, nil
}
