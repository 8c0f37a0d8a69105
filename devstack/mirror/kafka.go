package mirror

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/kswitch/kswitch/internal/kafka"
)

// This file holds the mirror's Kafka requests, sent straight to partition
// leaders with sarama's Broker API. None of them retries: the mirror's loop
// does, after deciding what a failure means.

const (
	// maxBatchRecords and maxBatchBytes bound one produced batch, well under
	// a broker's default message.max.bytes (1 MiB) even though the source
	// batch may have been compressed and the copy is not.
	maxBatchRecords = 500
	maxBatchBytes   = 512 << 10

	// fetchPartitionBytes is the first per-partition fetch size; it doubles
	// while a batch does not fit, up to fetchPartitionBytesMax.
	fetchPartitionBytes    = 1 << 20
	fetchPartitionBytesMax = 64 << 20
	fetchRequestBytes      = 16 << 20
)

// errOldFormat is returned for source data in the pre-0.11 message format,
// which the mirror does not copy.
var errOldFormat = errors.New("legacy (pre-0.11) message format is not supported")

// record is one record as the mirror carries it from source to target.
type record struct {
	offset  int64 // on the cluster it was read from
	key     []byte
	value   []byte
	ts      int64 // Unix milliseconds; -1 for none
	headers []*sarama.RecordHeader
}

func (r record) size() int {
	n := len(r.key) + len(r.value) + 32
	for _, h := range r.headers {
		n += len(h.Key) + len(h.Value) + 10
	}
	return n
}

// sameRecord reports whether a and b have the same key, value, timestamp
// and headers (their offsets may differ).
func sameRecord(a, b record) bool {
	if !bytes.Equal(a.key, b.key) || !bytes.Equal(a.value, b.value) || a.ts != b.ts || len(a.headers) != len(b.headers) {
		return false
	}
	for i, h := range a.headers {
		if !bytes.Equal(h.Key, b.headers[i].Key) || !bytes.Equal(h.Value, b.headers[i].Value) {
			return false
		}
	}
	return true
}

// chunk returns how many of recs, from the first, go into one batch: at
// least one, at most maxBatchRecords and, unless the first alone is larger,
// maxBatchBytes.
func chunk(recs []record) int {
	n, size := 0, 0
	for n < len(recs) && n < maxBatchRecords {
		size += recs[n].size()
		if n > 0 && size > maxBatchBytes {
			break
		}
		n++
	}
	return n
}

func fromMillis(ms int64) time.Time {
	if ms < 0 {
		return time.Time{} // sarama encodes it as -1: no timestamp
	}
	return time.UnixMilli(ms)
}

// parseBlock returns the records of a fetched partition at offsets >= from,
// and the offset to fetch next: past the last record, and past control
// batches and compacted-away offsets at the end of a batch. partial reports
// that a batch was cut off by the fetch size and nothing follows it. The
// decoding is kafka.DecodeBlock's; the mirror fetches read_uncommitted, so
// every data record is copied.
func parseBlock(block *sarama.FetchResponseBlock, from int64) (recs []record, next int64, partial bool, err error) {
	for _, rs := range block.RecordsSet {
		if rs.RecordBatch == nil && rs.MsgSet != nil && len(rs.MsgSet.Messages) > 0 {
			return nil, from, false, errOldFormat
		}
	}
	next, _ = kafka.DecodeBlock(block, from, math.MaxInt64, func(r kafka.Record) bool {
		recs = append(recs, record{offset: r.Offset, key: r.Key, value: r.Value, ts: r.TimestampMs, headers: r.Headers})
		return true
	})
	return recs, next, len(recs) == 0 && endsPartial(block), nil
}

// endsPartial reports whether block holds a record batch cut off by the
// fetch size.
func endsPartial(block *sarama.FetchResponseBlock) bool {
	for _, rs := range block.RecordsSet {
		if rs.RecordBatch != nil && rs.RecordBatch.PartialTrailingRecord {
			return true
		}
	}
	return false
}

func newFetchRequest(v sarama.KafkaVersion, maxWait time.Duration) *sarama.FetchRequest {
	req := &sarama.FetchRequest{
		Version:     kafka.FetchVersion(v),
		MaxWaitTime: int32(maxWait / time.Millisecond),
		MinBytes:    1,
		MaxBytes:    fetchRequestBytes,
		Isolation:   sarama.ReadUncommitted,
	}
	if req.Version >= 7 {
		req.SessionID, req.SessionEpoch = 0, -1 // no fetch session
	}
	return req
}

