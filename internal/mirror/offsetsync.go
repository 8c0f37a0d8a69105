package mirror

import "encoding/binary"

// encodeOffsetSync returns the key and value of a MirrorMaker 2 offset-sync
// record (Kafka's org.apache.kafka.connect.mirror.OffsetSync): big-endian,
// STRING = INT16 length + UTF-8.
//
//	key:   topic STRING (the upstream name), partition INT32
//	value: upstream offset INT64, downstream offset INT64
//
// Topic names are at most 249 bytes, so the length always fits.
func encodeOffsetSync(topic string, partition int32, upstream, downstream int64) (key, value []byte) {
	key = make([]byte, 0, 2+len(topic)+4)
	key = binary.BigEndian.AppendUint16(key, uint16(len(topic)))
	key = append(key, topic...)
	key = binary.BigEndian.AppendUint32(key, uint32(partition))
	value = make([]byte, 0, 16)
	value = binary.BigEndian.AppendUint64(value, uint64(upstream))
	value = binary.BigEndian.AppendUint64(value, uint64(downstream))
	return key, value
}
