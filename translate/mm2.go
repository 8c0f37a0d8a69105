package translate

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/IBM/sarama"
	"github.com/kswitch/kswitch/internal/kafka"
)

// MirrorMaker 2 record formats
//
// MirrorMaker 2 (Kafka's connect-mirror) writes two compacted internal
// topics that kswitch reads to translate offsets, and that kswitch's own
// in-process mirror writes in the same format (EncodeOffsetSync), so that
// one translator serves both. The encodings follow Kafka's
// org.apache.kafka.connect.mirror.OffsetSync and Checkpoint classes:
// Kafka protocol types, big-endian; STRING is an INT16 byte length (not -1:
// these fields are not nullable) followed by that many bytes of UTF-8.
//
// Offset-sync (topic mm2-offset-syncs.<target>.internal, on the source
// cluster by default, on the target with offset-syncs.topic.location=target;
// MirrorMaker 2 writes and reads partition 0 only):
//
//	key:   topic STRING (the UPSTREAM topic name, e.g. "orders"), partition INT32
//	value: upstream offset INT64, downstream offset INT64   (no version field)
//
// It says: the record at upstream offset U of that source partition was
// written at downstream offset D of its replica (same partition number).
//
// Checkpoint (topic <source alias>.checkpoints.internal on the target;
// written to partition 0):
//
//	key:   group STRING, topic STRING, partition INT32
//	value: version INT16 (0), upstream offset INT64, downstream offset INT64,
//	       metadata STRING
//
// The key's topic is the DOWNSTREAM (replica) name: MirrorCheckpointTask
// builds the Checkpoint with renameTopicPartition(upstream), which is
// formatRemoteTopic(sourceAlias, topic) ("A.orders" under the default
// policy; the same name under IdentityReplicationPolicy; and a topic that
// came from the target itself is renamed back to its original name).
// Checkpoint.java itself just serialises whatever TopicPartition it is
// given. The value says: group had committed upstream offset U on the
// source, which MirrorMaker 2 translated to downstream offset D.
//
// MirrorMaker 2's translation (OffsetSyncStore.translateDownstream) takes
// the latest sync with upstream <= the group's offset G and answers
// downstream + (G == upstream ? 0 : 1): it may rewind, but never skips,
// because it cannot know how many of the upstream records after the sync
// were replicated. kswitch applies the same rule.

// checkpointVersion is the only Checkpoint value version Kafka defines.
const checkpointVersion = 0

// OffsetSync is a decoded MirrorMaker 2 offset-sync record.
type OffsetSync struct {
	// Topic is the upstream (source cluster) topic name.
	Topic     string
	Partition int32
	// Upstream is an offset on the source partition and Downstream the
	// offset of the same record on the replica partition.
	Upstream, Downstream int64
}

// Checkpoint is a decoded MirrorMaker 2 checkpoint record.
type Checkpoint struct {
	Group string
	// Topic is the downstream (replica) topic name.
	Topic     string
	Partition int32
	// Upstream is the group's committed offset on the source partition,
	// Downstream MirrorMaker 2's translation of it on the replica.
	Upstream, Downstream int64
	// Metadata is the metadata committed with the upstream offset.
	Metadata string
}

// EncodeOffsetSync returns the key and value of a MirrorMaker 2 offset-sync
// record saying that upstream offset upstream of topic/partition (topic is
// the upstream name) was replicated to downstream offset downstream.
// Writers must produce it to partition 0 of the offset-syncs topic, the only
// one MirrorMaker 2 and Translator read.
//
// It panics if topic is longer than 32767 bytes, which no valid Kafka topic
// name is (they are at most 249 characters).
func EncodeOffsetSync(topic string, partition int32, upstream, downstream int64) (key, value []byte) {
	key = appendString(nil, topic)
	key = binary.BigEndian.AppendUint32(key, uint32(partition))
	value = make([]byte, 0, 16)
	value = binary.BigEndian.AppendUint64(value, uint64(upstream))
	value = binary.BigEndian.AppendUint64(value, uint64(downstream))
	return key, value
}

// DecodeOffsetSync parses an offset-sync record. Bytes after the fields are
// ignored, as Kafka's own reader does.
func DecodeOffsetSync(key, value []byte) (OffsetSync, error) {
	var s OffsetSync
	k := decoder{b: key}
	s.Topic = k.string()
	s.Partition = k.int32()
	if k.err != nil {
		return OffsetSync{}, fmt.Errorf("offsets: offset-sync key %x: %w", key, k.err)
	}
	v := decoder{b: value}
	s.Upstream = v.int64()
	s.Downstream = v.int64()
	if v.err != nil {
		return OffsetSync{}, fmt.Errorf("offsets: offset-sync value %x: %w", value, v.err)
	}
	return s, nil
}