// isLeaderError reports errors after which the client's metadata should be
// refreshed before the next try.
func isLeaderError(err error) bool {
	var kerr sarama.KError
	if !errors.As(err, &kerr) {
		return true // a transport error: the broker may have moved or died
	}
	switch kerr {
	case sarama.ErrNotLeaderForPartition, sarama.ErrLeaderNotAvailable, sarama.ErrUnknownTopicOrPartition,
		sarama.ErrFencedLeaderEpoch, sarama.ErrUnknownLeaderEpoch, sarama.ErrNotEnoughReplicas,
		sarama.ErrReplicaNotAvailable, sarama.ErrOffsetNotAvailable:
		return true
	}
	return false
}

// produce writes recs to topic/partition as one batch (appended all or
// nothing) with acks=all and returns the offset of the first. Any error
// leaves the outcome unknown: the batch may have been appended.
func produce(cl sarama.Client, v sarama.KafkaVersion, topic string, partition int32, recs []record) (int64, error) {
	if len(recs) == 0 {
		return -1, errors.New("mirror: produce: empty batch")
	}
	b, err := cl.Leader(topic, partition)
	if err != nil {
		return -1, err
	}
	first := recs[0].ts
	batch := &sarama.RecordBatch{
		Version:         2,
		Codec:           sarama.CompressionNone,
		FirstTimestamp:  fromMillis(first),
		LastOffsetDelta: int32(len(recs) - 1),
		ProducerID:      -1, // not idempotent: the mirror deduplicates itself
		ProducerEpoch:   -1,
		FirstSequence:   -1,
		Records:         make([]*sarama.Record, len(recs)),
	}
	maxTS := first
	for i, r := range recs {
		var delta time.Duration
		if first >= 0 && r.ts >= 0 {
			delta = time.Duration(r.ts-first) * time.Millisecond
		}
		maxTS = max(maxTS, r.ts)
		batch.Records[i] = &sarama.Record{
			OffsetDelta:    int64(i),
			TimestampDelta: delta,
			Key:            r.key,
			Value:          r.value,
			Headers:        r.headers,
		}
	}
	batch.MaxTimestamp = fromMillis(maxTS)
	req := &sarama.ProduceRequest{
		RequiredAcks: sarama.WaitForAll,
		Timeout:      int32(requestTimeout / 2 / time.Millisecond),
		Version:      kafka.ProduceVersion(v),
	}
	req.AddBatch(topic, partition, batch)
	resp, err := b.Produce(req)
	if err != nil {
		kafka.CloseOnTransportError(b, err)
		return -1, err
	}
	block := resp.GetBlock(topic, partition)
	if block == nil {
		return -1, sarama.ErrIncompleteResponse
	}
	if block.Err != sarama.ErrNoError {
		return -1, block.Err
	}
	return block.Offset, nil
}

// readRecords reads up to n records of topic/partition from offset from
// with fetches that do not wait, for checking what the target holds.
func readRecords(cl sarama.Client, v sarama.KafkaVersion, topic string, partition int32, from int64, n int) ([]record, error) {
	var out []record
	size := int32(fetchPartitionBytes)
	for len(out) < n {
		b, err := cl.Leader(topic, partition)
		if err != nil {
			return out, err
		}
		req := newFetchRequest(v, 0)
		req.AddBlock(topic, partition, from, size, -1)
		resp, err := b.Fetch(req)
		if err != nil {
			kafka.CloseOnTransportError(b, err)
			return out, err
		}
		block := resp.GetBlock(topic, partition)
		if block == nil {
			return out, sarama.ErrIncompleteResponse
		}
		if block.Err != sarama.ErrNoError {
			return out, block.Err
		}
		recs, next, partial, err := parseBlock(block, from)
		if err != nil {
			return out, err
		}
		out = append(out, recs...)
		switch {
		case partial && size < fetchPartitionBytesMax:
			size *= 2
			continue
		case partial:
			return out, fmt.Errorf("batch at offset %d is larger than %d bytes", from, size)
		case next == from:
			return out, fmt.Errorf("no record at offset %d (high watermark %d)", from, block.HighWaterMarkOffset)
		}
		from = next
	}
	return out[:n], nil
}

