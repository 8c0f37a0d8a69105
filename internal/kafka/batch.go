package kafka

import (
	"math"
	"time"

	"github.com/IBM/sarama"
)

// recordOverhead bounds what a v2 record adds to its key, value and
// headers: length, attributes, timestamp and offset deltas, key and value
// lengths, header count (varints, at their widest for our sizes).
const recordOverhead = 24

// batch is the records of one destination partition sent as one v2
// RecordBatch. Once first sent it keeps its sequence across every resend
// (until a bump renumbers every unacknowledged batch, §3). Its encoding
// is not kept: each send encodes it again (recordBatch).
type batch struct {
	msgs  []*Message
	codec sarama.CompressionCodec
	level int
	size  int // the records' bytes, estimated: what batchBytes bounds

	// seq is the batch's first sequence, -1 until it is first sent.
	seq int32
	// maybe is set when the batch is sent, and cleared by a definite
	// refusal (not written) unless unsure: a batch that is maybe written
	// is never renumbered (drain-and-bump resends it under its sequence
	// first).
	maybe bool
	// unsure is set by an answer that leaves the outcome open (a lost
	// connection, REQUEST_TIMED_OUT, ...) and is sticky: a later send's
	// refusal (NOT_LEADER, MESSAGE_TOO_LARGE, ...) says nothing about the
	// earlier one, which may be in the log. Only a lost sequence answered
	// to this batch at the partition's head clears it (settle):
	// OUT_OF_ORDER_SEQUENCE / UNKNOWN_PRODUCER_ID say the broker has not
	// got its sequence; after an epoch refusal it is renumbered anyway.
	unsure bool
	// gen is the transaction the batch belongs to, for a TxnStream's
	// partition (TxnStream.gen); 0 otherwise.
	gen uint64
}

func newBatch(m *Message) *batch {
	return &batch{codec: m.Codec, level: m.CompressionLevel, seq: -1}
}

// fits reports whether m may join b: same codec, and b stays within the
// limits.
func (b *batch) fits(m *Message, size, maxBytes, maxRecords int) bool {
	return m.Codec == b.codec && m.CompressionLevel == b.level &&
		len(b.msgs) < maxRecords && (len(b.msgs) == 0 || b.size+size <= maxBytes)
}

func (b *batch) add(m *Message, size int) {
	b.msgs = append(b.msgs, m)
	b.size += size
}

// recordBatch returns a RecordBatch of b's records with the producer id,
// epoch and b's sequence, for one send. sarama encodes (and compresses)
// it inside AsyncProduce, into a copy of the records that it keeps in the
// RecordBatch: kept with b until the acknowledgement, that copy doubled
// the bytes of every batch in flight (its records stay in their fetch
// responses until then anyway), and the garbage collector, held to
// agent.memory_limit_mib, ran without pause. A resend, rare, encodes
// again: the same records under the same sequence, the same bytes.
func (b *batch) recordBatch(pid int64, epoch int16) *sarama.RecordBatch {
	rb := encodeBatch(b.msgs, b.codec, b.level)
	rb.ProducerID, rb.ProducerEpoch, rb.FirstSequence = pid, epoch, b.seq
	return rb
}

// encodeBatch builds the RecordBatch of msgs: one slab of records, the
// keys, values and headers the messages' own (no copy until sarama
// encodes the request).
func encodeBatch(msgs []*Message, codec sarama.CompressionCodec, level int) *sarama.RecordBatch {
	recs := make([]sarama.Record, len(msgs))
	ptrs := make([]*sarama.Record, len(msgs))
	nh := 0
	for _, m := range msgs {
		nh += len(m.Headers)
	}
	var hdrs []*sarama.RecordHeader // one slab for the batch, pointing into the messages' headers
	if nh > 0 {
		hdrs = make([]*sarama.RecordHeader, 0, nh)
	}
	first := msgs[0].Timestamp.UnixMilli()
	maxTs := first
	for i, m := range msgs {
		ts := m.Timestamp.UnixMilli()
		maxTs = max(maxTs, ts)
		recs[i] = sarama.Record{
			Key: m.Key, Value: m.Value,
			OffsetDelta:    int64(i),
			TimestampDelta: time.Duration(ts-first) * time.Millisecond,
		}
		if len(m.Headers) > 0 {
			start := len(hdrs)
			for j := range m.Headers {
				hdrs = append(hdrs, &m.Headers[j])
			}
			recs[i].Headers = hdrs[start:len(hdrs):len(hdrs)]
		}
		ptrs[i] = &recs[i]
	}
	if level == 0 {
		level = sarama.CompressionLevelDefault
	}
	return &sarama.RecordBatch{
		Version:          2,
		Codec:            codec,
		CompressionLevel: level,
		FirstTimestamp:   time.UnixMilli(first),
		MaxTimestamp:     time.UnixMilli(maxTs),
		LastOffsetDelta:  int32(len(msgs) - 1),
		Records:          ptrs,
	}
}

// split cuts b (of n > 1 records) in two halves that keep its sequence
// range: the first starts at b's sequence, the second n/2 later, so the
// sequences of the batches behind b stay valid.
func (b *batch) split() (*batch, *batch) {
	h := len(b.msgs) / 2
	first := &batch{msgs: b.msgs[:h:h], codec: b.codec, level: b.level, seq: b.seq, gen: b.gen}
	second := &batch{msgs: b.msgs[h:], codec: b.codec, level: b.level, seq: b.seq, gen: b.gen}
	if b.seq >= 0 {
		second.seq = addSeq(b.seq, int32(h))
	}
	for _, m := range first.msgs {
		first.size += messageSize(m)
	}
	second.size = b.size - first.size
	return first, second
}

// messageSize estimates m's bytes in a batch.
func messageSize(m *Message) int {
	n := len(m.Key) + len(m.Value) + recordOverhead
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value) + 10
	}
	return n
}

// addSeq is s + n as Kafka counts sequences: they wrap from MaxInt32 to 0.
func addSeq(s, n int32) int32 {
	v := int64(s) + int64(n)
	if v > math.MaxInt32 {
		v -= math.MaxInt32 + 1
	}
	if v < 0 {
		v += math.MaxInt32 + 1
	}
	return int32(v)
}
