package kafka

// ProducerDone is closed once p's resolver and count refresher
// goroutines have returned, after Close: Close returns at its deadline
// while they may still be in a metadata call bounded by the client's
// timeouts.
func ProducerDone(p *Producer) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		<-p.resolved
		<-p.topics.done
		close(done)
	}()
	return done
}

// TxnStreamDone is closed once s's goroutine has returned.
func TxnStreamDone(s *TxnStream) <-chan struct{} { return s.done }

// MaxPartitionInFlight is the most batches one partition of p has had in
// flight at once.
func MaxPartitionInFlight(p *Producer) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxPartInflight
}

// SkipSequence makes the next batch numbered of topic's partition skip a
// sequence: the broker refuses it, and every batch behind it, as out of
// order, as when it lost the producer's state (RELAY.md §6 F8).
func SkipSequence(p *Producer, topic string, partition int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gapAt == nil {
		p.gapAt = map[topicPartition]bool{}
	}
	p.gapAt[topicPartition{topic, partition}] = true
}
