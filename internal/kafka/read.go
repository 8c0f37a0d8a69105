package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/IBM/sarama"
)

// The one way kswitch reads a partition with its own requests (the
// translator's scans, the demo mirror's checks): Fetch requests of sarama's
// types sent to the partition's leader, their record batches decoded by
// DecodeBlock as a read_committed consumer sees them. The agents consume
// through sarama's consumer.

// ListOffset is sarama's GetOffset bounded by ctx.
func ListOffset(ctx context.Context, client sarama.Client, topic string, partition int32, at int64) (int64, error) {
	var off int64
	err := Call(ctx, func() error {
		var err error
		off, err = client.GetOffset(topic, partition, at)
		return err
	})
	if err != nil {
		// off is not read: after ctx ended, the abandoned call may
		// still write it.
		return 0, err
	}
	return off, nil
}

// Record is one record of a fetched partition (DecodeBlock).
type Record struct {
	Offset     int64
	Key, Value []byte
	Headers    []*sarama.RecordHeader
	// Timestamp is the record's time as sarama's consumer reports it;
	// TimestampMs the same in Unix milliseconds as the batch stores it,
	// -1 when the record has none (a producer that sent -1).
	Timestamp   time.Time
	TimestampMs int64
	// ProducerID and ProducerEpoch are those of the record's batch (-1
	// when the producer was neither idempotent nor transactional, and
	// for legacy message sets): which producer session wrote it.
	ProducerID    int64
	ProducerEpoch int16
}

// Fetch sizes and retries of ReadPartition.
const (
	fetchMaxBytes    = 1 << 20
	fetchMaxBytesCap = 64 << 20
	fetchRetries     = 3
	fetchBackoff     = 100 * time.Millisecond
)

// ReadAll reads topic/partition from its oldest offset to its end.
func ReadAll(ctx context.Context, client sarama.Client, topic string, partition int32, fn func(Record) bool) error {
	oldest, err := ListOffset(ctx, client, topic, partition, sarama.OffsetOldest)
	if err != nil {
		return err
	}
	_, err = ReadPartition(ctx, client, topic, partition, oldest, fn)
	return err
}

// WaitStable waits until every transaction open on topic/partition when it
// is called has ended: until the partition's last stable offset reaches
// the high watermark that its first fetch reports. A read_committed reader
// (ReadPartition) stops at the last stable offset, the first offset of the
// oldest open transaction, so a record committed after another producer's
// transaction began stays unseen until that one ends too; a producer that
// died mid-transaction holds it until its transactional.id is used again
// or the transaction times out (transaction.timeout.ms). Each retry backs
// off up to stableBackoffMax; it fails when ctx ends, naming the offsets.
func WaitStable(ctx context.Context, client sarama.Client, topic string, partition int32) error {
	target, stable, from := int64(-1), int64(-1), int64(-1)
	waiting := func(err error) error {
		if target < 0 {
			return err
		}
		return fmt.Errorf("%s/%d: a transaction open since offset %d has not ended (the high watermark was %d): %w",
			topic, partition, stable, target, err)
	}
	retries := 0
	for delay := stableBackoff; ; delay = min(2*delay, stableBackoffMax) {
		if from < 0 {
			oldest, err := ListOffset(ctx, client, topic, partition, sarama.OffsetOldest)
			if err != nil {
				return waiting(err)
			}
			from = oldest
		}
		// One byte: the first batch comes whole (a fetch returns at
		// least one), and only the offsets are read.
		block, version, err := fetchOnce(ctx, client, topic, partition, from, 1)
		if err == nil && !errors.Is(block.Err, sarama.ErrNoError) {
			err = block.Err
		}
		switch {
		case err == nil:
			retries = 0
			if version < 4 || block.LastStableOffset < 0 {
				return nil // no transactions before fetch v4 (Kafka 0.11)
			}
			if target < 0 {
				target = block.HighWaterMarkOffset
			}
			if stable = block.LastStableOffset; stable >= target {
				return nil
			}
			from = target // a fetch at the high watermark is empty
			if serr := sleepCtx(ctx, delay); serr != nil {
				return waiting(serr)
			}
		case ctx.Err() != nil:
			return waiting(ctx.Err())
		case errors.Is(err, sarama.ErrOffsetOutOfRange):
			from = -1 // retention moved the log start: list it again
		case retries < fetchRetries && retriableFetchError(err):
			retries++
			_ = Call(ctx, func() error { return client.RefreshMetadata(topic) })
			if serr := sleepCtx(ctx, time.Duration(retries)*fetchBackoff); serr != nil {
				return waiting(serr)
			}
		default:
			return waiting(fmt.Errorf("fetch %s/%d at %d: %w", topic, partition, from, err))
		}
	}
}