// ensureTopic creates topic with partitions partitions on the cluster of cl
// unless it exists, and returns its partition count.
func ensureTopic(cl sarama.Client, v sarama.KafkaVersion, topic string, partitions int32, configs map[string]*string) (int32, error) {
	// A refresh of all topics, not of this one: sarama retries a missing
	// topic after a backoff.
	if err := cl.RefreshMetadata(); err != nil {
		return 0, err
	}
	topics, err := cl.Topics()
	if err != nil {
		return 0, err
	}
	if slices.Contains(topics, topic) {
		ps, err := cl.Partitions(topic)
		return int32(len(ps)), err
	}
	controller, err := cl.Controller()
	if err != nil {
		return 0, err
	}
	req := sarama.NewCreateTopicsRequest(v, map[string]*sarama.TopicDetail{
		topic: {NumPartitions: partitions, ReplicationFactor: -1, ConfigEntries: configs},
	}, requestTimeout/2, false)
	resp, err := controller.CreateTopics(req)
	if err != nil {
		return 0, err
	}
	if te := resp.TopicErrors[topic]; te != nil && te.Err != sarama.ErrNoError && te.Err != sarama.ErrTopicAlreadyExists {
		return 0, te
	}
	if err := cl.RefreshMetadata(topic); err != nil {
		return 0, err
	}
	ps, err := cl.Partitions(topic)
	if err != nil {
		return 0, err
	}
	return int32(len(ps)), nil
}

// growTopic grows topic to at least partitions partitions with a
// CreatePartitions request to the controller (a topic already that large
// is left alone).
func growTopic(cl sarama.Client, v sarama.KafkaVersion, topic string, partitions int32) error {
	if err := cl.RefreshMetadata(topic); err != nil {
		return err
	}
	ps, err := cl.Partitions(topic)
	if err != nil {
		return err
	}
	if int32(len(ps)) >= partitions {
		return nil
	}
	controller, err := cl.Controller()
	if err != nil {
		return err
	}
	req := &sarama.CreatePartitionsRequest{
		TopicPartitions: map[string]*sarama.TopicPartition{topic: {Count: partitions}},
		Timeout:         requestTimeout / 2,
	}
	if v.IsAtLeast(sarama.V2_0_0_0) {
		req.Version = 1
	}
	resp, err := controller.CreatePartitions(req)
	if err != nil {
		return err
	}
	// INVALID_PARTITIONS: another writer grew it first; the refresh tells.
	if te := resp.TopicPartitionErrors[topic]; te != nil && te.Err != sarama.ErrNoError && te.Err != sarama.ErrInvalidPartitions {
		return te
	}
	if err := cl.RefreshMetadata(topic); err != nil {
		return err
	}
	if ps, err = cl.Partitions(topic); err != nil {
		return err
	}
	if int32(len(ps)) < partitions {
		return fmt.Errorf("%s has %d partitions after CreatePartitions to %d", topic, len(ps), partitions)
	}
	return nil
}

// dialer is the mirror's sarama dialer. It remembers its connections so
// that closeAll can cut them, which fails every request in flight at once
// (sarama holds a broker's lock for a whole request, so closing a client
// would instead wait for a hung request to time out). After closeAll it
// refuses to dial.
type dialer struct {
	d      net.Dialer
	ctx    context.Context // cancelled by closeAll, to abort dials
	cancel context.CancelFunc

	mu     sync.Mutex
	conns  map[*trackedConn]struct{}
	closed bool
}

func newDialer() *dialer {
	ctx, cancel := context.WithCancel(context.Background())
	return &dialer{
		d:   net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second},
		ctx: ctx, cancel: cancel,
		conns: make(map[*trackedConn]struct{}),
	}
}

var errDialerClosed = errors.New("mirror: stopped")

// Dial implements sarama's proxy.Dialer.
func (d *dialer) Dial(network, addr string) (net.Conn, error) {
	d.mu.Lock()
	closed := d.closed
	d.mu.Unlock()
	if closed {
		return nil, errDialerClosed
	}
	c, err := d.d.DialContext(d.ctx, network, addr)
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, d: d}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		c.Close()
		return nil, errDialerClosed
	}
	d.conns[tc] = struct{}{}
	return tc, nil
}

func (d *dialer) closeAll() {
	d.cancel()
	d.mu.Lock()
	d.closed = true
	conns := d.conns
	d.conns = make(map[*trackedConn]struct{})
	d.mu.Unlock()
	for c := range conns {
		c.Conn.Close()
	}
}

type trackedConn struct {
	net.Conn
	d *dialer
}

func (c *trackedConn) Close() error {
	c.d.mu.Lock()
	delete(c.d.conns, c)
	c.d.mu.Unlock()
	return c.Conn.Close()
}
