package routing

import "github.com/IBM/sarama"

// partitioner chooses each message's partition by the partitioner of the
// channel it was routed to, which it reads from the message's Metadata.
// sarama makes one per topic and calls it from that topic's goroutine only.
type partitioner struct {
	hash, random, roundRobin sarama.Partitioner
}

// newPartitioner is a sarama.PartitionerConstructor.
func newPartitioner(topic string) sarama.Partitioner {
	return &partitioner{
		hash:       sarama.NewMurmur2Partitioner(topic),
		random:     sarama.NewRandomPartitioner(topic),
		roundRobin: sarama.NewRoundRobinPartitioner(topic),
	}
}

// kind returns the partitioner of m's channel; hash for a message that is
// not the router's.
func kind(m *sarama.ProducerMessage) (string, int32) {
	if om, ok := m.Metadata.(*outMsg); ok {
		return om.ch.Partitioner, om.srcPartition
	}
	return PartitionerHash, 0
}

// Partition implements sarama.Partitioner. With manual-same-partition a
// source partition the topic does not have is sarama.ErrInvalidPartition:
// the record goes to the dead-letter channel.
func (p *partitioner) Partition(m *sarama.ProducerMessage, n int32) (int32, error) {
	switch k, src := kind(m); k {
	case PartitionerRandom:
		return p.random.Partition(m, n)
	case PartitionerRoundRobin:
		return p.roundRobin.Partition(m, n)
	case PartitionerManual:
		if src < 0 || src >= n {
			return -1, sarama.ErrInvalidPartition
		}
		return src, nil
	default:
		return p.hash.Partition(m, n)
	}
}

// RequiresConsistency implements sarama.Partitioner.
func (p *partitioner) RequiresConsistency() bool { return true }

// MessageRequiresConsistency implements sarama.DynamicConsistencyPartitioner:
// a keyed hash and a manual partition need every partition, available or
// not; random and round-robin choose among the writable ones.
func (p *partitioner) MessageRequiresConsistency(m *sarama.ProducerMessage) bool {
	switch k, _ := kind(m); k {
	case PartitionerRandom, PartitionerRoundRobin:
		return false
	case PartitionerManual:
		return true
	default:
		return m.Key != nil
	}
}