// Backoff of WaitStable.
const (
	stableBackoff    = 10 * time.Millisecond
	stableBackoffMax = 200 * time.Millisecond
)

// ReadPartition calls fn with each record of topic/partition from offset
// from on, in order, as a read_committed consumer sees them (no aborted
// records, no transaction markers), until the end that the first fetch
// reports (the last stable offset, at most the high watermark) or until fn
// returns false. It returns the offset after the last one read. Offsets
// missing from the log (compaction, markers, aborted records) are skipped.
//
// It fetches directly from the partition leader rather than through a
// sarama consumer, so that it knows where the end is even when the last
// offsets hold no record it can see.
func ReadPartition(ctx context.Context, client sarama.Client, topic string, partition int32, from int64, fn func(Record) bool) (int64, error) {
	next, end := from, int64(-1)
	maxBytes := int32(fetchMaxBytes)
	retries := 0
	for end < 0 || next < end {
		block, version, err := fetchOnce(ctx, client, topic, partition, next, maxBytes)
		if err == nil {
			err = block.Err
			if errors.Is(err, sarama.ErrNoError) {
				err = nil
			}
		}
		if errors.Is(err, sarama.ErrOffsetOutOfRange) {
			// Retention or a deletion moved the log start past next.
			oldest, lerr := ListOffset(ctx, client, topic, partition, sarama.OffsetOldest)
			if lerr == nil && oldest > next {
				next = oldest
				continue
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return next, ctx.Err()
			}
			if retries < fetchRetries && retriableFetchError(err) {
				retries++
				_ = Call(ctx, func() error { return client.RefreshMetadata(topic) })
				if serr := sleepCtx(ctx, time.Duration(retries)*fetchBackoff); serr != nil {
					return next, serr
				}
				continue
			}
			return next, fmt.Errorf("fetch %s/%d at %d: %w", topic, partition, next, err)
		}
		retries = 0
		if end < 0 {
			end = block.HighWaterMarkOffset
			if version >= 4 && block.LastStableOffset >= 0 && block.LastStableOffset < end {
				end = block.LastStableOffset
			}
			if next >= end {
				break
			}
		}
		before := next
		var stop bool
		next, stop = DecodeBlock(block, next, end, fn)
		if stop {
			return next, nil
		}
		if next == before {
			switch {
			case partialBlock(block) && maxBytes < fetchMaxBytesCap:
				maxBytes *= 2
			case partialBlock(block):
				return next, fmt.Errorf("fetch %s/%d at %d: record batch larger than %d bytes", topic, partition, next, maxBytes)
			default:
				// The response held no batch at all below the end:
				// empty batches left by compaction decode to nothing.
				// Step over the offset.
				next++
			}
		}
	}
	return next, nil
}

