package kafka

import "encoding/binary"

// HashPartition returns the partition of n that sarama's
// NewMurmur2Partitioner (the router's hash partitioner) and the Java
// client's default partitioner give key: murmur2, sign bit cleared,
// modulo n. A nil key has no hash partition; callers pick one (sarama
// picks at random). n must be positive.
func HashPartition(key []byte, n int32) int32 {
	return int32(murmur2(key)&0x7fffffff) % n
}

// murmur2 is Kafka's murmur2 (org.apache.kafka.common.utils.Utils), as
// sarama has it.
func murmur2(b []byte) uint32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	h := seed ^ uint32(len(b))
	for len(b) >= 4 {
		k := binary.LittleEndian.Uint32(b)
		b = b[4:]
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	switch len(b) {
	case 3:
		h ^= uint32(b[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(b[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(b[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return h
}
