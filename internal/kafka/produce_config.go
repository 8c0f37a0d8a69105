package kafka

import (
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"go.uber.org/zap"
)

// ProducerConfig adjusts a Producer. Start from DefaultProducerConfig.
type ProducerConfig struct {
	// Acks is what the brokers acknowledge: sarama.WaitForAll (every
	// in-sync replica; the producer is then idempotent: a producer id,
	// sequences, up to 5 batches in flight per partition, resends
	// recognised), WaitForLocal (the leader) or NoResponse (nothing: a
	// batch is reported acknowledged, offset -1, once written to the
	// connection). The last two have no producer id: one batch in
	// flight per partition keeps the order, and a resend after a lost
	// answer may write a batch twice. Default WaitForAll.
	Acks sarama.RequiredAcks
	// Timeout is the Produce request's timeout (how long a broker waits
	// for its replicas). A request unanswered for Timeout plus the
	// cluster's Net.ReadTimeout (5 s) has its connection closed and its
	// batches resent. Default 10 s.
	Timeout time.Duration
	// MaxInFlight is the number of requests in flight per broker
	// connection, 1 to 5 (Kafka keeps the last 5 batches of a producer
	// per partition to recognise a resend). Default 5.
	MaxInFlight int
	// BatchBytes bounds a batch's records (before compression); a
	// record larger than it goes alone. Default 1 MiB, Kafka's default
	// max.message.bytes; batches a topic refuses as too large are split.
	BatchBytes int
	// BatchRecords bounds a batch's record count. Default 10 000.
	BatchRecords int
	// RequestBytes bounds a request's batches. Default 4 MiB: a request
	// is held twice while it is sent (sarama encodes its batches' records,
	// then the request), and at 16 MiB those copies kept the garbage
	// collector of an agent at its default memory limit busy (make bench,
	// 1 KiB records: CPU 1.24x that of no limit; 0.88-1.08x at 4 MiB).
	RequestBytes int
	// RetryBackoff is the wait before the first resend of a partition's
	// batches after an error, doubled up to RetryBackoffMax. Defaults
	// 100 ms and 1 s.
	RetryBackoff, RetryBackoffMax time.Duration
	// BumpInterval is the least time between two new producer ids taken
	// after a lost sequence (drain-and-bump): a bump wanted sooner waits
	// for it, every partition with it, and counts in
	// ProducerStats.BumpsDelayed (a broker that keeps losing producer
	// state). Default 5 s.
	BumpInterval time.Duration
	// PartitionsRefresh is how often the partition counts Partitions
	// gives are read again from the cluster, off the record path (a
	// topic's new partitions are used within it). Default 1 min.
	PartitionsRefresh time.Duration
	// Dialer, when set, opens every connection (tests cut links with it).
	Dialer Dialer
	// Logger; default zap.NewNop().
	Logger *zap.Logger
}

// DefaultProducerConfig returns the defaults documented on ProducerConfig.
func DefaultProducerConfig() ProducerConfig {
	return ProducerConfig{
		Acks:            sarama.WaitForAll,
		Timeout:         10 * time.Second,
		MaxInFlight:     5,
		BatchBytes:      1 << 20,
		BatchRecords:    10000,
		RequestBytes:    4 << 20,
		RetryBackoff:    100 * time.Millisecond,
		RetryBackoffMax: time.Second,
		Logger:          zap.NewNop(),

		BumpInterval:      5 * time.Second,
		PartitionsRefresh: time.Minute,
	}
}

// Validate reports a setting out of range.
func (c ProducerConfig) Validate() error {
	switch {
	case c.Acks != sarama.WaitForAll && c.Acks != sarama.WaitForLocal && c.Acks != sarama.NoResponse:
		return fmt.Errorf("kafka: producer: Acks %d is none of -1 (all), 1 (leader), 0 (none)", c.Acks)
	case c.Timeout < time.Millisecond:
		return fmt.Errorf("kafka: producer: Timeout %s is under 1 ms", c.Timeout)
	case c.MaxInFlight < 1 || c.MaxInFlight > 5:
		return fmt.Errorf("kafka: producer: MaxInFlight %d is not within 1..5 (Kafka recognises resends of the last 5 batches only)", c.MaxInFlight)
	case c.BatchBytes < 1 || c.BatchRecords < 1 || c.RequestBytes < c.BatchBytes:
		return fmt.Errorf("kafka: producer: BatchBytes %d, BatchRecords %d, RequestBytes %d: each must be positive and RequestBytes >= BatchBytes",
			c.BatchBytes, c.BatchRecords, c.RequestBytes)
	case c.RetryBackoff <= 0 || c.RetryBackoffMax < c.RetryBackoff:
		return fmt.Errorf("kafka: producer: RetryBackoff %s, RetryBackoffMax %s: want 0 < RetryBackoff <= RetryBackoffMax", c.RetryBackoff, c.RetryBackoffMax)
	case c.BumpInterval < 0:
		return fmt.Errorf("kafka: producer: BumpInterval %s is negative", c.BumpInterval)
	case c.PartitionsRefresh < 10*time.Millisecond:
		return fmt.Errorf("kafka: producer: PartitionsRefresh %s is under 10 ms", c.PartitionsRefresh)
	case c.Logger == nil:
		return errors.New("kafka: producer: Logger is nil")
	}
	return nil
}