// DecodeBlock passes the visible records of block at or after next and
// below end to fn, and returns the offset after the last batch seen and
// whether fn asked to stop. Visible: no control records, and no records of
// the aborted transactions the block lists (a read_committed fetch lists
// them; a read_uncommitted one lists none, so every data record is seen).
// A batch cut off by the fetch size ends the block.
func DecodeBlock(block *sarama.FetchResponseBlock, next, end int64, fn func(Record) bool) (int64, bool) {
	// Aborted transactions, by first offset; a producer id enters the set
	// at its aborted transaction's first offset and leaves it at the abort
	// marker (what sarama's consumer and Kafka's do).
	aborted := make(map[int64]bool)
	pending := append([]*sarama.AbortedTransaction(nil), block.AbortedTransactions...)
	sortAborted(pending)
	emit := func(r Record) bool {
		if r.Offset < next || r.Offset >= end {
			return true
		}
		next = r.Offset + 1
		return fn(r)
	}
	for _, recs := range block.RecordsSet {
		switch {
		case recs.RecordBatch != nil:
			b := recs.RecordBatch
			if b.PartialTrailingRecord {
				return next, false
			}
			last := b.LastOffset()
			for len(pending) > 0 && pending[0].FirstOffset <= last {
				aborted[pending[0].ProducerID] = true
				pending = pending[1:]
			}
			skip := b.Control || (b.IsTransactional && aborted[b.ProducerID])
			if b.Control && isAbortMarker(b) {
				delete(aborted, b.ProducerID)
			}
			if !skip {
				base := millis(b.FirstTimestamp)
				for _, rec := range b.Records {
					ts, ms := b.FirstTimestamp.Add(rec.TimestampDelta), base
					if base >= 0 {
						ms += rec.TimestampDelta.Milliseconds()
					}
					if b.LogAppendTime {
						ts, ms = b.MaxTimestamp, millis(b.MaxTimestamp)
					}
					if !emit(Record{Offset: b.FirstOffset + rec.OffsetDelta, Key: rec.Key, Value: rec.Value, Headers: rec.Headers, Timestamp: ts, TimestampMs: ms,
						ProducerID: b.ProducerID, ProducerEpoch: b.ProducerEpoch}) {
						return next, true
					}
				}
			}
			// Everything of the batch below end has been seen.
			next = max(next, min(last+1, end))
		case recs.MsgSet != nil:
			// Legacy (pre-0.11) message sets, offsets as sarama computes them.
			for _, mb := range recs.MsgSet.Messages {
				msgs := mb.Messages()
				for _, m := range msgs {
					off, ts := m.Offset, m.Msg.Timestamp
					if m.Msg.Version >= 1 {
						off += mb.Offset - msgs[len(msgs)-1].Offset
						if m.Msg.LogAppendTime {
							ts = mb.Msg.Timestamp
						}
					}
					if !emit(Record{Offset: off, Key: m.Msg.Key, Value: m.Msg.Value, Timestamp: ts, TimestampMs: millis(ts), ProducerID: -1, ProducerEpoch: -1}) {
						return next, true
					}
				}
			}
		}
	}
	return next, false
}

// DecodeBlockInto is DecodeBlock appending the records to dst, which it
// grows at most once, to hold every record of the block: one allocation
// per block instead of a call per record. It returns dst and the offset
// after the last batch seen.
func DecodeBlockInto(block *sarama.FetchResponseBlock, next, end int64, dst []Record) ([]Record, int64) {
	if n := blockRecords(block); cap(dst)-len(dst) < n {
		dst = append(make([]Record, 0, len(dst)+n), dst...)
	}
	next, _ = DecodeBlock(block, next, end, func(r Record) bool {
		dst = append(dst, r)
		return true
	})
	return dst, next
}

// blockRecords is the number of records block holds, control records and
// aborted ones included: an upper bound of what DecodeBlock passes on.
func blockRecords(block *sarama.FetchResponseBlock) int {
	n := 0
	for _, recs := range block.RecordsSet {
		switch {
		case recs.RecordBatch != nil:
			n += len(recs.RecordBatch.Records)
		case recs.MsgSet != nil:
			for _, mb := range recs.MsgSet.Messages {
				n += len(mb.Messages())
			}
		}
	}
	return n
}

// millis is t in Unix milliseconds, -1 for the zero time: what sarama
// decodes a timestamp of -1 (none) to.
func millis(t time.Time) int64 {
	if t.IsZero() {
		return -1
	}
	return t.UnixMilli()
}

// isAbortMarker reports whether control batch b holds an ABORT marker: the
// control record's key is version INT16, type INT16 (0 abort, 1 commit).
func isAbortMarker(b *sarama.RecordBatch) bool {
	if len(b.Records) == 0 || len(b.Records[0].Key) < 4 {
		return false
	}
	k := b.Records[0].Key
	return k[2] == 0 && k[3] == 0
}

