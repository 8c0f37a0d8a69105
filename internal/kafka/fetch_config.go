package kafka

import (
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"
)

// FetchConfig tunes a Fetcher. The zero value of a field means its default.
type FetchConfig struct {
	// MaxWait is how long a broker may hold a fetch that has no record to
	// return (the request's MaxWaitTime). Default 250 ms. It must stay
	// below the client's Net.ReadTimeout.
	MaxWait time.Duration
	// PartitionMaxBytes bounds the bytes asked of one partition in one
	// request (Kafka's max.partition.fetch.bytes). Default 1 MiB. It is
	// doubled, up to 64 MiB, for a partition whose next batch came back
	// cut off, and reset after the batch.
	PartitionMaxBytes int32
	// MaxBytes bounds the bytes asked in one request. Default 16 MiB.
	MaxBytes int32
	// MaxPartitions bounds the partitions named in one request; which ones
	// rotates from request to request, so every partition is named in
	// turn. Default 32.
	MaxPartitions int
	// Budget bounds the bytes of the responses whose chunks are not yet
	// released, over every broker of the Fetcher (and over every Fetcher
	// sharing it). A broker's loop sends no request while the budget has
	// less than PartitionMaxBytes free; a response is charged whole when
	// it arrives (its size, or its records' when larger: compressed
	// batches, small records). A request asks for no more than the
	// budget has free (Free, scaled by the last response's weight
	// decoded), so the bytes held exceed the bound by about one batch
	// (KIP-74: a first batch larger than asked comes whole) per broker
	// loop. Default nil: unbounded.
	Budget Budget
	// RecordOverhead is what a record is charged beyond its key, value
	// and headers: the memory that the Fetcher and the consumer hold per
	// record while it is not released. Default 64 (the Fetcher's Record
	// and sarama's decoded record); a consumer that keeps more per record
	// says so here, so that the budget bounds memory for small records
	// too.
	RecordOverhead int
	// Logger receives the Fetcher's logs. Default zap.NewNop().
	Logger *zap.Logger
}

// DefaultFetchConfig returns the defaults, filled in.
func DefaultFetchConfig() FetchConfig {
	return FetchConfig{MaxWait: DefaultFetchMaxWait, PartitionMaxBytes: DefaultFetchPartitionMaxBytes,
		MaxBytes: DefaultFetchMaxBytes, MaxPartitions: DefaultFetchMaxPartitions, RecordOverhead: DefaultFetchRecordOverhead}
}

func (c FetchConfig) withDefaults() FetchConfig {
	d := DefaultFetchConfig()
	if c.MaxWait == 0 {
		c.MaxWait = d.MaxWait
	}
	if c.PartitionMaxBytes == 0 {
		c.PartitionMaxBytes = d.PartitionMaxBytes
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = d.MaxBytes
	}
	if c.MaxPartitions == 0 {
		c.MaxPartitions = d.MaxPartitions
	}
	if c.RecordOverhead == 0 {
		c.RecordOverhead = d.RecordOverhead
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Validate checks c with its defaults filled in.
func (c FetchConfig) Validate() error {
	c = c.withDefaults()
	switch {
	case c.MaxWait < 0 || c.MaxWait > time.Duration(math.MaxInt32)*time.Millisecond:
		return fmt.Errorf("kafka: fetch MaxWait %v is out of range", c.MaxWait)
	case c.PartitionMaxBytes < 0 || c.PartitionMaxBytes > fetchMaxBytesCap:
		return fmt.Errorf("kafka: fetch PartitionMaxBytes %d is not within 1..%d", c.PartitionMaxBytes, fetchMaxBytesCap)
	case c.MaxBytes < c.PartitionMaxBytes:
		return fmt.Errorf("kafka: fetch MaxBytes %d is below PartitionMaxBytes %d", c.MaxBytes, c.PartitionMaxBytes)
	case c.MaxPartitions < 0:
		return fmt.Errorf("kafka: fetch MaxPartitions %d is negative", c.MaxPartitions)
	case c.RecordOverhead < 0:
		return fmt.Errorf("kafka: fetch RecordOverhead %d is negative", c.RecordOverhead)
	}
	return nil
}

// Defaults of FetchConfig.
const (
	DefaultFetchMaxWait           = 250 * time.Millisecond
	DefaultFetchPartitionMaxBytes = 1 << 20
	DefaultFetchMaxBytes          = 16 << 20
	DefaultFetchMaxPartitions     = 32
	DefaultFetchRecordOverhead    = 64
)
