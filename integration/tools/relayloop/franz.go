package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kswitch/kswitch/config"
)

// runFranz is the strongest Go baseline (-client franz-go): franz-go's
// consumer group reading the source from its oldest records and an
// idempotent producer (acks all) tuned for throughput as franz-go's
// documentation recommends: lingering 5 ms for batches of up to 1 MiB,
// five requests in flight per broker (franz-go's own for idempotent
// writes), up to 100 000 records buffered, uncompressed like a kswitch
// channel's default; 64 MiB fetches. Each record goes to the same
// partition of dest with its key, value, timestamp and headers; its offset
// is marked once the destination acknowledged it, and marks are committed
// every interval.
func runFranz(ctx context.Context, src, dst config.Cluster, topic, group, dest string, interval time.Duration) error {
	producer, err := kgo.NewClient(kgo.SeedBrokers(dst.Brokers...), kgo.ClientID("relayloop"),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(5*time.Millisecond), kgo.ProducerBatchMaxBytes(1<<20),
		kgo.ProducerBatchCompression(kgo.NoCompression()), kgo.MaxBufferedRecords(100_000))
	if err != nil {
		return fmt.Errorf("producer to %v: %w", dst.Brokers, err)
	}
	defer producer.Close()
	consumer, err := kgo.NewClient(kgo.SeedBrokers(src.Brokers...), kgo.ClientID("relayloop"),
		kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.AutoCommitMarks(), kgo.AutoCommitInterval(interval),
		kgo.FetchMaxBytes(64<<20), kgo.FetchMaxPartitionBytes(8<<20))
	if err != nil {
		return fmt.Errorf("consumer group %s on %v: %w", group, src.Brokers, err)
	}
	defer consumer.Close() // commits the marks (autocommit's revoke)

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var once sync.Once
	for ctx.Err() == nil {
		fs := consumer.PollFetches(ctx)
		if err := fs.Err0(); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, kgo.ErrClientClosed) {
			fs.EachError(func(t string, p int32, err error) {
				once.Do(func() { cancel(fmt.Errorf("consume %s/%d: %w", t, p, err)) })
			})
		}
		fs.EachRecord(func(r *kgo.Record) {
			out := &kgo.Record{Topic: dest, Partition: r.Partition, Key: r.Key, Value: r.Value, Headers: r.Headers, Timestamp: r.Timestamp}
			producer.Produce(ctx, out, func(_ *kgo.Record, err error) {
				if err != nil {
					if ctx.Err() == nil {
						once.Do(func() { cancel(fmt.Errorf("produce to %s/%d: %w", dest, r.Partition, err)) })
					}
					return
				}
				consumer.MarkCommitRecords(r)
			})
		})
	}
	// Deliver what is in flight; the consumer's close commits the marks.
	fctx, fcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer fcancel()
	if err := producer.Flush(fctx); err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	if err := context.Cause(ctx); !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}