func sortAborted(a []*sarama.AbortedTransaction) {
	for i := 1; i < len(a); i++ { // insertion sort: a handful at most
		for j := i; j > 0 && a[j].FirstOffset < a[j-1].FirstOffset; j-- {
			a[j], a[j-1] = a[j-1], a[j]
		}
	}
}

// partialBlock reports whether block holds only an incomplete batch, which
// a larger fetch size would complete.
func partialBlock(block *sarama.FetchResponseBlock) bool {
	if block.Partial {
		return true
	}
	if len(block.RecordsSet) != 1 {
		return false
	}
	r := block.RecordsSet[0]
	return (r.RecordBatch != nil && r.RecordBatch.PartialTrailingRecord) ||
		(r.MsgSet != nil && r.MsgSet.PartialTrailingMessage)
}

// fetchOnce sends one Fetch for topic/partition at offset to its leader.
func fetchOnce(ctx context.Context, client sarama.Client, topic string, partition int32, offset int64, maxBytes int32) (*sarama.FetchResponseBlock, int16, error) {
	req := &sarama.FetchRequest{
		Version:     FetchVersion(client.Config().Version),
		MaxWaitTime: 100,
		MinBytes:    1,
	}
	if req.Version >= 3 {
		req.MaxBytes = maxBytes
	}
	if req.Version >= 4 {
		req.Isolation = sarama.ReadCommitted
	}
	if req.Version >= 7 {
		req.SessionID, req.SessionEpoch = 0, -1 // no fetch session
	}
	req.AddBlock(topic, partition, offset, maxBytes, -1)
	// block and version are read only when the call completed: after ctx
	// ended, the abandoned call may still write them (and sarama may
	// lower req.Version to what the broker supports).
	var block *sarama.FetchResponseBlock
	var version int16
	err := Call(ctx, func() error {
		b, err := client.Leader(topic, partition)
		if err != nil {
			return err
		}
		resp, err := b.Fetch(req)
		CloseOnTransportError(b, err)
		if err != nil {
			return err
		}
		if block = resp.GetBlock(topic, partition); block == nil {
			return sarama.ErrIncompleteResponse
		}
		version = req.Version
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	return block, version, nil
}

// retriableFetchError reports whether a fetch failed for a reason that a
// metadata refresh and another try may cure.
func retriableFetchError(err error) bool {
	return errors.Is(err, sarama.ErrNotLeaderForPartition) ||
		errors.Is(err, sarama.ErrLeaderNotAvailable) ||
		errors.Is(err, sarama.ErrReplicaNotAvailable) ||
		errors.Is(err, sarama.ErrFencedLeaderEpoch) ||
		errors.Is(err, sarama.ErrUnknownLeaderEpoch) ||
		errors.Is(err, sarama.ErrOffsetNotAvailable) ||
		errors.Is(err, sarama.ErrIncompleteResponse) ||
		RetriableError(err)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// RetriableError reports whether err (or one of the joined per-partition
// errors) says the coordinator moved or is not ready, or the connection to
// the broker broke: cases where looking the broker up again and retrying
// can succeed.
func RetriableError(err error) bool {
	return errors.Is(err, sarama.ErrNotCoordinatorForConsumer) ||
		errors.Is(err, sarama.ErrConsumerCoordinatorNotAvailable) ||
		errors.Is(err, sarama.ErrOffsetsLoadInProgress) ||
		errors.Is(err, sarama.ErrNotConnected) ||
		errors.Is(err, sarama.ErrBrokerNotAvailable) ||
		errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE)
}

// Call runs fn, a blocking sarama call that takes no ctx, and returns its
// error, or ctx.Err() as soon as ctx is done. In the latter case fn keeps
// running in its goroutine until it returns by itself (sarama's
// Net.ReadTimeout/WriteTimeout bound it); its result is dropped.
func Call(ctx context.Context, fn func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}