// EncodeCheckpoint returns the key and value of a MirrorMaker 2 checkpoint
// record (value version 0). topic is the downstream (replica) name.
//
// It panics if group, topic or metadata is longer than 32767 bytes, which
// Kafka's own encoder refuses too.
func EncodeCheckpoint(group, topic string, partition int32, upstream, downstream int64, metadata string) (key, value []byte) {
	key = appendString(nil, group)
	key = appendString(key, topic)
	key = binary.BigEndian.AppendUint32(key, uint32(partition))
	value = binary.BigEndian.AppendUint16(nil, checkpointVersion)
	value = binary.BigEndian.AppendUint64(value, uint64(upstream))
	value = binary.BigEndian.AppendUint64(value, uint64(downstream))
	value = appendString(value, metadata)
	return key, value
}

// DecodeCheckpoint parses a checkpoint record. A value version other than 0
// is refused: Kafka defines no other, and its reader asserts version 0.
// Bytes after the fields are ignored.
func DecodeCheckpoint(key, value []byte) (Checkpoint, error) {
	var c Checkpoint
	k := decoder{b: key}
	c.Group = k.string()
	c.Topic = k.string()
	c.Partition = k.int32()
	if k.err != nil {
		return Checkpoint{}, fmt.Errorf("offsets: checkpoint key %x: %w", key, k.err)
	}
	v := decoder{b: value}
	if version := v.int16(); v.err == nil && version != checkpointVersion {
		return Checkpoint{}, fmt.Errorf("offsets: checkpoint value version %d, want %d", version, checkpointVersion)
	}
	c.Upstream = v.int64()
	c.Downstream = v.int64()
	c.Metadata = v.string()
	if v.err != nil {
		return Checkpoint{}, fmt.Errorf("offsets: checkpoint value %x: %w", value, v.err)
	}
	return c, nil
}

func appendString(b []byte, s string) []byte {
	if len(s) > math.MaxInt16 {
		panic(fmt.Sprintf("offsets: string of %d bytes does not fit a Kafka STRING", len(s)))
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

var errShort = errors.New("too short")

// decoder reads Kafka protocol fields; the first error sticks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.err = errShort
		return nil
	}
	p := d.b[:n]
	d.b = d.b[n:]
	return p
}

func (d *decoder) int16() int16 {
	if p := d.take(2); p != nil {
		return int16(binary.BigEndian.Uint16(p))
	}
	return 0
}

func (d *decoder) int32() int32 {
	if p := d.take(4); p != nil {
		return int32(binary.BigEndian.Uint32(p))
	}
	return 0
}

func (d *decoder) int64() int64 {
	if p := d.take(8); p != nil {
		return int64(binary.BigEndian.Uint64(p))
	}
	return 0
}

func (d *decoder) string() string {
	n := d.int16()
	if d.err == nil && n < 0 {
		d.err = fmt.Errorf("string length %d", n)
	}
	return string(d.take(int(n)))
}

// mm2Data is what a Translate call read of MirrorMaker 2's topics for its
// partition. Each part has either data or the reason it has none.
type mm2Data struct {
	// syncs are the partition's offset-syncs in topic order, from the last
	// regression on (see keepSync).
	syncs    []OffsetSync
	syncsErr error
	// checkpoint is the group's last checkpoint for the partition, nil if
	// none (cpErr says why).
	checkpoint *Checkpoint
	cpErr      error
	// skipped counts records that did not decode.
	skipped int
}

// keepSync appends s to syncs, first dropping every earlier sync if s goes
// back in upstream or downstream offset: the source or the replica
// partition was recreated or truncated, and the older pairs no longer
// describe it (MirrorMaker 2 resets its sync store the same way on an
// upstream regression).
func keepSync(syncs []OffsetSync, s OffsetSync) []OffsetSync {
	if n := len(syncs); n > 0 && (s.Upstream < syncs[n-1].Upstream || s.Downstream < syncs[n-1].Downstream) {
		syncs = syncs[:0]
	}
	return append(syncs, s)
}

// readCheckpoint reads partition 0 of the checkpoints topic (where
// MirrorMaker 2 writes them) and keeps the last checkpoint of
// group/topic/partition; a tombstone for the key forgets it.
func readCheckpoint(ctx context.Context, client sarama.Client, cpTopic, group, topic string, partition int32, d *mm2Data) error {
	wantKey, _ := EncodeCheckpoint(group, topic, partition, 0, 0, "")
	return kafka.ReadAll(ctx, client, cpTopic, 0, func(r kafka.Record) bool {
		if string(r.Key) != string(wantKey) {
			return true
		}
		if r.Value == nil {
			d.checkpoint = nil
			return true
		}
		c, err := DecodeCheckpoint(r.Key, r.Value)
		if err != nil {
			d.skipped++
			return true
		}
		d.checkpoint = &c
		return true
	})
}

// mm2Result is one MirrorMaker 2 translation.
type mm2Result struct {
	offset  int64
	rewound int64 // -1: unknown
	detail  string
}

// translateForward translates upstream position pos to the replica with
// the syncs and the checkpoint: the later of the two safe answers.
func (d *mm2Data) translateForward(pos int64) (mm2Result, error) {
	var best *mm2Result
	var why []string
	if d.syncsErr != nil {
		why = append(why, "offset-syncs: "+d.syncsErr.Error())
	} else if s, ok := latestSync(d.syncs, pos, func(s OffsetSync) int64 { return s.Upstream }); ok {
		r := stepFrom(pos, s.Upstream, s.Downstream)
		r.detail = fmt.Sprintf("offset-sync upstream %d → downstream %d", s.Upstream, s.Downstream) + r.detail
		best = &r
	} else {
		why = append(why, noSync(d.syncs, pos, "upstream", func(s OffsetSync) int64 { return s.Upstream }))
	}
	switch c := d.checkpoint; {
	case d.cpErr != nil:
		why = append(why, "checkpoints: "+d.cpErr.Error())
	case c == nil:
		why = append(why, "no checkpoint for the group")
	case c.Upstream > pos:
		why = append(why, fmt.Sprintf("checkpoint of upstream %d is past position %d", c.Upstream, pos))
	case c.Downstream < 0:
		why = append(why, fmt.Sprintf("checkpoint downstream %d is negative", c.Downstream))
	case best == nil || c.Downstream > best.offset:
		// MirrorMaker 2's downstream offset is itself a conservative
		// translation of c.Upstream <= pos: safe, rewind unknown.
		best = &mm2Result{offset: c.Downstream, rewound: -1,
			detail: fmt.Sprintf("checkpoint of group %q: upstream %d → downstream %d", c.Group, c.Upstream, c.Downstream)}
	}
	if best == nil {
		return mm2Result{}, errors.New(strings.Join(why, ", "))
	}
	return *best, nil
}

// translateBackward translates replica position pos back to the source
// with the syncs inverted: the latest sync with downstream <= pos gives its
// upstream offset (+1 if pos is past it). Checkpoints are not used: they
// translate the group's upstream position forward, and their downstream
// offsets are already rounded down, so inverting one could skip records.
func (d *mm2Data) translateBackward(pos int64) (mm2Result, error) {
	if d.syncsErr != nil {
		return mm2Result{}, fmt.Errorf("offset-syncs: %w", d.syncsErr)
	}
	s, ok := latestSync(d.syncs, pos, func(s OffsetSync) int64 { return s.Downstream })
	if !ok {
		return mm2Result{}, errors.New(noSync(d.syncs, pos, "downstream", func(s OffsetSync) int64 { return s.Downstream }))
	}
	r := stepFrom(pos, s.Downstream, s.Upstream)
	r.detail = fmt.Sprintf("offset-sync downstream %d → upstream %d (inverted)", s.Downstream, s.Upstream) + r.detail
	return r, nil
}

// latestSync returns the last sync of syncs whose side (upstream or
// downstream offset) is <= pos. syncs are in topic order with both offsets
// non-decreasing (keepSync), so that is the one closest below pos.
func latestSync(syncs []OffsetSync, pos int64, side func(OffsetSync) int64) (OffsetSync, bool) {
	for i := len(syncs) - 1; i >= 0; i-- {
		if side(syncs[i]) <= pos {
			return syncs[i], true
		}
	}
	return OffsetSync{}, false
}

// stepFrom applies MirrorMaker 2's rule: a position at the sync's own
// offset maps exactly; one past it maps to one past the other side, since
// how many of the records in between were replicated is unknown. The
// records between that answer and the true continuation are delivered
// again: at most pos-from-1 of them (fewer when some were not replicated).
func stepFrom(pos, from, to int64) mm2Result {
	if pos == from {
		return mm2Result{offset: to, rewound: 0, detail: " (exact)"}
	}
	return mm2Result{offset: to + 1, rewound: pos - from - 1,
		detail: fmt.Sprintf(" +1, rewinds at most %d", pos-from-1)}
}

func noSync(syncs []OffsetSync, pos int64, side string, get func(OffsetSync) int64) string {
	if len(syncs) == 0 {
		return "no offset-sync for the partition"
	}
	return fmt.Sprintf("no offset-sync at or before %s offset %d (oldest kept: %d)", side, pos, get(syncs[0]))
}
